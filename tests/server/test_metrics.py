"""A run and a campaign watched: the coordinator's Prometheus metrics scraped by a real Prometheus
server during a run, the Grafana dashboard's queries against the series the coordinator exports,
and a campaign's progress in `fedseq-server status` through a real broker."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from conftest import ROOT, server_only
from fedseq.server.ops.broker import EmbeddedBroker, free_port

pytestmark = server_only

PROMETHEUS = shutil.which("prometheus")


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())["data"]["result"]


@pytest.mark.slow("a deployment scraped by a real Prometheus: 10 s on 2 cores")
def test_a_real_prometheus_scrapes_the_round_advancing(data_root, tmp_path):
    if PROMETHEUS is None:
        if os.environ.get("CI"):
            pytest.fail("no prometheus: .ci/run installs Debian's prometheus for this check")
        pytest.skip("no prometheus here (apt-get install prometheus)")
    metrics, web = free_port("127.0.0.1"), free_port("127.0.0.1")
    conf = tmp_path / "prometheus.yml"
    conf.write_text((ROOT / "deploy/prometheus/prometheus.yml").read_text()
                    .replace("scrape_interval: 5s", "scrape_interval: 1s")
                    .replace("127.0.0.1:9464", f"127.0.0.1:{metrics}"))
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'db'}",
                             f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sets = [f"data.root={str(data_root)!r}", "data.fraction=0.1", "data.num_clients=4", "rounds=12",
            "train.local_epochs=1", "train.join_ratio=1.0", "algorithm.name=fedavg", "deploy.port=0"]
    seen: list[float] = []
    server = None
    try:  # Prometheus is stopped whatever happens from here (fedseq-server missing included)
        server = subprocess.Popen(["fedseq-server", "start", "-q", "--local-devices", "2",
                                   "--client-threads", "1", "--out", str(tmp_path / "run"),
                                   "--metrics-port", str(metrics),
                                   *[a for s in sets for a in ("--set", s)]],
                                  stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            try:
                result = _query(web, "fedseq_round")
            except OSError:
                result = []  # Prometheus still starting
            if result:
                value = float(result[0]["value"][1])
                if not seen or value != seen[-1]:
                    seen.append(value)
            if len([v for v in seen if v >= 0]) >= 3:
                break
            time.sleep(0.5)
        assert len([v for v in seen if v >= 0]) >= 3, (seen, server.stderr.read()
                                                        if server.poll() is not None else "")
        assert seen == sorted(seen), seen  # the round only advances
        info = _query(web, "fedseq_run_info")
        assert info and info[0]["metric"]["algorithm"] == "fedavg"
        assert float(_query(web, "fedseq_updates_total")[0]["value"][1]) > 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        prom.terminate()
        prom.wait(30)


def test_the_dashboard_and_scrape_config_use_the_exported_series():
    from fedseq.server.ops.metrics import NAMES

    dashboard = json.loads((ROOT / "deploy/grafana/fedseq-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and dashboard["uid"]
    used = {re.sub(r"_(total|info)$", "", m) for e in exprs for m in re.findall(r"fedseq_[a-z_]+", e)}
    assert used <= set(NAMES), used - set(NAMES)
    assert {"fedseq_round", "fedseq_accuracy", "fedseq_campaign_left_seconds"} <= used
    promtool = shutil.which("promtool")
    if promtool:
        check = subprocess.run([promtool, "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


def test_status_shows_a_campaign_s_progress_from_the_broker_and_metrics_count_devices():
    from fedseq.common.config import ExperimentConfig
    from fedseq.common.protocol.link import Link, session_id
    from fedseq.common.protocol.messages import DeviceStatus
    from fedseq.common.protocol.topics import Topics
    from fedseq.server.cli.commands import _campaign_beacon
    from fedseq.server.ops.campaign import CampaignStatus
    from fedseq.server.ops.metrics import Metrics
    from fedseq.server.ops.status import format_fleet, read_fleet

    with EmbeddedBroker("127.0.0.1", 0) as broker:
        device = Link(session_id("test-device"), broker.url, [], lambda t, p: None)
        device.start()
        for name, state in (("jetson01", "online"), ("jetson02", "online"), ("jetson03", "offline")):
            device.publish(Topics().device_status(name),
                           DeviceStatus(device=name, state=state).encode(), retain=True)
        status = CampaignStatus(campaign="/data/weekend", run=3, runs=45, folder="dir01/fedavg/seed-2",
                                round=41, rounds=100, finished=2, failed=0, seconds_per_round=20.0,
                                left_s=(58 + 42 * 100) * 20.0, updated=time.time())
        metrics = Metrics(0)
        try:
            with _campaign_beacon(ExperimentConfig(), broker.url, {}, metrics) as publish:
                publish(status)
                time.sleep(1.0)
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as r:
                    scraped = r.read().decode()
        finally:
            metrics.close()
            device.stop()
        lines = format_fleet(read_fleet(broker.url, wait=1.0), broker.url)
    assert 'fedseq_devices{state="online"} 2.0' in scraped
    assert 'fedseq_devices{state="offline"} 1.0' in scraped
    line = next(x for x in lines if x.startswith("campaign "))
    assert "run 3 of 45 (dir01/fedavg/seed-2), round 42 of 100 done; 2 finished, 0 failed" in line
    assert "about 23 h 39 min left at 20.0 s a round" in line


def test_the_campaign_beacon_reads_statuses_under_the_run_s_caps(monkeypatch):
    """Hardening V, finding 4: the campaign beacon reads device statuses as the run's inbox does:
    one over STATUS_BYTES is dropped unread (before, 2 MiB junk statuses were parsed and stalled
    the coordinator), and a name's flood spends that name's budget alone."""
    from fedseq.common.config import ExperimentConfig
    from fedseq.common.protocol.link import Link, session_id
    from fedseq.common.protocol.messages import DeviceStatus
    from fedseq.common.protocol.topics import Topics
    from fedseq.server.cli.commands import _campaign_beacon
    from fedseq.server.ops.metrics import Metrics
    from fedseq.server.pools.mqtt.inbox import STATUS_BYTES

    parsed: list[int] = []
    real = DeviceStatus.decode.__func__
    monkeypatch.setattr(DeviceStatus, "decode",
                        classmethod(lambda cls, raw: parsed.append(len(raw)) or real(cls, raw)))
    with EmbeddedBroker("127.0.0.1", 0) as broker:
        device = Link(session_id("test-device"), broker.url, [], lambda t, p: None)
        device.start()
        metrics = Metrics(0)
        try:
            with _campaign_beacon(ExperimentConfig(), broker.url, {}, metrics):
                time.sleep(0.5)
                for _ in range(5):
                    device.publish(Topics().device_status("junk01"), b"{" * (STATUS_BYTES + 1))
                for _ in range(2000):
                    device.publish(Topics().device_status("flood01"), b"1234567")
                device.publish(Topics().device_status("jetson01"),
                               DeviceStatus(device="jetson01", state="online").encode())
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and metrics._heard.get("jetson01") is None:
                    time.sleep(0.2)
        finally:
            metrics.close()
            device.stop()
    assert "jetson01" in metrics._heard
    assert all(n <= STATUS_BYTES for n in parsed)
    assert parsed.count(7) < 400  # the flooding name's budget, not its 2,000 messages


def test_metrics_show_each_sites_devices_and_whether_its_partial_counted():
    """[hierarchy]: fedseq_site_devices by site and state from the rows' reporters and device
    failures; fedseq_site_partial 0 once a site's round failed (its row entry `site NAME`)."""
    from fedseq.common.config import load_config
    from fedseq.server.ops.metrics import Metrics
    from fedseq.server.rounds.records import RoundRecord

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as r:
            return r.read().decode()

    metrics = Metrics(0)
    try:
        metrics.run_started(load_config(None, ['hierarchy.sites={a=["d1","d2"],b=["d3"]}']))
        metrics.row(RoundRecord(round=0, phase="train", reported=[0, 1, 2],
                                reporters={0: "d1", 1: "d2", 2: "d3"}))
        first = scrape()
        metrics.row(RoundRecord(round=1, phase="train", reported=[0], reporters={0: "d1"},
                                device_failures={"d2": "it went offline",
                                                 "site b": "it sent nothing"}))
        second = scrape()
    finally:
        metrics.close()
    for line in ('fedseq_site_devices{site="a",state="reported"} 2.0',
                 'fedseq_site_devices{site="b",state="reported"} 1.0',
                 'fedseq_site_partial{site="a"} 1.0', 'fedseq_site_partial{site="b"} 1.0'):
        assert line in first, line
    for line in ('fedseq_site_devices{site="a",state="reported"} 1.0',
                 'fedseq_site_devices{site="a",state="failed"} 1.0',
                 'fedseq_site_devices{site="b",state="reported"} 0.0',
                 'fedseq_site_partial{site="a"} 1.0', 'fedseq_site_partial{site="b"} 0.0'):
        assert line in second, line
