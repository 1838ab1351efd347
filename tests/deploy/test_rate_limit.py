"""The broker role's optional host rate limit (docs/deploy.md, "A host rate limit"), for real: the
role renders its nftables table, the table is loaded in a network namespace of its own, and a
client in another namespace opens connections and sends bytes to the broker's port: with the
table, one address gets its burst of connections and the byte rate; without it, everything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT

ANSIBLE = ROOT / "deploy" / "ansible"
pytestmark = [
    pytest.mark.xdist_group("netns"),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and nftables need root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables not installed "
                       "(apt-get install nftables; .ci/run installs it)"),
    pytest.mark.skipif(shutil.which("ansible-playbook") is None,
                       reason="ansible-core not installed (pip install -e '.[dev]')"),
]
SERVER, CLIENT = "fsrl-srv", "fsrl-cli"
SERVER_IP = "10.78.0.1"  # addresses inside the test's own namespaces

SINK = f"""
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{SERVER_IP}", 1883)); s.listen(256); print("ready", flush=True)
def drain(c):
    while c.recv(1 << 16):
        pass
    c.close()  # all of it read: the sender's recv sees the end
while True:
    c, _ = s.accept()
    threading.Thread(target=drain, args=(c,), daemon=True).start()
"""

PROBE = f"""
import json, socket, time
ok = 0
for _ in range(40):  # 40 new connections as fast as they go: a password guesser's pace
    s = socket.socket(); s.settimeout(0.3)
    try:
        s.connect(("{SERVER_IP}", 1883)); ok += 1
    except OSError:
        pass
    s.close()
time.sleep(2.5)  # the connection bucket refills
s = socket.create_connection(("{SERVER_IP}", 1883), timeout=30)
t = time.monotonic()
s.sendall(b"x" * (6 << 20))  # 6 MB as fast as TCP sends it
s.shutdown(socket.SHUT_WR)
s.recv(1)  # returns once the sink has read every byte and closed
s.close()
print(json.dumps({{"connected": ok, "seconds": time.monotonic() - t}}))
"""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


def _probe() -> dict:
    out = subprocess.run(["ip", "netns", "exec", CLIENT, sys.executable, "-c", PROBE],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow("ansible renders the table; 2 x 40 connections and 6 MB through it: 20 s")
def test_the_rate_limit_bounds_connections_and_bytes_per_address(tmp_path):
    nft = tmp_path / "fedseq-broker.nft"
    play = tmp_path / "limit.yml"
    play.write_text("- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
                    "    - {ansible.builtin.include_role: {name: fedseq_broker, "
                    "tasks_from: ratelimit.yml}}\n")
    extra = {"fedseq_broker_manage_service": False, "fedseq_broker_nft_file": str(nft),
             "fedseq_broker_connections_per_s": 2, "fedseq_broker_connections_burst": 10,
             "fedseq_broker_mbytes_per_s": 1, "fedseq_broker_mbytes_burst": 1,
             "fedseq_broker_rate_limit_exempt": ["192.0.2.7", "2001:db8::/64"]}
    r = subprocess.run(["ansible-playbook", "-i", "localhost,", "-c", "local", str(play),
                        "-e", f"ansible_python_interpreter={sys.executable}",
                        "-e", json.dumps(extra)], cwd=ANSIBLE, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "ANSIBLE_NOCOLOR": "1",
                                         "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    text = nft.read_text()
    assert "ip saddr { 192.0.2.7 } accept" in text and "ip6 saddr { 2001:db8::/64 }" in text
    for ns in (SERVER, CLIENT):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    sink = None
    try:
        _sh("ip", "netns", "add", SERVER)
        _sh("ip", "netns", "add", CLIENT)
        _sh("ip", "link", "add", "fsrl0", "type", "veth", "peer", "name", "fsrl1")
        _sh("ip", "link", "set", "fsrl0", "netns", SERVER)
        _sh("ip", "link", "set", "fsrl1", "netns", CLIENT)
        for ns, dev, ip in ((SERVER, "fsrl0", SERVER_IP), (CLIENT, "fsrl1", "10.78.0.2")):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        sink = subprocess.Popen(["ip", "netns", "exec", SERVER, sys.executable, "-c", SINK],
                                stdout=subprocess.PIPE, text=True)
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"

        free = _probe()  # no table: every connection, and the bytes at the veth's pace
        _sh("ip", "netns", "exec", SERVER, "nft", "-f", str(nft))
        _sh("ip", "netns", "exec", SERVER, "nft", "-f", str(nft))  # loading again replaces it
        time.sleep(1)
        limited = _probe()
        tables = subprocess.run(["ip", "netns", "exec", SERVER, "nft", "list", "tables"],
                                capture_output=True, text=True, check=True).stdout
    finally:
        if sink is not None:
            sink.kill()
        for ns in (SERVER, CLIENT):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    print("without the table", free, "with it", limited)
    assert tables.split() == ["table", "inet", "fedseq_broker"]
    assert free["connected"] == 40 and free["seconds"] < 1.5, free
    # the burst of 10 and about 2 a second while the 40 tries last (each refused one waits
    # 0.3 s): at most 10 + 2 x 12 s
    assert 8 <= limited["connected"] <= 34 and limited["connected"] < free["connected"], limited
    # 6 MB at 1 MB/s after a 1 MB burst: about 5 s (TCP backs off on the drops)
    assert limited["seconds"] >= 3.0, limited
