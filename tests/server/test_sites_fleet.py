"""Edge sites on a fleet ([hierarchy] with fedseq-server start): a broker, an edge aggregator
(fedseq-server edge) and devices per site, the coordinator on its own broker."""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import torch

from conftest import (
    MOSQUITTO,
    PROJECT_ACL,
    ROOT,
    device_process,
    fmnist_devices,
    placed_config,
    placed_run_is_simulated,
    quick_config,
)
from fedseq.common.algorithms.plan import plan_from_dict
from fedseq.common.protocol.frames import Reassembler, pack_chunk, split_frame, unpack_chunk
from fedseq.common.protocol.messages import (
    SiteClient,
    SiteResultHeader,
    SiteStatus,
    SiteTaskHeader,
    Step,
)
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.server.ops.broker import free_port, write_local_mosquitto
from fedseq.server.ops.deployment import run_deployment
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.ops.sites_fleet import edge_command
from fedseq.server.ops.status import format_fleet, read_fleet

TWO_SITES = 'hierarchy.sites={a=["local01","local02"],b=["local03"]}'  # a: 0, 1, 3, 4; b: 2


def _children(pattern: str) -> list[int]:
    """This process's children whose command line matches `pattern`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and re.search(pattern, cmd):
            out.append(int(pid))
    return out


DP = ("privacy.enabled=true", "privacy.clip_norm=0.5", "privacy.noise_multiplier=0.5",
      "seeds.noise=7")
#: [secagg] within each site: 6 clients, so that each site's secure sum has two or more
SECURE = ("secagg.enabled=true", "data.num_clients=6")


@pytest.mark.slow("a fleet of two sites: three brokers, two edges, three daemons: 15 s on 2 cores")
@pytest.mark.parametrize("algorithm, k, extra", [("fedavg", 2, ()), ("fedper", 1, ()),
                                                 ("fedavg", 1, DP), ("fedavg", 2, SECURE)],
                         ids=["fedavg-k2", "fedper-k1", "dp-k1", "secagg-k2"])
def test_a_fleet_of_sites_is_the_simulation_bitwise(data_root, tmp_path, one_thread, algorithm, k,
                                                    extra):
    """Two sites, each with its broker, its edge aggregator and its devices: the global model,
    the accuracies and the rows' client accounting are the simulation's, bitwise (the edges
    fold with the round loop's own code in the same order); one message a site reached the
    coordinator each round. DP-FedAvg: the devices clip, the sites sum, the coordinator alone
    adds the noise (the edges never get its seed). [secagg]: each site's devices mask among
    themselves, their edge relays the stages and unmasks the site's sum."""
    cfg = quick_config(data_root, f"algorithm.name={algorithm}", "rounds=2", "deploy.port=0",
                       "train.threads=1", TWO_SITES, f"hierarchy.edge_rounds={k}", *extra)
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=3, client_threads=1,
                         announce=lambda m: None)
    sim = run_simulation(cfg, None)
    for k_, v in sim.global_weights.items():
        assert torch.equal(dep.global_weights[k_], v), k_
    for d, s in zip(dep.rows, sim.rows, strict=True):
        assert d["reported"] == s["reported"] == list(range(cfg.data.num_clients))
        assert d["upstream_messages"] == s["upstream_messages"] == 2
        assert d["global_acc"] == s["global_acc"] and d["personal_acc"] == s["personal_acc"]
        assert d["train_flops"] == s["train_flops"]
        # a secure round's key and share stages: as the devices sent them, and as a simulation
        # counts them (a flat secure fleet's rows differ from its simulation's the same way)
        assert d["bytes_up"] == (pytest.approx(s["bytes_up"], rel=1e-3) if extra == SECURE
                                 else s["bytes_up"])
        assert d.get("epsilon") == s.get("epsilon")
        assert d.get("secure_recovered") == s.get("secure_recovered")
        assert not d.get("device_failures")


PLACED_SITES = 'hierarchy.sites={a=["local01","local03"],b=["local02"]}'
#: three devices' folders: clients 0 (local01), 1-2 (local02), 3-4 (local03)
PLACED = {"local01": ["."], "local02": ["cam-a", "cam-b"], "local03": ["x", "y"]}


