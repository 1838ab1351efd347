"""Where torch computes: one choice rule for the simulation and the device daemon."""

from __future__ import annotations

from typing import Any

import torch

from fedseq.common.errors import ConfigError


def torch_device(choice: str, setting: str = "train.device") -> torch.device:
    """A device choice (auto, cpu, cuda, cuda:N) as a torch device; a CUDA choice this machine
    cannot honour is a one-line ConfigError saying why (a CPU-only torch, or no such GPU)."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"{setting}={choice!r}, but torch {torch.__version__} ({build}) "
                              f"sees no GPU; use {setting}='cpu' or install a CUDA torch "
                              "(README, Set up)")
        index = int(choice.split(":")[1]) if ":" in choice else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{setting}={choice!r}, but this machine has "
                              f"{torch.cuda.device_count()} GPU(s); use cuda:0")
        full_fp32_on_cuda()
    return torch.device(choice)


def full_fp32_on_cuda() -> None:
    """GPU runs compute in IEEE FP32 with cuDNN's deterministic kernels, as the CPU does.
    Left alone, torch lets cuDNN convolve in TF32 on Ampere and newer GPUs (a Jetson Orin, an
    A100, an H100; not a Nano's Maxwell): a 10-bit mantissa, which on an H100 doubled the largest
    weight difference to a CPU run after 3 rounds (README, Reproducibility), so the same config
    would train a different model on an Orin than on a Nano or a CPU. What this costs in speed
    was not measured (on an H100 or a Jetson); there is no switch back to TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def hardware_name(device_tree: str = "/proc/device-tree/model", cpuinfo: str = "/proc/cpuinfo") -> str:
    """The board's model where the kernel names one (a Jetson: "NVIDIA Jetson Nano Developer
    Kit"), else the CPU's model name (x86 Linux), else what `platform` knows."""
    import platform

    try:
        with open(device_tree, "rb") as f:
            model = f.read().decode("utf-8", "replace").strip("\x00 \n")
        if model:
            return model
    except OSError:
        pass
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compute_record(device: torch.device) -> dict[str, Any]:
    """What a model trained here depends on besides its config and seed (README,
    Reproducibility): the torch build, its CPU threads, the hardware. Recorded with every
    simulated run (status.json) and sent by every device (DeviceInfo, devices.json)."""
    import platform

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda or "", "torch_device": str(device), "gpu": gpu,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpu": hardware_name()}
