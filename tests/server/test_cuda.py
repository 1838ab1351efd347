"""train.device: the simulation on a GPU. The GPU tests skip without CUDA (the project's `device`
tool runs them on a lent GPU machine); the error path runs everywhere else."""

import pytest
import torch

from conftest import quick_config
from fedseq.common.errors import ConfigError
from fedseq.server.ops.simulation import run_simulation

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
    """Same seeds, same batches, FP32 on both (TF32 off): only the kernels' reduction order differs,
    and three rounds of SGD with momentum amplify that. Measured on an H100 (torch 2.11, CUDA 13):
    the largest per-tensor relative L2 difference was 9.8e-3 (FedAvg), 3.7e-2 (FedReG), 2.1e-3
    (FedSeq-Anti), accuracy within 0.5 points; a broken GPU path (a block not trained, another
    batch order) moves whole tensors, O(1). 2 points on ~900 test rows is about two standard
    errors of one accuracy estimate."""
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
        rel = ((v - gpu.global_weights[k]).norm() / v.norm().clamp_min(1e-12)).item()
        assert rel <= 0.1, (k, rel)


@cuda
def test_gpu_run_is_bitwise_repeatable_in_fp32(data_root):
    """The same config twice on the same GPU: bitwise the same weights (deterministic cuDNN), and
    the run left TF32 off (docs/explanation/reproducibility.md)."""
    over = ["algorithm.name=fedavg", "rounds=2", "model.name=convnet", "train.device=cuda"]
    a = run_simulation(quick_config(data_root, *over), out=None)
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    b = run_simulation(quick_config(data_root, *over), out=None)
    for k, v in a.global_weights.items():
        assert torch.equal(v, b.global_weights[k]), k


def test_doctor_reports_a_broken_cuda_in_one_line():
    from fedseq.client.doctor import cuda_kernel_check

    class Broken:
        __version__ = "9.9"

        class cuda:  # noqa: N801 - stands in for torch.cuda
            @staticmethod
            def get_device_properties(i):
                raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    ok, msg = cuda_kernel_check(Broken)
    assert ok is False and "test kernel failed" in msg and "driver" in msg and "\n" not in msg


@cuda
def test_doctor_names_the_gpu_and_runs_a_kernel():
    from fedseq.client.doctor import cuda_kernel_check

    ok, msg = cuda_kernel_check(torch)
    assert ok and torch.cuda.get_device_name(0) in msg and "test kernel ok" in msg and "GiB" in msg


@cuda
def test_daemon_trains_on_the_gpu_and_agrees_with_cpu(data_root, tmp_path):
    """A real fedseq-client process with --torch-device cuda against an embedded broker; the
    result agrees with a CPU simulation within the tolerance above."""
    import subprocess
    import sys

    from fedseq.server.ops.broker import free_port
    from fedseq.server.ops.deployment import run_deployment, stop_children

    port = free_port()
    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "model.name=convnet",
                       f"deploy.port={port}", "deploy.wait_devices_s=120")
    proc = subprocess.Popen([sys.executable, "-m", "fedseq.client.cli", "--device", "gpu01",
                             "--broker", f"mqtt://127.0.0.1:{port}", "--torch-device", "cuda",
                             "--data-dir", str(data_root), "--state-dir", str(tmp_path / "s")])
    try:
        dep = run_deployment(cfg, tmp_path / "dep", announce=lambda s: None)
    finally:
        stop_children([proc])
    cpu = run_simulation(cfg, out=None)
    for d, c in zip(dep.rows, cpu.rows, strict=True):
        assert d["reported"] == d["clients"]
        assert abs(d["global_acc"] - c["global_acc"]) <= 0.02
