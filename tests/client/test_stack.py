"""client/stack.py: the device's software stack and the verdict doctor and the ansible preflight
print, against the release files Jetsons really carry."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from fedseq.client import stack

NANO = ("# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t210ref, EABI: aarch64, "
        "DATE: Sat Feb 19 17:05:08 UTC 2022\n")
XAVIER_JP5 = ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
              "DATE: Tue Aug  1 19:57:35 UTC 2023\n")
ORIN_JP6 = ("# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, EABI: aarch64, "
            "DATE: Fri Jul 19 23:24:25 UTC 2024\n")


def _facts(**kw):
    f = {"machine": "aarch64", "python": (3, 8, 10), "glibc": "2.31", "l4t": "", "board": "",
         "jetpack": "", "torch": "1.12.1", "cuda": "10.2", "torch_error": ""}
    f.update(kw)
    return f


@pytest.mark.parametrize("text, want", [(NANO, (32, "R32.7.1", "t210ref")),
                                        (XAVIER_JP5, (35, "R35.4.1", "t186ref")),
                                        (ORIN_JP6, (36, "R36.3.0", "generic"))])
def test_release_files(tmp_path, text, want):
    (tmp_path / "nv_tegra_release").write_text(text)
    assert stack.l4t_release(str(tmp_path / "nv_tegra_release")) == want
    f = stack.facts(str(tmp_path / "nv_tegra_release"))
    assert f["jetpack"] == stack.JETPACK[want[0]] and want[1] in stack.describe(f)


def test_no_release_file_is_not_a_jetson(tmp_path):
    assert stack.l4t_release(str(tmp_path / "missing")) is None
    assert "not a Jetson" in stack.describe(stack.facts(str(tmp_path / "missing")))


def test_verdicts_name_the_route_for_the_device():
    ok, why = stack.verdict(_facts(l4t="R32.7.1", jetpack="JetPack 4", python=(3, 8, 10)))
    assert ok and "CUDA 10.2" in why  # the community 20.04 image with a CUDA 10.2 torch
    ok, why = stack.verdict(_facts(l4t="R32.7.1", jetpack="JetPack 4", python=(3, 6, 9), torch=""))
    assert not ok and "Python 3.6.9 is older than 3.8" in why and "Ubuntu 20.04 image" in why
    ok, why = stack.verdict(_facts(l4t="R35.4.1", jetpack="JetPack 5", torch="1.11.0"))
    assert not ok and "torch 1.11.0 is older than 1.12" in why and "JetPack 5" in why
    ok, why = stack.verdict(_facts(l4t="R36.3.0", jetpack="JetPack 6", torch="", python=(3, 10, 12),
                                   torch_error="ImportError: libcudnn.so.8: cannot open"))
    assert not ok and "libcudnn" in why and "JetPack 6" in why
    ok, why = stack.verdict(_facts(machine="armv7l", cuda=""))
    assert not ok and "armv7l" in why
    assert stack.verdict(_facts(torch=""), need_torch=False)[0]
    assert stack.verdict(_facts(machine="x86_64", python=(3, 11, 7), torch="2.13.0", cuda=""))[0]


def _interpreter(name: str) -> str | None:
    """pyenv's build if there is one (its shims fail for versions not selected), else PATH's."""
    version = name[len("python"):]
    for exe in [*sorted(Path("/root/.pyenv/versions").glob(f"{version}*/bin/{name}")), shutil.which(name)]:
        if exe and subprocess.run([str(exe), "-c", "pass"], capture_output=True).returncode == 0:
            return str(exe)
    return None


@pytest.mark.parametrize("python", ["python3.6", "python3.8"])
def test_runs_on_the_oldest_pythons_a_jetson_has(python):
    """The ansible preflight runs it with stock JetPack 4's Python 3.6: it must say what to do."""
    exe = _interpreter(python)
    if exe is None:
        pytest.skip(f"no {python} on this machine")
    r = subprocess.run([str(exe), str(ROOT / "client" / "stack.py"), "--no-torch"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines()[0].startswith("not a Jetson"), r.stdout + r.stderr
    if python == "python3.6":
        assert r.returncode == 1 and "Python 3.6" in r.stdout and "older than 3.8" in r.stdout
    else:
        assert r.returncode == 0 and r.stdout.splitlines()[1].startswith("ok: supported")


def test_main_exit_code(capsys):
    with pytest.raises(SystemExit) as e:
        stack.main(["--no-torch"])
    assert e.value.code == (0 if sys.version_info >= (3, 8) else 1)
    assert "supported" in capsys.readouterr().out