@pytest.mark.slow("a fleet of two sites with the data on its devices: 10 s on 2 cores")
@pytest.mark.parametrize("algorithm, k", [("fedper", 1), ("fedavg", 2)],
                         ids=["fedper-k1", "fedavg-k2"])
def test_data_on_the_devices_of_a_fleet_of_sites_is_the_simulation_bitwise(tmp_path, one_thread,
                                                                           algorithm, k):
    """data.placement = "device" over two sites: each device announces its own folders to its
    site's edge, which says them upstream; the coordinator numbers every site's clients as a
    flat fleet's (device, then folder) and each site holds its own devices' clients (site a:
    0, 3, 4). The run is fedseq-sim --devices-data of the same folders and sites, bitwise: the
    global model, the validation score (the coordinator's), the federated score (the devices'
    on their test rows, pooled by the sites), the personalized and local scores."""
    root = fmnist_devices(tmp_path / "devices", PLACED)
    cfg = placed_config(root, f"algorithm.name={algorithm}", "algorithm.finetune_epochs=1",
                        PLACED_SITES, f"hierarchy.edge_rounds={k}", "train.threads=1")
    lines: list[str] = []
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=3, client_threads=1,
                         announce=lines.append)
    sim = run_simulation(cfg, None)
    for k_, v in sim.global_weights.items():
        assert torch.equal(dep.global_weights[k_], v), k_
    scores = ("global_acc", "federated_acc", "personal_acc", "local_acc", "reported",
              "upstream_messages", "train_flops")
    assert [{k_: r.get(k_) for k_ in scores} for r in dep.rows] == [
        {k_: r.get(k_) for k_ in scores} for r in sim.rows]
    assert dep.rows[-1]["federated_acc"] is not None and dep.rows[-1]["reported"] == [0, 1, 2, 3, 4]
    assert dep.final.per_client == sim.final.per_client
    assert any("5 clients on 3 devices (local01, local02, local03)" in x for x in lines), lines
    assert "num_clients = 5" in (tmp_path / "dep" / "config.toml").read_text()


@pytest.mark.slow("a fleet of two sites, one device without its data folder: 10 s on 2 cores")
def test_a_sites_device_without_its_data_says_why_at_the_coordinator(tmp_path, one_thread,
                                                                     caplog):
    """local03 (site a) has no data folder: it tells its edge, whose status says why upstream;
    the coordinator names it in one line and runs the other devices' clients, numbered
    without it."""
    import logging

    root = fmnist_devices(tmp_path / "devices", {"local01": ["."], "local02": ["cam-a"]})
    cfg = placed_config(root, PLACED_SITES, "train.threads=1", "deploy.min_devices=3",
                        "deploy.wait_devices_s=60")
    with caplog.at_level(logging.WARNING, logger="fedseq"):
        dep = run_deployment(cfg, None, local_devices=3, client_threads=1,
                             announce=lambda m: None)
    why = [r.getMessage() for r in caplog.records if "local03 cannot follow run" in r.getMessage()]
    assert why and why[0].startswith("site a: ") and "no such data folder" in why[0], why
    assert "\n" not in why[0] and why[0].count("cannot follow run") == 1, why
    assert all(r["reported"] == [0, 1] for r in dep.rows if r["phase"] == "train")


