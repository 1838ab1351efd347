"""The ansible roll-out for real: lint, syntax, and the client role applied to this machine under
a temporary prefix (systemd off), twice; the installed fedseq-client then completes a run."""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, quick_config
from fedseq.server.ops.broker import free_port
from fedseq.server.ops.deployment import run_deployment, stop_children

ANSIBLE = ROOT / "deploy" / "ansible"
pytestmark = pytest.mark.skipif(shutil.which("ansible-playbook") is None,
                                reason="ansible-core not installed (pip install -e '.[dev]')")


@pytest.mark.slow("ansible-playbook and ansible-lint on the roles: 7 s on 2 cores")
def test_lint_and_syntax():
    r = subprocess.run(["ansible-playbook", "--syntax-check", "-i", "inventory/testbed.yml",
                        "site.yml"], cwd=ANSIBLE, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(["ansible-lint", "--profile", "production", "--nocolor"], cwd=ANSIBLE,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _play(prefix, wheel, port, data_root, extra_vars=None):
    return subprocess.run(
        ["ansible-playbook", "-i", "localhost,", "-c", "local", "client-local.yml",
         "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"fedseq_client_prefix={prefix}",
         "-e", f"fedseq_client_wheel={wheel}", "-e", "fedseq_client_device=ansible01",
         "-e", f"fedseq_client_broker_url=mqtt://127.0.0.1:{port}",
         "-e", f"fedseq_client_dataset_src={data_root / 'FashionMNIST'}",
         "-e", "fedseq_client_threads=1", "-e", "fedseq_client_torch_device=cpu",
         # torch and the other dependencies come from the environment running the tests (a venv
         # in CI), as a device's come from JetPack's system packages
         "-e", f"fedseq_client_site_from={sys.executable}",
         *(["-e", json.dumps(extra_vars)] if extra_vars else [])],
        cwd=ANSIBLE, capture_output=True, text=True, timeout=600,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"})


@pytest.mark.slow("ansible-playbook and ansible-lint on the roles: 45 s on 2 cores")
def test_client_role_installs_a_working_client(tmp_path, data_root):
    wheels = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
                    str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("fedseq-*.whl")
    # a lab's plugin package, as its operator builds it on the controller
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT / "examples" / "plugin")], check=True, timeout=300,
                   capture_output=True, cwd=tmp_path)
    (plugin,) = wheels.glob("fedseq_labdemo-*.whl")
    lab = {"fedseq_client_plugin_wheels": [str(plugin)],
           "fedseq_client_allow_plugins": ["labnet", "blobs"]}
    prefix, port = tmp_path / "root", free_port()
    first = _play(prefix, wheel, port, data_root, lab)
    assert first.returncode == 0, first.stdout[-3000:]
    second = _play(prefix, wheel, port, data_root, lab)
    assert second.returncode == 0, second.stdout[-3000:]
    assert re.search(r"localhost\s*:\s*ok=\d+\s+changed=0\s", second.stdout), second.stdout[-1500:]

    client = prefix / "opt" / "fedseq" / "venv" / "bin" / "fedseq-client"
    config = prefix / "etc" / "fedseq" / "client.toml"
    assert client.exists() and 'device = "ansible01"' in config.read_text()
    assert '[plugins]\nallow = ["labnet", "blobs"]' in config.read_text()
    seen = subprocess.run(
        [str(client.with_name("python")), "-c",
         "import sys; from fedseq.client.doctor import check_plugins; "
         "from fedseq.client.settings import load_settings; "
         "[print(ok, line) for ok, line in check_plugins(load_settings(sys.argv[1], {}))]",
         str(config)], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "True plugin model 'labnet' (fedseq-labdemo 0.4.0) installed and allowed" in seen, seen
    assert "None plugin algorithm 'fedavg-l2' (fedseq-labdemo 0.4.0) installed, not allowed" in seen
    assert (prefix / "var/lib/fedseq/data/FashionMNIST/raw/train-images-idx3-ubyte.gz").exists()
    proc = subprocess.Popen([str(client), "--config", str(config)])
    try:
        cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=2",
                           f"deploy.port={port}", "deploy.wait_devices_s=120")
        res = run_deployment(cfg, None, announce=lambda s: None)
    finally:
        stop_children([proc])
    assert proc.returncode == 0
    assert all(r["reported"] == r["clients"] for r in res.rows)


