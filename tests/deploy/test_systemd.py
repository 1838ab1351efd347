"""The unit files pass `systemd-analyze verify` (ExecStart pointed at this install's scripts)."""

import shutil
import subprocess

import pytest

from conftest import ROOT

UNITS = ROOT / "deploy" / "systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_verify_clean(tmp_path):
    client, server = shutil.which("fedseq-client"), shutil.which("fedseq-server")
    assert client and server, "the project must be installed (pip install -e .)"
    text = (UNITS / "fedseq-client@.service").read_text()
    (tmp_path / "fedseq-client@jetson01.service").write_text(
        text.replace("/opt/fedseq/venv/bin/fedseq-client", client))
    text = (UNITS / "fedseq-server.service").read_text()
    (tmp_path / "fedseq-server.service").write_text(
        text.replace("/opt/fedseq/venv/bin/fedseq-server", server))
    r = subprocess.run(["systemd-analyze", "verify", "fedseq-client@jetson01.service",
                        "fedseq-server.service"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if "fedseq" in line]
    assert not problems, problems


def test_client_unit_keeps_gpu_devices_visible():
    unit = (UNITS / "fedseq-client@.service").read_text()
    hardening = (UNITS / "fedseq-client@.service.d" / "hardening.conf").read_text()
    for text in (unit, hardening):
        settings = [line for line in text.splitlines() if not line.startswith("#")]
        assert not any(s.startswith(("PrivateDevices", "DevicePolicy")) for s in settings)
    assert "SupplementaryGroups=video" in unit and "%i" in unit
