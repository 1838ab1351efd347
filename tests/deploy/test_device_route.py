"""The documented plain-venv device route (docs/deploy.md: PyPI's torch 1.12 on Python >= 3.9),
installed by exactly its commands, makes a device that joins a round; and the stack that route
avoids (numpy 2 beside torch 1.12, what pip picks without the pin) is refused in one line by
fedseq-client and its doctor, before any round.

$FEDSEQ_ROUTE_PYTHON is that venv's python and $FEDSEQ_NUMPY2_PATH a folder holding numpy 2.0.2;
.ci/run makes both (the venv by running the docs' lines). Without them this module is skipped."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import coordinator_run, device_process
from fedseq.server.ops.deployment import stop_children

ROUTE_PYTHON = os.environ.get("FEDSEQ_ROUTE_PYTHON", "")
NUMPY2 = os.environ.get("FEDSEQ_NUMPY2_PATH", "")
pytestmark = pytest.mark.skipif(not ROUTE_PYTHON, reason="set FEDSEQ_ROUTE_PYTHON to a venv made by "
                                "docs/deploy.md's device-install lines (.ci/run makes one)")


def _run(*args: str, numpy2: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if numpy2:
        env["PYTHONPATH"] = NUMPY2
    return subprocess.run([ROUTE_PYTHON, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_the_route_gives_torch_1_12_on_python_3_9_or_later_with_numpy_1():
    r = _run("-c", "import sys, torch, numpy; print('%d.%d' % sys.version_info[:2], "
                   "torch.__version__, numpy.__version__)")
    py, torch_version, numpy_version = r.stdout.split()
    assert tuple(map(int, py.split("."))) >= (3, 9), py  # where pip would pick numpy 2
    assert torch_version.startswith("1.12."), torch_version
    assert numpy_version.startswith("1."), numpy_version
    stack = _run("-m", "fedseq.client.stack")
    assert stack.returncode == 0 and "ok: supported" in stack.stdout, stack.stdout


@pytest.mark.skipif(not NUMPY2, reason="set FEDSEQ_NUMPY2_PATH to a folder holding numpy 2")
def test_numpy_2_beside_torch_1_12_is_refused_in_one_line(tmp_path):
    probe = _run("-c", "import numpy; print(numpy.__version__)", numpy2=True)
    assert probe.stdout.strip().startswith("2."), probe.stdout  # the broken stack, for real
    r = _run("-m", "fedseq.client.cli", "--device", "dev01", "--broker", "mqtt://127.0.0.1:1",
             "--state-dir", str(tmp_path / "state"), numpy2=True)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2, r.stderr
    assert re.match(r"error: torch 1\.12\.1\S* cannot use numpy 2\.0\.2 ", last) and "numpy<2" in last, last
    doctor = _run("-m", "fedseq.client.cli", "doctor", "--device", "dev01", "--broker",
                  "mqtt://127.0.0.1:1", "--state-dir", str(tmp_path / "state"), numpy2=True)
    assert doctor.returncode == 1
    assert any(x.startswith("FAIL") and "cannot use numpy 2.0.2" in x
               for x in doctor.stdout.splitlines()), doctor.stdout
    stack = _run("-m", "fedseq.client.stack", numpy2=True)
    assert stack.returncode == 1 and "unsupported: torch 1.12.1" in stack.stdout, stack.stdout
    assert "cannot use numpy 2.0.2" in stack.stdout


@pytest.mark.slow("a device venv built by the documented route joins a round: 5 s on 2 cores")
def test_a_device_installed_by_the_route_joins_a_round(data_root, tmp_path, mosquitto, one_thread):
    port, home, _ = mosquitto
    devices = [device_process(name, port, home, data_root, "--torch-device", "cpu",
                              python=ROUTE_PYTHON) for name in ("local01", "local02")]
    try:
        _, dep = coordinator_run(data_root, tmp_path / "run", mosquitto, "algorithm.name=fedavg",
                                 "rounds=2", "train.join_ratio=0.6", "train.threads=1",
                                 "deploy.min_devices=2")
    finally:
        stop_children(devices)
    train = [r for r in dep.rows if r["phase"] == "train"]
    assert len(train) == 2 and all(r["reported"] == r["clients"] for r in train), train
    stacks = json.loads((Path(tmp_path) / "run" / "devices.json").read_text())
    assert {v[-1]["torch"].split("+")[0] for v in stacks.values()} == {"1.12.1"}
    assert all(v[-1]["python"].startswith("3.10.") for v in stacks.values())
