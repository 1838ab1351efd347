"""The server optimizers in whole runs: FedAvgM without momentum is FedAvg, and a resumed run
continues the optimizer's moments bitwise (their steps: tests/common/algorithms/test_serveropt.py;
--workers and deployment parity: test_distributed.py, test_deployment.py)."""

import pytest
import torch

from conftest import quick_config
from fedseq.server.checkpoint import load_checkpoint
from fedseq.server.simulation import run_simulation


def test_fedavgm_without_momentum_is_fedavg_bitwise(data_root, one_thread):
    a = run_simulation(quick_config(data_root, "algorithm.name=fedavg", "rounds=2"), None)
    b = run_simulation(quick_config(data_root, "algorithm.name=fedavgm", "algorithm.beta1=0",
                                    "rounds=2"), None)
    assert all(torch.equal(a.global_weights[k], v) for k, v in b.global_weights.items())
    assert [r["global_acc"] for r in a.rows] == [r["global_acc"] for r in b.rows]


@pytest.mark.parametrize("name", ["fedadam", "fedyogi"])
def test_a_resumed_run_continues_the_moments_bitwise(data_root, tmp_path, one_thread, name):
    cfg = quick_config(data_root, f"algorithm.name={name}", "rounds=3", "train.join_ratio=0.6")
    whole = run_simulation(cfg, None)

    def stop_after_round_0(row):
        if row.round == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_simulation(cfg, tmp_path / "run", stop_after_round_0)
    server = load_checkpoint(tmp_path / "run").server
    assert server and all(t.dtype == torch.float64 for t in server.values())
    resumed = run_simulation(cfg, tmp_path / "run", mode="resume")
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in whole.global_weights.items())
