"""The diagnostic benchmarks that read committed run directories still run against them (an API
change once broke bench/replay_finetune.py unnoticed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, server_only

RUN = ROOT / "docs" / "results" / "testbed" / "runs" / "fedseq-anti" / "seed-2"


@pytest.mark.slow("a benchmark run end to end: 3 s on 2 cores")
@server_only
def test_replay_finetune_replays_a_committed_checkpoint(data_root):
    out = subprocess.run(
        [sys.executable, "bench/replay_finetune.py", str(RUN), "29", "--set",
         "algorithm.finetune_epochs=1", "--set", "train.lr=0.005"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    whole = "trainable ('conv1', 'conv2', 'fc1', 'fc2', 'fc3'), 1 epochs"
    assert f"client 29 after round 99: {whole}" in out.stdout
    assert "finite throughout" in out.stdout and "largest gradient norm 50.6" in out.stdout
