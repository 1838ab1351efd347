"""The server optimizers and SCAFFOLD in whole runs: FedAvgM without momentum is FedAvg, and a resumed run
continues the optimizer's moments bitwise (their steps: tests/common/algorithms/test_serveropt.py;
--workers and deployment parity: test_distributed.py, test_deployment.py)."""

import pytest
import torch

from conftest import quick_config
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.rounds.checkpoint import load_checkpoint


@pytest.mark.slow("server optimizers over whole runs: 4 s on 2 cores")
def test_fedavgm_without_momentum_is_fedavg_bitwise(data_root, one_thread):
    a = run_simulation(quick_config(data_root, "algorithm.name=fedavg", "rounds=2"), None)
    b = run_simulation(quick_config(data_root, "algorithm.name=fedavgm", "algorithm.beta1=0",
                                    "rounds=2"), None)
    assert all(torch.equal(a.global_weights[k], v) for k, v in b.global_weights.items())
    assert [r["global_acc"] for r in a.rows] == [r["global_acc"] for r in b.rows]


@pytest.mark.slow("server optimizers over whole runs: 4 s on 2 cores")
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


@pytest.mark.slow("server optimizers over whole runs: 4 s on 2 cores")
def test_scaffold_resumes_both_control_variates_bitwise(data_root, tmp_path, one_thread):
    """The server's c in the checkpoint's algorithm state, each client's c_i with its personal
    state: a run stopped after round 0 and resumed is bitwise the whole run, rows included."""
    cfg = quick_config(data_root, "algorithm.name=scaffold", "rounds=3", "train.join_ratio=0.6")
    whole = run_simulation(cfg, None)
    with pytest.raises(KeyboardInterrupt):
        run_simulation(cfg, tmp_path / "run", pause_after=1)
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.server and all(k.split(".")[0].endswith("~c") for k in ckpt.server)
    assert any(float(t.abs().max()) > 0 for t in ckpt.server.values())  # round 0 moved c
    trained = sorted(c for c, held in ckpt.pool.personal.items() if held)
    assert trained == whole.records[0].clients  # c_i of round 0's clients, nobody else's
    assert all(k.split(".")[0].endswith("~ci") for c in trained for k in ckpt.pool.personal[c])
    resumed = run_simulation(cfg, tmp_path / "run", mode="resume")
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in whole.global_weights.items())
    assert [r["global_acc"] for r in resumed.rows] == [r["global_acc"] for r in whole.rows[1:]]
    assert [r["bytes_down"] for r in resumed.rows] == [r["bytes_down"] for r in whole.rows[1:]]
    # a round sends SCAFFOLD's clients c beside the model and brings dc back: about twice
    # FedAvg's bytes each way
    fedavg = run_simulation(quick_config(data_root, "algorithm.name=fedavg", "rounds=1",
                                         "train.join_ratio=0.6"), None).rows[0]
    assert 1.9 < whole.rows[0]["bytes_up"] / fedavg["bytes_up"] < 2.1
    assert 1.9 < whole.rows[0]["bytes_down"] / fedavg["bytes_down"] < 2.1