@pytest.mark.slow("a fleet of sites with data on its devices, SIGKILLed and resumed: 30 s")
def test_a_resumed_fleet_of_sites_keeps_the_clients_it_numbered(tmp_path, one_thread):
    """data.placement = "device" over two local sites: the coordinator is SIGKILLed while it
    writes round 1's checkpoint (its sites' brokers, edges and devices die with it). `--resume`
    starts them again; the edges load the run from the roster the checkpoint kept (no device
    announces again) and the run ends bitwise fedseq-sim --devices-data of the folders."""
    root = fmnist_devices(tmp_path / "devices", PLACED)
    sets = ['data.placement="device"', 'data.dataset="npz"', "data.options.shape=[1,28,28]",
            "data.options.classes=10", f"data.devices_root={str(root)!r}",
            f"data.validation={str(root / 'validation.npz')!r}", "algorithm.name=fedper",
            "rounds=3", "train.join_ratio=0.7", "train.local_epochs=1", "train.threads=1",
            "deploy.port=0", PLACED_SITES]
    crash = [sys.executable, str(ROOT / "tests" / "crash_server.py")]
    out = tmp_path / "run"
    local = ["--local-devices", "3", "--client-threads", "1"]
    r = _logged([*crash, "mid-checkpoint", "start", *local, "--out", str(out),
                 *[a for x in sets for a in ("--set", x)]])
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    r = _logged([*crash, "none", "start", *local, "--resume", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    placed_run_is_simulated(out, placed_config(root, *sets))


def _logged(command: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    """subprocess.run of a coordinator's command; one that does not end fails the test with the
    end of its log (its rounds' lines, its edges' and devices' warnings)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as hung:
        log = hung.stderr or b""
        text = log.decode(errors="replace") if isinstance(log, bytes) else log
        pytest.fail(f"{' '.join(command[1:4])} did not end in {timeout:.0f} s; its log ends:\n"
                    f"{text[-6000:]}")


def _site_url(lines: list[str], site: str) -> str:
    (url,) = [re.search(r"broker (mqtt://\S+),", x).group(1) for x in lines
              if x.startswith(f"site {site}:")]
    return url


@pytest.mark.slow("a fleet of two sites, an edge killed and restarted: 25 s on 2 cores")
def test_an_edge_killed_mid_round_costs_its_sites_clients_that_round_only(data_root, tmp_path,
                                                                          one_thread):
    """Site a's edge aggregator is killed (SIGKILL) once its devices were given round 1 and
    restarted, as its systemd unit would: round 1 counts site b's clients alone, and the row
    says why site a's are missing; the restarted edge reads the run again (its steps numbered
    past the killed one's, so the site's devices follow it) and round 2 has every client."""
    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "deploy.port=0",
                       "train.threads=1", TWO_SITES, "deploy.wait_devices_s=120")
    lines: list[str] = []
    restarted: list[subprocess.Popen] = []
    killed = threading.Event()

    def kill() -> None:
        for pid in _children(r"server_main\(\) edge --site a "):
            os.kill(pid, signal.SIGKILL)

    def restart() -> None:
        coordinator = re.search(r"(mqtt://\S+)", lines[0]).group(1)
        restarted.append(subprocess.Popen(edge_command("a", _site_url(lines, "a"), coordinator,
                                                       cfg.data.root)))

    def watch(url: str) -> None:  # site a's broker: once round 1 is dispatched there
        host, port = url.split("://")[1].rsplit(":", 1)
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watch")

        def on_message(client, userdata, msg):
            step = Step.decode(msg.payload) if msg.payload else None
            if step and step.kind == "train" and step.round == 1 and not killed.is_set():
                kill()  # at once: before the site's devices can have trained
                killed.set()
                threading.Thread(target=restart, daemon=True).start()

        c.on_message = on_message
        c.on_connect = lambda client, *a: client.subscribe("fedseq/step", qos=1)
        c.connect(host, int(port))
        c.loop_start()

    def announce(line: str) -> None:
        lines.append(line)
        if line.startswith("site a:"):
            threading.Thread(target=watch, args=(_site_url(lines, "a"),), daemon=True).start()

    try:
        dep = run_deployment(cfg, tmp_path / "dep", local_devices=3, client_threads=1,
                             announce=announce)
    finally:
        for p in restarted:
            p.kill()
            p.wait()
    rows = dep.rows
    assert killed.is_set() and len(restarted) == 1
    assert rows[0]["reported"] == [0, 1, 2, 3, 4] and rows[0]["upstream_messages"] == 2
    assert rows[1]["reported"] == [2] and rows[1]["upstream_messages"] == 1
    assert "edge aggregator" in rows[1]["device_failures"]["site a"]
    assert rows[1]["status"] == "ok"
    assert rows[2]["reported"] == [0, 1, 2, 3, 4] and rows[2]["upstream_messages"] == 2
    assert rows[2]["personal_acc"] is not None  # every site's clients evaluated again
    assert all(torch.isfinite(v).all() for v in dep.global_weights.values())


class ForgedEdge:
    """A program posing as site b's edge aggregator on the coordinator's broker: it says it is
    online with site b's device, and answers every train task with a partial that claims site
    a's client 0 with a weight of 10,000."""

    def __init__(self, url: str):
        self.topics = Topics("fedseq")
        host, port = url.split("://")[1].rsplit(":", 1)
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="forged-b")
        self.c.on_connect = lambda client, *a: (
            client.subscribe(self.topics.site("b", "task"), qos=1),
            client.publish(self.topics.site("b", "status"), SiteStatus(
                site="b", state="online", devices=["local03"]).encode(), qos=1, retain=True))
        self.c.on_message = self.on_task
        self.c.connect(host, int(port))
        self.c.loop_start()
        self.answered = 0
        self.parts: dict[int, Reassembler] = {}

    def on_task(self, client, userdata, msg) -> None:
        head, data = unpack_chunk(msg.payload, SiteTaskHeader)
        if head.seq not in self.parts:
            self.parts[head.seq] = Reassembler(head.size, head.sha256, head.chunks)
        whole = self.parts[head.seq].add(head.chunk, bytes(data))
        if whole is None:
            return
        if head.kind != "train":
            scores = {}
            frame = encode_tensors({})
        else:
            start = decode_tensors(whole)
            plan = plan_from_dict(head.plan)
            up = [k for k in start if k.split(".")[0] in plan.upload]
            frame = encode_tensors({k: torch.zeros_like(start[k]) + 0.001 for k in up})
            scores = None
        fields = {} if scores is not None else {
            "round": head.round, "weights": {k: 10_000.0 for k in decode_tensors(frame)},
            "clients": [SiteClient(client=0, device="local03", num_samples=10_000)]}
        parts = split_frame(frame)
        for i, part in enumerate(parts):
            result = SiteResultHeader(run_id=head.run_id, site="b", seq=head.seq, chunk=i,
                                      chunks=len(parts), size=len(frame),
                                      sha256=hashlib.sha256(frame).hexdigest(), **fields)
            client.publish(self.topics.site("b", "result"), pack_chunk(result, part), qos=1)
        self.answered += 1

    def stop(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


@pytest.mark.slow("a fleet of one real site and a forged one: 15 s on 2 cores")
def test_an_edge_cannot_claim_another_sites_clients(data_root, tmp_path, one_thread):
    """A forged site b claims site a's client 0 with an inflated weight: its partial is refused
    before anything of it is folded (the row names why), and the round is site a's alone: the
    same global model as a run in which site b sent nothing."""
    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=1", "deploy.port=0",
                       "train.threads=1", TWO_SITES, "deploy.round_timeout_max_s=60")
    forged: list[ForgedEdge] = []

    def announce(line: str) -> None:
        if line.startswith("embedded MQTT broker at"):
            forged.append(ForgedEdge(re.search(r"(mqtt://\S+)", line).group(1)))

    try:
        dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                             announce=announce)
    finally:
        for f in forged:
            f.stop()
    assert forged[0].answered >= 1
    row = dep.rows[0]
    why = row["device_failures"]["site b"]
    assert "refused" in why and "client(s) 0" in why
    assert row["reported"] == [0, 1, 3, 4]
    assert row["upstream_messages"] == 1
    for v in dep.global_weights.values():
        assert torch.isfinite(v).all()