@pytest.mark.slow("ansible-playbook and ansible-lint on the roles: 27 s on 2 cores")
def test_broker_role_confines_plain_mqtt_binds_certificates_and_revokes(tmp_path):
    """The broker role's configuration and account tasks applied to a scratch folder, twice, with
    TLS and identity logins on; then Mosquitto runs the result: the plain listener is on loopback
    only, a device certificate logs in as its CN whatever user name it claims (the ACL then
    confines it to that device's topics), and an account dropped from the inventory is gone."""
    import json

    import paho.mqtt.client as mqtt

    from conftest import MOSQUITTO, connack, make_pki

    etc, tls = tmp_path / "etc", tmp_path / "tls"
    (etc / "certs").mkdir(parents=True)
    tls.mkdir()
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    for src, name in ((pki["ca"], "ca.crt"), (pki["server"], "server.crt"),
                      (pki["server_key"], "server.key")):
        shutil.copy(src, tls / name)
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(etc / "fedseq.passwd"), "retired", "x"],
                   check=True)
    users = {"coordinator": "c-pw", "local01": "d1-pw", "local02": "d2-pw"}
    crl = tmp_path / "crl.pem"  # the coordinator's certificate is revoked (a lost machine)
    crl.write_bytes(_crl(pki["ca"], pki["ca_key"], pki["coordinator"]))
    play = tmp_path / "broker.yml"
    play.write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        "    - {ansible.builtin.include_role: {name: fedseq_broker, tasks_from: config.yml}}\n"
        "    - {ansible.builtin.include_role: {name: fedseq_broker, tasks_from: accounts.yml}}\n")
    extra = {"fedseq_broker_etc": str(etc), "fedseq_broker_user": getpass.getuser(),
             "fedseq_broker_manage_service": False, "fedseq_broker_tls_dir": str(tls),
             "fedseq_broker_tls_identity_logins": True, "fedseq_broker_passwords": users,
             "fedseq_broker_tls_crl": str(crl), "fedseq_broker_guard_password": "g-pw",
             "fedseq_broker_lib": str(tmp_path / "lib"),
             "ansible_python_interpreter": sys.executable}
    (tmp_path / "lib").mkdir()
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles")}
    for _ in range(2):  # twice: the second run must change nothing
        r = subprocess.run(["ansible-playbook", "-i", "localhost,", str(play), "-e",
                            json.dumps(extra)], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(r"localhost\s*:\s*ok=\d+\s+changed=0\s", r.stdout), r.stdout[-1500:]
    conf = (etc / "mosquitto.conf").read_text()
    assert re.search(r"^listener 1883 127\.0\.0\.1$", conf, re.M)
    assert not re.search(r"^listener 1883 0\.0\.0\.0$", conf, re.M)
    assert re.search(r"^use_identity_as_username true$", conf, re.M)
    accounts = [ln.split(":")[0] for ln in (etc / "fedseq.passwd").read_text().splitlines()]
    assert sorted(accounts) == sorted(users)  # "retired" was revoked
    assert re.search(r"^crlfile .*/certs/crl\.pem$", conf, re.M)
    assert (etc / "fedseq.passwd").stat().st_mode & 0o077 == 0o040  # the broker's group only
    assert re.search(r"^plugin /usr/lib/.*-linux-gnu/mosquitto_dynamic_security\.so$", conf, re.M)
    assert f"plugin_opt_config_file {tmp_path / 'lib'}/dynamic-security.json" in conf
    assert (tmp_path / "lib" / "dynamic-security.json").stat().st_mode & 0o077 == 0
    # the guard's role: the plugin's control topic, and nothing else (dynsec init gives it '#')
    dynsec = json.loads((tmp_path / "lib" / "dynamic-security.json").read_text())
    acls = [a for r in dynsec["roles"] for a in r["acls"]]
    assert {a["topic"] for a in acls if a["allow"]} == {"$CONTROL/dynamic-security/#"}
    assert {(a["acltype"], a["topic"]) for a in acls if not a["allow"]} == {
        ("publishClientSend", "#"), ("publishClientReceive", "#"), ("subscribePattern", "#")}
    assert "g-pw" not in r.stdout + r.stderr
    changed = {**extra, "fedseq_broker_passwords": {**users, "local02": "d2-new"}}
    r = subprocess.run(["ansible-playbook", "-i", "localhost,", str(play), "-e",
                        json.dumps(changed)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert not re.search(r"localhost\s*:\s*ok=\d+\s+changed=0\s", r.stdout)  # applied
    assert "d2-new" not in r.stdout + r.stderr

    plain, secure = free_port(), free_port()
    conf = conf.replace("listener 1883 127.0.0.1", f"listener {plain} 127.0.0.1")
    conf = conf.replace("listener 8883 0.0.0.0", f"listener {secure} 127.0.0.1")
    conf = conf.replace("/var/lib/mosquitto/", f"{tmp_path}/").replace("log_dest syslog",
                                                                       "log_dest stderr")
    shutil.copy(ROOT / "deploy" / "mosquitto" / "fedseq.acl", etc / "fedseq.acl")
    (tmp_path / "run.conf").write_text(conf + f"\nuser {getpass.getuser()}\n")
    broker = subprocess.Popen([MOSQUITTO, "-c", str(tmp_path / "run.conf")], stderr=subprocess.PIPE,
                              text=True)
    try:
        time.sleep(0.5)
        assert broker.poll() is None, broker.stderr.read()
        seen: list[str] = []
        watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watcher")
        watcher.username_pw_set("coordinator", "c-pw")
        watcher.on_message = lambda c, u, m: seen.append(m.topic)
        watcher.on_connect = lambda c, u, f, rc, p: c.subscribe("fedseq/device/+/status", qos=1)
        watcher.connect("127.0.0.1", plain)  # the coordinator on the broker host: plain, loopback
        watcher.loop_start()
        dev = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="local01-cert")
        dev.tls_set(ca_certs=str(pki["ca"]), certfile=str(pki["device"]),
                    keyfile=str(pki["device_key"]))
        dev.username_pw_set("local02", "d2-pw")  # claims local02; its certificate says local01
        dev.connect("127.0.0.1", secure)
        dev.loop_start()
        for name in ("local02", "local01"):
            dev.publish(f"fedseq/device/{name}/status", b"x", qos=1).wait_for_publish(10)
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        dev.loop_stop()
        watcher.loop_stop()
        assert seen == ["fedseq/device/local01/status"], seen
        assert connack("127.0.0.1", plain, "fedseq-guard", "g-pw") == 0  # the flood guard's login
        assert connack("127.0.0.1", plain, "fedseq-guard", "wrong") != 0
        assert connack("127.0.0.1", plain, "local02", "d2-new") == 0  # the new password applies
        assert connack("127.0.0.1", plain, "local02", "d2-pw") != 0
        revoked = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="revoked-cert")
        revoked.tls_set(ca_certs=str(pki["ca"]), certfile=str(pki["coordinator"]),
                        keyfile=str(pki["coordinator_key"]))
        with pytest.raises(Exception):  # noqa: B017 - the broker refuses the revoked certificate
            revoked.connect("127.0.0.1", secure)
            revoked.loop_start()
            time.sleep(1.0)
            revoked.loop_stop()
            assert revoked.is_connected(), "refused"
        bare = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="password-only")
        bare.tls_set(ca_certs=str(pki["ca"]))
        bare.username_pw_set("local01", "d1-pw")
        with pytest.raises(Exception):  # noqa: B017 - a refused TLS handshake (no certificate)
            bare.connect("127.0.0.1", secure)
            bare.loop_start()
            time.sleep(1.0)
            bare.loop_stop()
            assert bare.is_connected(), "refused"
    finally:
        broker.terminate()
        broker.wait(10)


