"""A device on the oldest supported stack (Python 3.8, torch 1.12: what a Jetson Nano's community
image and JetPack 5 have) joins a coordinator on the current stack over Mosquitto and completes
real runs; its updates pass the coordinator's round contract, and the result stays close to the
simulation's (not bitwise: torch 1.12 and the coordinator's torch use different kernels).

The device's interpreter is $FEDSEQ_DEVICE_PYTHON, a venv holding the bare fedseq wheel (the lean
device install) with torch 1.12; .ci/run makes one. Without it this module is skipped."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import coordinator_run
from fedseq.server.ops.deployment import stop_children
from fedseq.server.ops.simulation import run_simulation

DEVICE_PYTHON = os.environ.get("FEDSEQ_DEVICE_PYTHON", "")
pytestmark = pytest.mark.skipif(not DEVICE_PYTHON, reason="set FEDSEQ_DEVICE_PYTHON to a device-stack "
                                "venv's python (.ci/run makes one with Python 3.8 and torch 1.12)")


def _stack() -> str:
    code = "import sys, torch; print('%d.%d' % sys.version_info[:2], torch.__version__)"
    return subprocess.run([DEVICE_PYTHON, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def _old_device(name: str, port: int, home: Path, data_root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [DEVICE_PYTHON, "-m", "fedseq.client.cli", "--device", name, "--broker",
         f"mqtt://127.0.0.1:{port}", "--data-dir", str(data_root), "--state-dir",
         str(home / "state" / name), "--username", name, "--password-file",
         str(home / f"{name}.pw"), "--threads", "1", "--torch-device", "cpu",
         "--log-level", "WARNING"],
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_old_stack_is_what_it_claims():
    py, torch_version = _stack().split()
    assert tuple(map(int, py.split("."))) < (3, 10), py  # else this test proves nothing
    assert tuple(map(int, torch_version.split(".")[:2])) < (2, 1), torch_version


def test_the_lean_install_has_no_server_packages():
    code = ("import importlib.metadata as m; "
            "print(sorted(d.metadata['Name'].lower() for d in m.distributions()))")
    names = subprocess.run([DEVICE_PYTHON, "-c", code], capture_output=True, text=True, check=True,
                           timeout=120).stdout
    assert "'fedseq'" in names and "'torch'" in names
    for server_only in ("amqtt", "typer", "rich", "matplotlib", "tomli-w", "tomli_w"):
        assert f"'{server_only}'" not in names, server_only


def test_server_commands_refuse_the_device_stack_in_one_line():
    bindir = Path(DEVICE_PYTHON).parent
    for command in ("fedseq-sim", "fedseq-server", "fedseq"):
        r = subprocess.run([str(bindir / command), "--help"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{command} needs Python >= 3.10" in r.stderr and "fedseq-client" in r.stderr


@pytest.mark.slow("Python 3.8 / torch 1.12 device daemons join rounds: 7 s on 2 cores")
@pytest.mark.parametrize("algorithm", ["fedavg", "fedper"])
def test_old_stack_device_completes_rounds(algorithm, data_root, tmp_path, mosquitto, one_thread):
    port, home, _ = mosquitto
    devices = [_old_device(n, port, home, data_root) for n in ("local01", "local02")]
    try:
        cfg, dep = coordinator_run(data_root, tmp_path / "run", mosquitto,
                                   f"algorithm.name={algorithm}", "rounds=3", "train.join_ratio=0.6",
                                   "train.threads=1", "deploy.min_devices=2")
    finally:
        stop_children(devices)
    assert [d.returncode for d in devices] == [0, 0]
    sim = run_simulation(cfg, out=None)
    train = [r for r in dep.rows if r["phase"] == "train"]
    assert len(train) == 3
    for d, s in zip(train, [r for r in sim.rows if r["phase"] == "train"], strict=True):
        # every selected client's update passed the round contract (owner, sample counts, shapes)
        assert d["clients"] == s["clients"] and d["reported"] == d["clients"]
        assert abs(d["global_acc"] - s["global_acc"]) <= 0.02, (d["global_acc"], s["global_acc"])
    flat_dep = torch.cat([dep.global_weights[k].flatten() for k in sorted(sim.global_weights)])
    flat_sim = torch.cat([sim.global_weights[k].flatten() for k in sorted(sim.global_weights)])
    rel = float((flat_dep - flat_sim).norm() / flat_sim.norm())
    print(f"{algorithm}: device stack {_stack()}: ||w_dep - w_sim|| / ||w_sim|| = {rel:.3g}, "
          f"max |w_dep - w_sim| = {float((flat_dep - flat_sim).abs().max()):.3g}")
    # float32 rounding of other kernels, carried on by training: the same config on one stack with
    # 2 threads instead of 1 moves the weights by 1.8e-3 (docs/deploy.md); a device training on
    # other rows or under another plan moves them by orders of magnitude more
    assert rel < 5e-3
    assert all(torch.isfinite(v).all() for v in dep.global_weights.values())
    # the run records which stack trained it: the devices' torch, not the coordinator's
    stacks = json.loads((tmp_path / "run" / "devices.json").read_text())
    assert {v[-1]["torch"].split("+")[0] for v in stacks.values()} == {"1.12.1"}
    assert all(v[-1]["python"].startswith("3.8.") for v in stacks.values())


@pytest.mark.slow("Python 3.8 / torch 1.12 daemons read their own folders and join rounds: ~6 s")
def test_old_stack_devices_train_on_their_own_folders(tmp_path, mosquitto, one_thread):
    """data.placement = "device" on Mosquitto with the project's ACL: each old-stack daemon reads
    only its --data-dir and announces its clients in its status; every update passes the round
    contract's announced sizes, close to fedseq-sim --devices-data of the same folders."""
    from conftest import fmnist_devices, placed_config
    from fedseq.server.ops.deployment import run_deployment

    port, home, _ = mosquitto
    root = fmnist_devices(tmp_path / "devices")
    devices = [_old_device(n, port, home, root / n) for n in ("local01", "local02")]
    cfg = placed_config(root, "deploy.username=coordinator", "deploy.min_devices=2",
                        f"deploy.password_file={str(home / 'coordinator.pw')!r}")
    try:
        dep = run_deployment(cfg, tmp_path / "run", broker=f"mqtt://127.0.0.1:{port}",
                             announce=lambda m: None)
    finally:
        stop_children(devices)
    sim = run_simulation(cfg, None)
    for d, s in zip(dep.rows, sim.rows, strict=True):
        assert d["reported"] == s["reported"] == [0, 1, 2]
        assert abs(d["federated_acc"] - s["federated_acc"]) <= 0.03
    assert {v[-1]["torch"].split("+")[0] for v in json.loads(
        (tmp_path / "run" / "devices.json").read_text()).values()} == {"1.12.1"}
