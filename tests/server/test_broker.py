"""The embedded broker's safe defaults and the login errors both sides print."""

import subprocess
import sys
import time

import pytest

from fedseq.common.errors import TransportError
from fedseq.common.protocol.link import Link, LoginRefused
from fedseq.server.ops.broker import EmbeddedBroker

SERVER = "from fedseq.server.cli.commands import server_main; server_main()"


def test_refuses_an_open_network_listener_without_authentication():
    with pytest.raises(TransportError, match="broker_password_file"):
        EmbeddedBroker("0.0.0.0", 0)
    EmbeddedBroker("0.0.0.0", 0, allow_anonymous=True)  # explicitly allowed: constructed


def _passwd(tmp_path, user, password):
    pw = tmp_path / f"{user}.pw"
    pw.write_text(password + "\n")
    res = subprocess.run([sys.executable, "-c", SERVER, "passwd", str(tmp_path / "users"),
                          user, "--password-file", str(pw)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return pw


def test_password_file_logins(tmp_path, caplog):
    _passwd(tmp_path, "coordinator", "old")
    _passwd(tmp_path, "coordinator", "c-secret")  # replaces the line
    _passwd(tmp_path, "dev01", "d-secret")
    lines = (tmp_path / "users").read_text().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["coordinator", "dev01"]
    assert all(ln.split(":", 1)[1].startswith("$argon2") for ln in lines)
    broker = EmbeddedBroker("127.0.0.1", 0, password_file=tmp_path / "users")
    broker.start()
    try:
        ok = Link("t-ok", broker.url, [], lambda t, p: None, username="dev01", password="d-secret")
        ok.start(attempts=1)
        ok.stop()
        for user, pw in (("dev01", "wrong"), (None, None)):
            bad = Link("t-bad", broker.url, [], lambda t, p: None, username=user, password=pw)
            with pytest.raises(LoginRefused, match="refused") as exc:
                bad.start(attempts=1)
            assert "\n" not in str(exc.value)
        assert not any("lost broker" in r.message for r in caplog.records)
    finally:
        broker.stop()


def test_missing_password_file_is_one_line(tmp_path):
    with pytest.raises(TransportError, match="fedseq-server passwd"):
        EmbeddedBroker("127.0.0.1", 0, password_file=tmp_path / "nope")


@pytest.mark.slow("real brokers started, loaded and stopped: 6 s on 2 cores")
def test_daemon_with_a_wrong_password_exits_with_one_line(tmp_path):
    _passwd(tmp_path, "dev01", "d-secret")
    broker = EmbeddedBroker("127.0.0.1", 0, password_file=tmp_path / "users")
    broker.start()
    (tmp_path / "wrong.pw").write_text("nope\n")
    try:
        res = subprocess.run(
            [sys.executable, "-m", "fedseq.client.cli", "--device", "dev01", "--broker", broker.url,
             "--state-dir", str(tmp_path / "st"), "--username", "dev01", "--password-file",
             str(tmp_path / "wrong.pw")], capture_output=True, text=True, timeout=120)
    finally:
        broker.stop()
    assert res.returncode == 2
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "refused user 'dev01'" in errors[0], res.stderr
    assert "Traceback" not in res.stderr and "lost broker" not in res.stderr


@pytest.mark.slow("real brokers started, loaded and stopped: 5 s on 2 cores")
def test_status_command_shows_the_fleet(tmp_path, monkeypatch):
    import paho.mqtt.client as mqtt
    import torch

    from fedseq.client.daemon import DeviceDaemon
    from fedseq.common.protocol.messages import PROTOCOL_VERSION, DeviceStatus

    fake = tmp_path / "sys-of-a-nano"  # dev01's sensors: a JetPack 4 power rail, one thermal zone
    iio = fake / "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    iio.mkdir(parents=True)
    (iio / "rail_name_0").write_text("POM_5V_IN\n")
    (iio / "in_power0_input").write_text("4100\n")
    (fake / "sys/class/thermal/thermal_zone0").mkdir(parents=True)
    (fake / "sys/class/thermal/thermal_zone0/temp").write_text("51500\n")
    monkeypatch.setenv("FEDSEQ_SYSFS_ROOT", str(fake))
    broker = EmbeddedBroker("127.0.0.1", 0)
    broker.start()
    daemon = DeviceDaemon("dev01", broker.url, None, tmp_path, "cpu")
    try:
        daemon.start(attempts=3)
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="dev02")
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        failed = DeviceStatus(device="dev02", state="offline", error="dataset file missing",
                              error_seq=4, error_run_id="r1")
        pub.publish("fedseq/device/dev02/status", failed.encode(), qos=1, retain=True).wait_for_publish(10)
        pub.loop_stop()
        r = subprocess.run([sys.executable, "-c", SERVER, "status", "--broker", broker.url,
                            "--wait", "1.5"], capture_output=True, text=True, timeout=120)
    finally:
        daemon.stop()
        broker.stop()
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "coordinator never seen" in out and "1 of 2 devices online" in out, out
    dev01 = next(ln for ln in out.splitlines() if ln.startswith("dev01"))
    assert "online" in dev01 and "0.1.0" in dev01 and f"v{PROTOCOL_VERSION}" in dev01
    assert f"cpu {torch.__version__}" in dev01  # the torch build it described (DeviceInfo)
    assert "52 C" in dev01 and "jetson-iio" in dev01  # its health and power source
    dev02 = next(ln for ln in out.splitlines() if ln.startswith("dev02"))
    assert "offline" in dev02 and "step 4: dataset file missing" in dev02


def test_version_flags():
    from fedseq.common import __version__

    for cmd in (["-c", SERVER, "--version"],
                ["-c", "from fedseq.server.cli.commands import sim_main; sim_main()", "--version"],
                ["-m", "fedseq.client.cli", "--version"],
                ["-m", "fedseq.server.cli.tools", "--version"]):  # `fedseq --version` too
        r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == __version__, (cmd, r.stdout, r.stderr)


def test_a_local_mosquitto_is_the_projects_broker_conf_on_loopback(tmp_path):
    """write_local_mosquitto (the tests', benchmarks' and rehearsals' Mosquitto): every login
    hashed, the ACL copied, broker.conf's own lines kept but for loopback, files and `settings`."""
    from conftest import PROJECT_ACL, ROOT
    from fedseq.server.ops.broker import write_local_mosquitto

    conf = write_local_mosquitto(tmp_path, 18830, {"coordinator": "pw1", "local01": "pw2"},
                                 ROOT / "broker.conf", PROJECT_ACL, "someone",
                                 settings={"max_queued_messages": "7"},
                                 log_file=tmp_path / "broker.log")
    text = conf.read_text()
    assert "listener 18830 127.0.0.1" in text and "allow_anonymous false" in text
    assert "max_queued_messages 7\n" in text and f"log_dest file {tmp_path / 'broker.log'}" in text
    assert text.rstrip().endswith("user someone")
    lines = (tmp_path / "passwd").read_text().splitlines()
    assert [x.split(":")[0] for x in lines] == ["coordinator", "local01"]
    assert all(":pw" not in x for x in lines)  # hashed, not the passwords
    assert (tmp_path / "acl").read_text() == PROJECT_ACL.read_text()
    with pytest.raises(ValueError, match="no 'no_such_key' line"):
        write_local_mosquitto(tmp_path, 18830, {}, ROOT / "broker.conf", PROJECT_ACL, "someone",
                              settings={"no_such_key": "1"})


def test_a_run_s_mosquitto_takes_its_one_login_only_and_stops_with_the_run(tmp_path):
    """deploy.embedded_broker = "mosquitto": the project's broker.conf and ACL on the given
    address, one login made for the run (a stranger and a wrong password are refused), gone
    when the block ends."""
    from conftest import connack
    from fedseq.server.ops.broker import LocalMosquitto

    with LocalMosquitto("127.0.0.1", 0, tmp_path) as broker:
        password = broker.secret.read_text().strip()
        assert broker.secret.stat().st_mode & 0o077 == 0
        assert connack("127.0.0.1", broker.port, "coordinator", password) == 0
        assert connack("127.0.0.1", broker.port) != 0
        assert connack("127.0.0.1", broker.port, "coordinator", password + "x") != 0
        assert "acl_file" in broker.conf.read_text()
        # the flood guard is on: its own login, with a password made for the run
        assert broker.guard_secret is not None and broker.guard_secret.stat().st_mode & 0o077 == 0
        assert connack("127.0.0.1", broker.port, "fedseq-guard",
                       broker.guard_secret.read_text().strip()) == 0
    assert connack("127.0.0.1", broker.port, "coordinator", password) == -1


def test_amqtt_s_dropped_messages_are_said_once_with_what_to_do(caplog):
    """amqtt drops a message not acknowledged in 5 s with a warning and a traceback each time; the
    embedded broker says it once, with the fix, and leaves amqtt's other lines alone."""
    import logging

    b = EmbeddedBroker("127.0.0.1", 0)
    b.start()
    try:
        handler, broker = (logging.getLogger(n) for n in ("amqtt.mqtt.protocol.handler",
                                                          "amqtt.broker"))
        with caplog.at_level(logging.WARNING):
            for i in (16, 17):
                handler.warning("Timeout waiting for PUBACK for packet ID %d", i)
                broker.error("Task failed and will be skipped: <Task exception=TimeoutError("
                             "'Timeout waiting for PUBACK for packet ID %d')>", i)
            handler.warning("Received PUBACK for unknown pending message Id: '16'")
            broker.warning("something else")
    finally:
        b.stop()
    amqtt = [r.getMessage() for r in caplog.records if r.name.startswith("amqtt")]
    ours = [r.getMessage() for r in caplog.records if r.name == "fedseq.server.ops.broker"]
    assert amqtt == ["something else"], amqtt
    assert len(ours) == 1 and "amqtt issue #391" in ours[0], ours
    assert 'embedded_broker = "mosquitto"' in ours[0]
    assert not handler.filters and not broker.filters  # gone with the broker


@pytest.mark.slow("real brokers started, loaded and stopped: 5 s on 2 cores")
def test_status_finds_a_run_directory_s_broker_and_reads_only_statuses(tmp_path):
    """Newcomer II, finding 5: `fedseq-server status --config RUN_DIR` reads the broker the run
    ran on from its status.json (a local run's embedded broker), and the broker's other retained
    messages (weights, an assignment) are not read as statuses (they printed a dozen "invalid"
    lines)."""
    import json

    import paho.mqtt.client as mqtt

    from fedseq.common.protocol.messages import DeviceStatus

    broker = EmbeddedBroker("127.0.0.1", 0)
    broker.start()
    try:
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="dev02")
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        for topic, body in (("fedseq/device/dev02/status",
                             DeviceStatus(device="dev02", state="online").encode()),
                            ("fedseq/weights/conv1/0", b"\x00" * 64),
                            ("fedseq/device/dev02/assign", b'{"clients": [0, 1]}')):
            pub.publish(topic, body, qos=1, retain=True).wait_for_publish(10)
        pub.loop_stop()
        run = tmp_path / "run"
        run.mkdir()
        (run / "config.toml").write_text("rounds = 2\n")
        (run / "status.json").write_text(json.dumps({"state": "running", "broker": broker.url}))
        r = subprocess.run([sys.executable, "-c", SERVER, "status", "--config", str(run),
                            "--wait", "1.5"], capture_output=True, text=True, timeout=120)
    finally:
        broker.stop()
    assert r.returncode == 0, r.stderr
    assert any(ln.startswith("dev02") and "online" in ln for ln in r.stdout.splitlines()), r.stdout
    assert "invalid" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_guard_login_administers_logins_and_reads_no_devices_topic(mosquitto):
    """Hardening VI, finding 7: `mosquitto_ctrl dynsec init` gives the guard's admin role '#' and
    $SYS/#; fedseq keeps only the plugin's control topic. The guard login still lists the
    broker's logins (what it disables them with), and no longer reads a device's updates or
    assignment; what the ACL's patterns let every login read (the coordinator's broadcasts:
    step, weights, run config) and $SYS stay as for any device login."""
    import json

    import paho.mqtt.client as mqtt

    port, home, _ = mosquitto
    got: list[tuple[str, bytes]] = []

    def login(name: str, password: str) -> mqtt.Client:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{name}-probe")
        c.username_pw_set(name, password)
        c.connect("127.0.0.1", port)
        c.loop_start()
        return c

    guard = login("fedseq-guard", (home / "fedseq-guard.pw").read_text().strip())
    guard.on_message = lambda c, u, m: got.append((m.topic, m.payload))
    coordinator, device = login("coordinator", "c-secret"), login("local01", "d1-secret")
    try:
        for topic in ("#", "fedseq/#", "$CONTROL/dynamic-security/#"):
            guard.subscribe(topic, qos=1)
        time.sleep(0.5)
        device.publish("fedseq/update/local01", b"an update", qos=1).wait_for_publish(10)
        coordinator.publish("fedseq/device/local01/assign", b"an assignment",
                            qos=1).wait_for_publish(10)
        guard.publish("$CONTROL/dynamic-security/v1", json.dumps(
            {"commands": [{"command": "listClients"}]}).encode(), qos=1).wait_for_publish(10)
        deadline = time.monotonic() + 10
        while not any(t.endswith("/response") for t, _ in got) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
    finally:
        for c in (guard, coordinator, device):
            c.loop_stop()
            c.disconnect()
    answers = [json.loads(p) for t, p in got if t == "$CONTROL/dynamic-security/v1/response"]
    assert answers and answers[0]["responses"][0]["command"] == "listClients", got
    assert not [t for t, _ in got if t.startswith("fedseq/")], [t for t, _ in got]