@pytest.mark.slow("ansible-playbook on the broker role, twice, and Mosquitto: 25 s on 2 cores")
def test_broker_role_bridges_a_site_and_lets_each_site_forward_its_own_devices(tmp_path):
    """A fleet of sites: on a site's broker the role appends the bridge (its devices' statuses
    out, as the site's login, its password in a file the broker's group alone reads); on the
    coordinator's, the ACL lets each site's login forward its own devices' statuses. Twice: the
    second run changes nothing; Mosquitto takes the configuration."""
    from conftest import MOSQUITTO

    play = tmp_path / "broker.yml"
    play.write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        "    - {ansible.builtin.include_role: {name: fedseq_broker, tasks_from: config.yml}}\n")
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles")}
    common = {"fedseq_broker_user": getpass.getuser(), "fedseq_broker_manage_service": False,
              "fedseq_broker_guard_password": "", "ansible_python_interpreter": sys.executable}
    site_etc, top_etc = tmp_path / "site", tmp_path / "top"
    runs = (
        (site_etc, {"fedseq_broker_bridge_site": "lab1", "fedseq_broker_bridge_host": "127.0.0.1",
                    "fedseq_broker_bridge_port": free_port(),
                    "fedseq_broker_bridge_password": "lab1-secret"}),
        (top_etc, {"fedseq_broker_sites": {"lab1": ["jetson01", "jetson02"], "lab2": ["jetson03"]}}))
    for etc, extra in runs:
        etc.mkdir()
        for _ in range(2):
            r = subprocess.run(["ansible-playbook", "-i", "localhost,", str(play), "-e",
                                json.dumps({**common, **extra, "fedseq_broker_etc": str(etc)})],
                               capture_output=True, text=True, timeout=300, env=env)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert re.search(r"localhost\s*:\s*ok=\d+\s+changed=0\s", r.stdout), r.stdout[-1500:]
        assert "lab1-secret" not in r.stdout + r.stderr
    conf = (site_etc / "mosquitto.conf").read_text()
    assert "connection fedseq-site-lab1" in conf and "remote_username lab1" in conf
    bridged = re.findall(r"^topic (\S+) (\w+) 1$", conf, re.M)
    assert bridged == [("fedseq/device/+/status", "out"), ("fedseq/device/+/info", "out")]
    assert (site_etc / "mosquitto.conf").stat().st_mode & 0o077 == 0o040
    acl = (top_etc / "fedseq.acl").read_text()
    assert acl.startswith((ROOT / "deploy" / "mosquitto" / "fedseq.acl").read_text().strip())
    blocks = re.findall(r"^user (\S+)\n((?:topic .*\n)+)", acl, re.M)
    assert [(u, t.split()) for u, t in blocks[1:]] == [
        ("lab1", ["topic", "write", "fedseq/device/jetson01/status", "topic", "write",
                  "fedseq/device/jetson01/info", "topic", "write", "fedseq/device/jetson02/status",
                  "topic", "write", "fedseq/device/jetson02/info"]),
        ("lab2", ["topic", "write", "fedseq/device/jetson03/status", "topic", "write",
                  "fedseq/device/jetson03/info"])]
    port = free_port()
    run = conf.replace("listener 1883 0.0.0.0", f"listener {port} 127.0.0.1")
    run = run.replace("/var/lib/mosquitto/", f"{tmp_path}/").replace("log_dest syslog",
                                                                     "log_dest stderr")
    run = run.replace(f"{site_etc}/fedseq.passwd", str(tmp_path / "passwd"))
    (tmp_path / "passwd").write_text("")
    (tmp_path / "run.conf").write_text(run + f"\nuser {getpass.getuser()}\n")
    broker = subprocess.Popen([MOSQUITTO, "-c", str(tmp_path / "run.conf")],
                              stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        assert broker.poll() is None, broker.stderr.read()
    finally:
        broker.terminate()
        broker.wait(10)


def _crl(ca_cert, ca_key, revoked_cert) -> bytes:
    """A CRL signed by the CA that lists `revoked_cert` (all PEM files)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    key = serialization.load_pem_private_key(ca_key.read_bytes(), None)
    cert = x509.load_pem_x509_certificate(revoked_cert.read_bytes())
    now = dt.datetime.now(dt.timezone.utc)
    entry = (x509.RevokedCertificateBuilder().serial_number(cert.serial_number)
             .revocation_date(now).build())
    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject).last_update(now)
           .next_update(now + dt.timedelta(days=30)).add_revoked_certificate(entry)
           .sign(key, hashes.SHA256()))
    return crl.public_bytes(serialization.Encoding.PEM)


def test_the_roll_out_makes_the_guard_password_once_and_strong(tmp_path):
    """Hardening VI, finding 2: the flood guard is on by default. site.yml's group_vars make its
    password on the controller (ansible's password lookup), the same value for the broker's and
    the coordinator's roles on every run, strong enough for the coordinator's check, in a file
    its owner alone reads."""
    from fedseq.common.files import read_private_secret

    def value() -> str:
        r = subprocess.run(
            ["ansible", "localhost", "-i", "localhost,", "-c", "local", "--playbook-dir",
             str(ANSIBLE), "-e", f"fedseq_credentials_dir={tmp_path / 'cred'}", "-m",
             "ansible.builtin.debug", "-a", "var=fedseq_guard_password"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "ANSIBLE_NOCOLOR": "1"})
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return json.loads(r.stdout.split("=>", 1)[1])["fedseq_guard_password"]

    first = value()
    assert value() == first and len(first) == 48
    secret = tmp_path / "cred" / "fedseq-guard-localhost"
    assert secret.read_text().strip() == first
    assert secret.stat().st_mode & 0o077 == 0
    assert read_private_secret(secret, "the guard password", "a test") == first



def _rendered(tmp_path, hosts: str, role: str, var: str) -> dict[str, str]:
    """`var` of role `role` (its defaults, as the role sees them) on the hosts of
    inventory/sites.yml that site.yml applies it to."""
    r = subprocess.run(
        ["ansible", hosts, "-i", "inventory/sites.yml", "-e",
         f"fedseq_credentials_dir={tmp_path / 'cred'}", "-e", f"@roles/{role}/defaults/main.yml",
         "-m", "ansible.builtin.debug", "-a", f"var={var}"],
        cwd=ANSIBLE, capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {m.group(1): json.loads(m.group(2))[var] for m in re.finditer(
        r"^(\S+) \| SUCCESS => (\{.*?^\})", r.stdout, re.S | re.M)}


def test_each_broker_has_its_own_guard_secret_and_no_host_holds_another_brokers(tmp_path):
    """Hardening VII, finding 3: with one guard password for every broker, a site's host held
    the coordinator broker's admin secret. Rendered over inventory/sites.yml with the roles'
    own defaults: the coordinator's broker and the coordinator share one secret, each site's
    broker and edge another, and the three differ."""
    broker = _rendered(tmp_path, "broker:site_hosts", "fedseq_broker",
                       "fedseq_broker_guard_password")
    coordinator = _rendered(tmp_path, "coordinator", "fedseq_coordinator",
                            "fedseq_coordinator_guard_password")
    edge = _rendered(tmp_path, "site_hosts", "fedseq_edge", "fedseq_edge_guard_password")
    assert set(broker) == {"server", "lab1-gw", "lab2-gw"} and set(edge) == {"lab1-gw", "lab2-gw"}
    assert coordinator["server"] == broker["server"]
    for site in ("lab1-gw", "lab2-gw"):
        assert edge[site] == broker[site] and len(edge[site]) == 48
        assert broker[site] != broker["server"]
    assert broker["lab1-gw"] != broker["lab2-gw"]
    made = sorted(p.name for p in (tmp_path / "cred").iterdir())
    assert made == ["fedseq-guard-lab1-gw", "fedseq-guard-lab2-gw", "fedseq-guard-server"]