def _render(template: str, **values) -> str:
    import jinja2

    return jinja2.Template((ROOT / "deploy" / "mosquitto" / template).read_text(),
                           trim_blocks=True).render(**values)


def _start_mosquitto(conf: Path) -> subprocess.Popen:
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    if proc.poll() is not None:
        pytest.fail(f"mosquitto did not start: {proc.stderr.read()}")
    return proc


def _retained(port: int, password: str, topic: str, wait: float = 2.0) -> dict[str, bytes]:
    """What Mosquitto on `port` retains under `topic` (the coordinator's login)."""
    got: dict[str, bytes] = {}
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"look-{time.monotonic_ns()}")
    c.username_pw_set("coordinator", password)
    c.on_connect = lambda client, *a: client.subscribe(topic, qos=1)
    c.on_message = lambda client, userdata, msg: got.__setitem__(msg.topic, msg.payload)
    c.connect("127.0.0.1", port)
    c.loop_start()
    time.sleep(wait)
    c.loop_stop()
    c.disconnect()
    return got


class TwoTiers:
    """The coordinator's Mosquitto and site a's, both from the project's broker.conf and ACL, the
    site's bridged to the coordinator's (site-bridge.conf.j2; site-bridges.acl.j2 on top), site
    a's two daemons on its broker and its edge aggregator with a login on each."""

    def __init__(self, tmp_path: Path, data_root: Path):
        if not Path(MOSQUITTO).exists():
            pytest.fail("mosquitto is not installed (apt-get install mosquitto); .ci/run "
                        "installs it")
        self.top, self.site = tmp_path / "coordinator-broker", tmp_path / "site-broker"
        self.top.mkdir()
        self.site.mkdir()
        self.top_port, self.site_port = free_port(), free_port()
        acl = self.top / "fedseq.acl"
        acl.write_text(PROJECT_ACL.read_text() + _render(
            "site-bridges.acl.j2", sites={"a": ["local01", "local02"]}))
        top_users = {"coordinator": "c-pw", "a": "a-pw", "b": "b-pw"}
        site_users = {"coordinator": "s-pw", "local01": "d1-pw", "local02": "d2-pw"}
        self.conf = write_local_mosquitto(self.top, self.top_port, top_users,
                                          ROOT / "broker.conf", acl, getpass.getuser())
        self.site_conf = write_local_mosquitto(self.site, self.site_port, site_users,
                                               ROOT / "broker.conf", PROJECT_ACL,
                                               getpass.getuser())
        self.site_conf.write_text(self.site_conf.read_text() + _render(
            "site-bridge.conf.j2", site="a", upstream_host="127.0.0.1",
            upstream_port=self.top_port, password="a-pw", cafile=""))
        for home, users in ((self.top, top_users), (self.site, site_users)):
            for user, pw in users.items():
                (home / f"{user}.pw").write_text(pw + "\n")
                (home / f"{user}.pw").chmod(0o600)
        self.brokers = [_start_mosquitto(self.conf), _start_mosquitto(self.site_conf)]
        self.others = [device_process(d, self.site_port, self.site, data_root)
                       for d in ("local01", "local02")]
        self.others.append(subprocess.Popen([
            *edge_command("a", f"mqtt://127.0.0.1:{self.site_port}",
                          f"mqtt://127.0.0.1:{self.top_port}", data_root),
            "--username", "coordinator", "--password-file", str(self.site / "coordinator.pw"),
            "--upstream-username", "a", "--upstream-password-file", str(self.top / "a.pw")]))
        self.login = ("deploy.username=coordinator",
                      f"deploy.password_file={str(self.top / 'coordinator.pw')!r}")
        self.url = f"mqtt://127.0.0.1:{self.top_port}"

    def restart_site_broker(self) -> None:
        """SIGTERM (Mosquitto saves its retained messages), then the same config again."""
        self.brokers[1].terminate()
        self.brokers[1].wait(10)
        time.sleep(1.0)
        self.brokers[1] = _start_mosquitto(self.site_conf)

    def kill_coordinators_broker(self) -> None:
        """SIGKILL the coordinator's Mosquitto (what it did not save is lost), then start it
        again with the same config."""
        self.brokers[0].kill()
        self.brokers[0].wait(10)
        time.sleep(1.0)
        self.brokers[0] = _start_mosquitto(self.conf)

    def stop(self) -> None:
        for p in [*reversed(self.others), *reversed(self.brokers)]:
            p.terminate()
            p.wait(10)


