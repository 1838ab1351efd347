"""What a run records about the CPU kernels it computed with (docs/explanation/reproducibility.md)."""

import os
import subprocess
import sys

import pytest
import torch

from fedseq.common.hardware import cpu_kernels

CAPABILITY = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)


def test_cpu_kernels_names_the_deciding_features_and_any_cap(tmp_path, monkeypatch):
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text("processor : 0\nflags : fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16\n")
    arm.write_text("processor : 0\nFeatures : fp asimd evtstrm sve\n")
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    first = CAPABILITY() if CAPABILITY else "unknown"
    assert cpu_kernels(str(x86)) == f"{first} (avx2 avx512f avx512_bf16)"
    assert cpu_kernels(str(arm)) == f"{first} (asimd sve)"
    assert cpu_kernels(str(tmp_path / "none")) == first
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_kernels(str(x86)).endswith("(avx2 avx512f avx512_bf16) ONEDNN_MAX_CPU_ISA=AVX2")


@pytest.mark.skipif(CAPABILITY is None, reason="torch < 2.1 cannot say which kernels it uses")
def test_the_record_follows_what_torch_really_dispatches_to():
    """ATEN_CPU_CAPABILITY=default makes torch use its portable kernels: the record says so."""
    code = "from fedseq.common.hardware import cpu_kernels; print(cpu_kernels())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.startswith("DEFAULT") and "ATEN_CPU_CAPABILITY=default" in out, out
