"""`fedseq new NAME`: the package it writes installs with pip, its own tests pass inside it, and
its config.toml runs on the data root's Fashion-MNIST."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import server_only
from fedseq.common.errors import ConfigError
from fedseq.server.cli.new_package import new_package

pytestmark = server_only
BIN = Path(sys.executable).parent


def test_a_bad_name_or_a_used_folder_is_refused_in_one_line(tmp_path):
    for bad in ("Lab Net", "pkg.mod:make", "-x", "a" * 41):
        with pytest.raises(ConfigError, match="is not a package name"):
            new_package(bad, tmp_path / "x")
    # Hardening VII, finding 10: each of these was accepted and wrote a broken package
    for bad, words in (("labnet\n", "is not a package name"), ("import", "is a Python keyword"),
                       ("class", "is a Python keyword"), ("match", "is a Python keyword"),
                       ("fedseq", "is an installed distribution"),
                       ("numpy", "is an installed distribution"),
                       ("json", r"is a module Python already imports \(json\)")):
        with pytest.raises(ConfigError, match=words) as got:
            new_package(bad, tmp_path / "x")
        assert len(str(got.value).splitlines()) == 1
        assert not (tmp_path / "x").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty"):
        new_package("labnet", tmp_path / "used")
    assert (tmp_path / "used" / "keep.txt").read_text() == "mine"


@pytest.mark.slow("pip builds and installs the package, then its tests and a run on FMNIST: ~25 s")
def test_fedseq_new_writes_a_package_whose_tests_pass_and_whose_config_runs(tmp_path, data_root):
    pkg, site = tmp_path / "acme", tmp_path / "site"
    out = subprocess.run([str(BIN / "fedseq"), "new", "acme-vision", "--dir", str(pkg)],
                         capture_output=True, text=True, check=True, timeout=120)
    assert "wrote 6 files" in out.stdout
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(site), str(pkg)],
                   check=True, timeout=300, cwd=tmp_path, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site), "FEDSEQ_DATA": str(data_root)}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                           cwd=pkg, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0 and "6 passed" in tests.stdout, tests.stdout[-2000:]
    run = subprocess.run([str(BIN / "fedseq-sim"), "--config", "config.toml", "--set", "rounds=2",
                          "--out", str(tmp_path / "run")], cwd=pkg, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "acme-vision-avg on fmnist (acme-vision-net)" in run.stdout + run.stderr
    assert '"distribution": "acme-vision"' in (tmp_path / "run" / "plugins.json").read_text()
    assert '"acme-vision-rule"' in (tmp_path / "run" / "plugins.json").read_text()
    assert "beta = 0.5" in (tmp_path / "run" / "config.toml").read_text()
    # the README's device-data route, as written: demo folders, then the simulated fleet
    subprocess.run([sys.executable, "-c", "import acme_vision; acme_vision.write_device_folders("
                    f"{str(tmp_path / 'devices')!r})"], env=env, check=True, timeout=120)
    run = subprocess.run([str(BIN / "fedseq-sim"), "--config", "device-data.toml", "--set",
                          "rounds=2", "--devices-data", str(tmp_path / "devices"), "--out",
                          str(tmp_path / "placed")], cwd=pkg, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "num_clients = 3" in (tmp_path / "placed" / "config.toml").read_text()
    rows = (tmp_path / "placed" / "metrics.jsonl").read_text().splitlines()
    assert '"federated_acc"' in rows[-1]