@pytest.mark.slow("two Mosquittos bridged, an edge, two daemons, a run: 25 s on 2 cores")
def test_a_site_on_mosquitto_bridged_to_the_coordinators(data_root, tmp_path, one_thread):
    """The project's broker.conf and ACL on both tiers: the coordinator's Mosquitto, and a site's
    with its bridge (site-bridge.conf.j2) forwarding its devices' statuses up, the edge logging
    in upstream as its site (the ACL's site patterns, site-bridges.acl.j2). The run is the
    simulation's bitwise; the coordinator's broker holds every device's status and not one
    weight, step or update; the site's login cannot write another site's topics or a device's
    status that is not its own."""
    tiers = TwoTiers(tmp_path, data_root)
    top_port = tiers.top_port
    over = ("algorithm.name=fedavg", "rounds=2", "train.threads=1", "hierarchy.edge_rounds=2",
            'hierarchy.sites={a=["local01","local02"]}', *tiers.login)
    try:
        cfg = quick_config(data_root, *over)
        shown: list[str] = []  # fedseq-server status while the run is on (its first round)
        dep = run_deployment(cfg, tmp_path / "dep", broker=tiers.url, announce=lambda m: None,
                             on_round=lambda rec: shown or shown.extend(format_fleet(read_fleet(
                                 tiers.url, "fedseq", "coordinator", "c-pw"), "here")))
        up = _retained(top_port, "c-pw", "fedseq/#")
        after_run = format_fleet(read_fleet(tiers.url, "fedseq", "coordinator", "c-pw"), "here")
        # the site's login tries what the ACL denies it: another site's result, a status of a
        # device not its own
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="site-a-tries")
        c.username_pw_set("a", "a-pw")
        c.connect("127.0.0.1", top_port)
        c.loop_start()
        for topic in ("fedseq/site/b/result", "fedseq/site/b/status",
                      "fedseq/device/local03/status"):
            c.publish(topic, b"x", qos=1, retain=True).wait_for_publish(5)
        c.loop_stop()
        c.disconnect()
        after = _retained(top_port, "c-pw", "fedseq/#")
    finally:
        tiers.stop()
    sim = run_simulation(cfg, None)
    for k, v in sim.global_weights.items():
        assert torch.equal(dep.global_weights[k], v), k
    assert [r["reported"] for r in dep.rows] == [[0, 1, 2, 3, 4]] * 2
    assert {"fedseq/device/local01/status", "fedseq/device/local02/status"} <= set(up)
    assert not [t for t in up if t.startswith(("fedseq/weights", "fedseq/step", "fedseq/update"))]
    assert "fedseq/site/a/status" in up
    # fedseq-server status on the coordinator's broker: the site, and every device by site
    assert any(x.startswith("site a: edge aggregator online") for x in shown), shown
    assert sum(x.startswith(("local01 (a) ", "local02 (a) ")) for x in shown) == 2, shown
    # once the run is over nothing of it is retained (issue 94, finding 4): no run is current
    assert after_run[0].startswith("broker here: coordinator offline (its last run ")
    assert "fedseq/site/a/run" not in up and not any(x.startswith("run ") for x in after_run)
    assert not {"fedseq/site/b/result", "fedseq/site/b/status",
                "fedseq/device/local03/status"} & set(after)


