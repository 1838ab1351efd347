"""train.device: the simulation on a GPU. The GPU tests skip without CUDA (the project's `device`
tool runs them on a lent GPU machine); the error path runs everywhere else."""

import pytest
import torch

from conftest import quick_config
from fedseq.common.errors import ConfigError
from fedseq.server.simulation import run_simulation

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_one_line(data_root):
    with pytest.raises(ConfigError, match="sees no GPU; use train.device='cpu'") as err:
        run_simulation(quick_config(data_root, "train.device=cuda"), out=None)
    assert "\n" not in str(err.value)


def test_bad_device_name_is_a_config_error(data_root):
    with pytest.raises(ConfigError, match="train.device"):
        quick_config(data_root, "train.device=gpu")


@cuda
@pytest.mark.parametrize("name", ["fedavg", "fedreg", "fedseq-anti"])
def test_gpu_run_agrees_with_cpu(data_root, name):
    """Same seeds, same batches: only the kernels' reduction order differs, so after a few rounds
    of SGD the weights differ in the last bits and accuracy by at most a few test rows. 2 points
    on ~900 test rows is about two standard errors of one accuracy estimate."""
    over = [f"algorithm.name={name}", "rounds=3", "train.threads=2", "model.name=convnet"]
    cpu = run_simulation(quick_config(data_root, *over), out=None)
    gpu = run_simulation(quick_config(data_root, *over, "train.device=cuda"), out=None)
    for c, g in zip(cpu.rows, gpu.rows, strict=True):
        for key in ("global_acc", "personal_acc", "local_acc"):
            if c.get(key) is not None:
                assert abs(c[key] - g[key]) <= 0.02, (key, c[key], g[key])
        assert c.get("train_flops") == g.get("train_flops")
    for k, v in cpu.global_weights.items():
        assert gpu.global_weights[k].device.type == "cpu"
        assert torch.allclose(v, gpu.global_weights[k], rtol=1e-2, atol=1e-3), k
