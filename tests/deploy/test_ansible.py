"""The ansible roll-out for real: lint, syntax, and the client role applied to this machine under
a temporary prefix (systemd off), twice; the installed fedseq-client then completes a run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, quick_config
from fedseq.server.broker import free_port
from fedseq.server.deployment import run_deployment, stop_children

ANSIBLE = ROOT / "deploy" / "ansible"
pytestmark = pytest.mark.skipif(shutil.which("ansible-playbook") is None,
                                reason="ansible-core not installed (pip install -e '.[dev]')")


def test_lint_and_syntax():
    r = subprocess.run(["ansible-playbook", "--syntax-check", "-i", "inventory/testbed.yml",
                        "site.yml"], cwd=ANSIBLE, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(["ansible-lint", "--profile", "production", "--nocolor"], cwd=ANSIBLE,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _play(prefix, wheel, port, data_root):
    return subprocess.run(
        ["ansible-playbook", "-i", "localhost,", "-c", "local", "client-local.yml",
         "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"fedseq_client_prefix={prefix}",
         "-e", f"fedseq_client_wheel={wheel}", "-e", "fedseq_client_device=ansible01",
         "-e", f"fedseq_client_broker_url=mqtt://127.0.0.1:{port}",
         "-e", f"fedseq_client_dataset_src={data_root / 'FashionMNIST'}",
         "-e", "fedseq_client_threads=1", "-e", "fedseq_client_torch_device=cpu",
         # torch and the other dependencies come from the environment running the tests (a venv
         # in CI), as a device's come from JetPack's system packages
         "-e", f"fedseq_client_site_from={sys.executable}"],
        cwd=ANSIBLE, capture_output=True, text=True, timeout=600,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"})


def test_client_role_installs_a_working_client(tmp_path, data_root):
    wheels = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
                    str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("fedseq-*.whl")
    prefix, port = tmp_path / "root", free_port()
    first = _play(prefix, wheel, port, data_root)
    assert first.returncode == 0, first.stdout[-3000:]
    second = _play(prefix, wheel, port, data_root)
    assert second.returncode == 0, second.stdout[-3000:]
    assert re.search(r"localhost\s*:\s*ok=\d+\s+changed=0\s", second.stdout), second.stdout[-1500:]

    client = prefix / "opt" / "fedseq" / "venv" / "bin" / "fedseq-client"
    config = prefix / "etc" / "fedseq" / "client.toml"
    assert client.exists() and 'device = "ansible01"' in config.read_text()
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