@pytest.mark.slow("two Mosquittos bridged, an edge, two daemons, a site broker restart: 30 s")
def test_a_site_brokers_restart_is_a_broker_restart(data_root, tmp_path, one_thread):
    """The site's Mosquitto restarts between rounds: the edge and the devices reconnect and
    resync from its retained (persisted) messages, the edge's pool publishes the run's state
    again, and every later round has every client: the simulation's run, bitwise."""
    tiers = TwoTiers(tmp_path, data_root)
    restarted: list[int] = []

    def on_round(row) -> None:
        if row.round == 0 and not restarted:
            tiers.restart_site_broker()
            restarted.append(row.round)

    over = ("algorithm.name=fedper", "rounds=3", "train.threads=1", "deploy.round_timeout_s=60",
            "deploy.eval_timeout_s=60", 'hierarchy.sites={a=["local01","local02"]}',
            *tiers.login)
    try:
        cfg = quick_config(data_root, *over)
        dep = run_deployment(cfg, None, broker=tiers.url, announce=lambda m: None,
                             on_round=on_round)
    finally:
        tiers.stop()
    assert restarted == [0]
    assert [r["reported"] for r in dep.rows] == [[0, 1, 2, 3, 4]] * 3
    assert len(dep.final.per_client) == 5
    sim = run_simulation(cfg, None)
    for k, v in sim.global_weights.items():
        assert torch.equal(dep.global_weights[k], v), k


