"""TLS end to end against a real Mosquitto running broker.conf's TLS listener (mutual TLS, TLS 1.2),
with a CA and certificates generated inside the test."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from conftest import MOSQUITTO, make_pki, quick_config
from fedseq.server.ops.broker import free_port
from fedseq.server.ops.deployment import run_deployment, stop_children


@pytest.fixture
def tls_broker(mosquitto):
    """The `mosquitto` fixture's broker.conf copy with its TLS block uncommented."""
    port, home, _ = mosquitto
    pki = make_pki(home)
    tls_port = free_port()
    conf = (home / "mosquitto.conf").read_text()
    block = re.search(r"^#listener 8883 0\.0\.0\.0$.*?^#require_certificate true$", conf, re.M | re.S)
    assert block, "broker.conf lost its TLS block"
    enabled = block.group(0).replace("#", "")
    enabled = enabled.replace("listener 8883 0.0.0.0", f"listener {tls_port} 127.0.0.1")
    for name in ("ca", "server"):
        enabled = enabled.replace(f"/etc/mosquitto/certs/{name}.crt", str(pki[name]))
    enabled = enabled.replace("/etc/mosquitto/certs/server.key", str(pki["server_key"]))
    conf = conf.replace(f"listener {port} 127.0.0.1", f"listener {free_port()} 127.0.0.1")
    conf = conf.replace(str(home) + "/mosquitto.db", str(home) + "/tls.db")
    (home / "tls.conf").write_text(conf.replace(block.group(0), enabled))
    proc = subprocess.Popen([MOSQUITTO, "-c", str(home / "tls.conf")], stderr=subprocess.PIPE,
                            text=True)
    time.sleep(0.5)
    if proc.poll() is not None:
        pytest.fail(f"mosquitto with TLS did not start: {proc.stderr.read()}")
    yield tls_port, home, pki
    proc.terminate()
    proc.wait(10)


def _doctor(port, home, *tls):
    cmd = [sys.executable, "-m", "fedseq.client.cli", "doctor", "--device", "local01",
           "--broker", f"mqtts://127.0.0.1:{port}", "--state-dir", str(home / "st"),
           "--username", "local01", "--password-file", str(home / "local01.pw"), *map(str, tls)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow("TLS brokers, certificates and daemons: 3 s on 2 cores")
def test_doctor_over_mutual_tls(tls_broker):
    port, home, pki = tls_broker
    good = _doctor(port, home, "--ca-file", pki["ca"], "--cert-file", pki["device"],
                   "--key-file", pki["device_key"])
    assert good.returncode == 0, good.stdout + good.stderr
    assert "(TLS, MQTT) accepts local01" in good.stdout
    assert re.search(r"broker certificate of 127\.0\.0\.1 valid until", good.stdout)
    assert "client certificate" in good.stdout


@pytest.mark.slow("TLS brokers, certificates and daemons: 5 s on 2 cores")
@pytest.mark.parametrize("case, words", [
    ("wrong-ca", "not signed by ca_file"),
    ("expired", "rejected this side's certificate"),
    ("plain-port", "does not speak TLS"),
])
def test_tls_failures_are_one_line_with_the_fix(tls_broker, mosquitto, case, words):
    port, home, pki = tls_broker
    ca, cert, key = pki["ca"], pki["device"], pki["device_key"]
    if case == "wrong-ca":
        ca = pki["other_ca"]
    elif case == "expired":
        cert, key = pki["expired"], pki["expired_key"]
    elif case == "plain-port":
        port = mosquitto[0]
    res = _doctor(port, home, "--ca-file", ca, "--cert-file", cert, "--key-file", key)
    assert res.returncode == 1
    fail = [ln for ln in res.stdout.splitlines() if ln.startswith("FAIL")]
    assert any(words in line for line in fail), res.stdout
    assert "Traceback" not in res.stdout + res.stderr


def test_daemon_with_a_wrong_ca_exits_with_one_line(tls_broker, tmp_path):
    port, home, pki = tls_broker
    res = subprocess.run(
        [sys.executable, "-m", "fedseq.client.cli", "--device", "local01", "--broker",
         f"mqtts://127.0.0.1:{port}", "--state-dir", str(tmp_path / "st"), "--username", "local01",
         "--password-file", str(home / "local01.pw"), "--ca-file", str(pki["other_ca"])],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "not signed by ca_file" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow("TLS brokers, certificates and daemons: 5 s on 2 cores")
def test_run_over_mutual_tls(tls_broker, data_root, tmp_path, one_thread):
    port, home, pki = tls_broker
    url = f"mqtts://127.0.0.1:{port}"
    dev = subprocess.Popen(
        [sys.executable, "-m", "fedseq.client.cli", "--device", "local01", "--broker", url,
         "--data-dir", str(data_root), "--state-dir", str(tmp_path / "st"), "--username", "local01",
         "--password-file", str(home / "local01.pw"), "--ca-file", str(pki["ca"]), "--cert-file",
         str(pki["device"]), "--key-file", str(pki["device_key"]), "--threads", "1"])
    try:
        cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=1", "train.join_ratio=0.4",
                           "deploy.username=coordinator",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}",
                           f"deploy.ca_file={str(pki['ca'])!r}",
                           f"deploy.cert_file={str(pki['coordinator'])!r}",
                           f"deploy.key_file={str(pki['coordinator_key'])!r}")
        res = run_deployment(cfg, None, broker=url, announce=lambda s: None)
    finally:
        stop_children([dev])
    assert res.rows[0]["reported"] == res.rows[0]["clients"]
