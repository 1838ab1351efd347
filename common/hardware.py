"""Where torch computes: one choice rule for the simulation and the device daemon."""

from __future__ import annotations

import os
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
                              "(docs/getting-started.md)")
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
    weight difference to a CPU run after 3 rounds (docs/explanation/reproducibility.md), so the same config
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
    return _cpuinfo_value(cpuinfo, ("model name",)) or platform.processor() or platform.machine()


def _cpuinfo_value(cpuinfo: str, keys: tuple[str, ...]) -> str:
    """The value of the first line of /proc/cpuinfo that starts with one of `keys`; "" where
    there is none or the file cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


#: CPU features that decide which kernels torch's CPU code (ATen, oneDNN) dispatches to
_KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "asimd", "sve", "sve2")
#: environment variables that cap those kernels' instruction set (docs/explanation/reproducibility.md)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_kernels(cpuinfo: str = "/proc/cpuinfo") -> str:
    """Which instruction set torch's CPU kernels use, e.g. "AVX512 (avx2 avx512f avx512_bf16)":
    ATen's dispatch level (torch >= 2.1), the CPU's deciding features, and any variable in
    KERNEL_ENV that caps them. Two runs of one config and torch build differ in the last bits
    where this differs (measured: an AVX2 and an AVX-512 AMD EPYC, docs/results.md), which a CPU
    model name ("AMD EPYC" in a VM) does not show."""
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    parts = [capability() if capability else "unknown"]
    flags = set(_cpuinfo_value(cpuinfo, ("flags", "Features")).split())
    found = [flag for flag in _KERNEL_FLAGS if flag in flags]
    if found:
        parts.append(f"({' '.join(found)})")
    parts += [f"{var}={os.environ[var]}" for var in KERNEL_ENV if os.environ.get(var)]
    return " ".join(parts)


def compute_record(device: torch.device) -> dict[str, Any]:
    """What a model trained here depends on besides its config and seed (docs/explanation/
    reproducibility.md): the torch build, its CPU threads, the hardware and its CPU kernels.
    Recorded with every simulated run (status.json) and sent by every device (DeviceInfo,
    devices.json)."""
    import platform

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda or "", "torch_device": str(device), "gpu": gpu,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpu": hardware_name(), "cpu_kernels": cpu_kernels()}