@pytest.mark.slow("two Mosquittos bridged, an edge, two daemons, the top broker killed: 30 s")
def test_the_coordinators_broker_killed_while_a_site_trains_loses_no_round(data_root, tmp_path,
                                                                          one_thread, caplog):
    """The coordinator's Mosquitto is SIGKILLed (and started again) once site a's devices were
    given round 1: reconnected, the coordinator sends the task again to the site yet to answer
    (the partial may have reached the broker before the coordinator subscribed again, and be
    lost); the edge, having answered or still training, answers again, and round 1 has every
    client in seconds, not at its deadline."""
    import logging
    tiers = TwoTiers(tmp_path, data_root)
    killed = threading.Event()

    def on_step(client, userdata, msg) -> None:
        step = Step.decode(msg.payload) if msg.payload else None
        if step and step.kind == "train" and step.round == 1 and not killed.is_set():
            killed.set()
            threading.Thread(target=tiers.kill_coordinators_broker, daemon=True).start()

    watch = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watch-site")
    watch.username_pw_set("coordinator", "s-pw")
    watch.on_message = on_step
    watch.on_connect = lambda client, *a: client.subscribe("fedseq/step", qos=1)
    watch.connect("127.0.0.1", tiers.site_port)
    watch.loop_start()
    over = ("algorithm.name=fedavg", "rounds=3", "train.threads=1", "train.join_ratio=1.0",
            "deploy.round_timeout_s=120", "deploy.eval_timeout_s=120",
            'hierarchy.sites={a=["local01","local02"]}', *tiers.login)
    try:
        cfg = quick_config(data_root, *over)
        with caplog.at_level(logging.WARNING, logger="fedseq"):
            dep = run_deployment(cfg, None, broker=tiers.url, announce=lambda m: None)
    finally:
        watch.loop_stop()
        tiers.stop()
    assert killed.is_set()
    again = [r.getMessage() for r in caplog.records if "was down; sent again" in r.getMessage()]
    assert again and again[0].endswith("sent again to a"), again
    r1 = dep.rows[1]
    assert r1["reported"] == [0, 1, 2, 3, 4], r1
    assert r1["seconds"] < 60, r1["seconds"]
    assert all(r["reported"] == [0, 1, 2, 3, 4] for r in dep.rows)


@pytest.mark.slow("two Mosquittos, an edge, two daemons, a coordinator killed and resumed: 30 s")
def test_a_fleet_of_sites_resumes_after_the_coordinator_is_killed(data_root, tmp_path,
                                                                   one_thread):
    """The coordinator is SIGKILLed while it writes round 1's checkpoint; the edge and the
    devices stay up. `--resume` continues the run under the same run id (the edge keeps its
    site's pool: the run it gets again is the one it follows) and ends with the uninterrupted
    simulation's weights, every round with every client."""
    from test_resume import CRASH, _rows, _server_sets, _status

    from fedseq.common.protocol.tensors import decode_tensors

    tiers = TwoTiers(tmp_path, data_root)
    out = tmp_path / "run"
    over = ["algorithm.name=fedper", "rounds=3", "train.threads=1", "train.join_ratio=1.0",
            "deploy.round_timeout_s=120",
            "deploy.eval_timeout_s=120", 'hierarchy.sites={a=["local01","local02"]}']
    cfg = quick_config(data_root, *over)
    cred = ["--set", tiers.login[0], "--set", tiers.login[1]]
    first = ["start", "-q", "--broker", tiers.url, "--out", str(out), *_server_sets(cfg, over),
             *cred]
    again = ["start", "-q", "--broker", tiers.url, "--resume", str(out)]
    try:
        r = subprocess.run([sys.executable, *CRASH, "mid-checkpoint", *first],
                           capture_output=True, text=True, timeout=400)
        assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
        assert _status(out) == "running"
        start = time.monotonic()
        r = subprocess.run([sys.executable, *CRASH, "none", *again], capture_output=True,
                           text=True, timeout=600)
        took = time.monotonic() - start
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        tiers.stop()
    rows = _rows(out)
    train = [x for x in rows if x["phase"] == "train"]
    assert [x["round"] for x in train] == [0, 1, 2]
    assert all(x["reported"] == [0, 1, 2, 3, 4] for x in train), train
    assert took < 100, took  # no deadline waited out
    sim = run_simulation(cfg, None)
    saved = decode_tensors((out / "model.safetensors").read_bytes())
    for k, v in sim.global_weights.items():
        assert torch.equal(saved[k], v), k
