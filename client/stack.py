"""What software stack this device runs (L4T/JetPack release, glibc, Python, torch, CUDA) and
whether fedseq-client supports it; if not, the route that does, for this kind of device.

One source for `fedseq-client doctor` and the ansible role's preflight, which runs this file
with the device's Python straight from the project wheel, before anything is installed:
`python -c "import sys; sys.path.insert(0, WHEEL); from fedseq.client.stack import main; main()"`.
So this module is standard library only and parses on Python 3.6 (stock JetPack 4), where it must
say what to do rather than fail with a SyntaxError: no annotations syntax newer than 3.6, no
`from __future__ import annotations`, no f-string `=`. docs/deploy.md explains each route.
"""

import os
import platform
import re
import sys

MIN_PYTHON = (3, 8)
MIN_TORCH = (1, 12)
DOCS = "docs/deploy.md, section 1"

# L4T major release -> JetPack generation (NVIDIA's release tables)
JETPACK = {32: "JetPack 4", 34: "JetPack 5", 35: "JetPack 5", 36: "JetPack 6"}

ROUTES = {
    "JetPack 4": (
        "JetPack 4 (L4T R32, Ubuntu 18.04, Python 3.6) cannot run fedseq-client as shipped. GPU: "
        "flash the community Ubuntu 20.04 image for the Nano (Python 3.8, CUDA 10.2) and install "
        "its CUDA torch 1.12/1.13 wheel system-wide; CPU only: `apt install python3.8 "
        "python3.8-venv` (bionic universe), set fedseq_client_python: python3.8 and "
        "fedseq_client_system_site_packages: false, and add torch==1.12.1 from PyPI to "
        "fedseq_client_packages (its aarch64 wheel needs glibc 2.17; torch >= 2.7 needs 2.28)"),
    "JetPack 5": (
        "JetPack 5 (L4T R35, Ubuntu 20.04, Python 3.8): install NVIDIA's torch 2.x wheel for "
        "JetPack 5 system-wide (pip3 install the .whl from NVIDIA's JetPack 5 PyTorch page) and "
        "keep fedseq_client_system_site_packages: true"),
    "JetPack 6": (
        "JetPack 6 (L4T R36, Ubuntu 22.04, Python 3.10): install NVIDIA's torch wheel for "
        "JetPack 6 system-wide and keep fedseq_client_system_site_packages: true"),
    "other": (
        "not a Jetson: Python >= 3.8 and torch >= 1.12 (CPU: pip install torch --index-url "
        "https://download.pytorch.org/whl/cpu; CUDA: the wheel for your CUDA version), with "
        "numpy<2 beside a torch older than 2.3"),
}


def l4t_release(path="/etc/nv_tegra_release"):
    """(major, 'R32.7.1', board) from a Jetson's release file, or None off a Jetson."""
    try:
        with open(path) as f:
            head = f.readline()
    except OSError:
        return None
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", head)
    if not m:
        return None
    board = re.search(r"BOARD:\s*([\w-]+)", head)
    return int(m.group(1)), f"R{m.group(1)}.{m.group(2)}", board.group(1) if board else "?"


def _version(text):
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def facts(release_file="/etc/nv_tegra_release"):
    """Everything the verdict needs, as strings and tuples (torch is imported if present)."""
    try:  # the C library really loaded ("glibc 2.31"); platform.libc_ver() reads the binary
        libc, libc_version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        libc, libc_version = platform.libc_ver()
    rel = l4t_release(release_file)
    out = {
        "machine": platform.machine(),
        "python": sys.version_info[:3],
        "glibc": libc_version if libc == "glibc" else "",
        "l4t": rel[1] if rel else "",
        "board": rel[2] if rel else "",
        "jetpack": JETPACK.get(rel[0], f"L4T R{rel[0]}") if rel else "",
        "torch": "", "cuda": "", "torch_error": "",
    }
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda or ""
    except Exception as exc:  # not installed, or a wheel built for another libc or Python
        first = str(exc).splitlines()[0] if str(exc) else ""
        out["torch_error"] = f"{type(exc).__name__}: {first}"
    out["numpy"], out["numpy_error"] = numpy_facts() if out["torch"] else ("", "")
    return out


def numpy_facts():
    """(numpy's version, why torch cannot exchange arrays with it or ""). torch older than 2.3 was
    built against numpy 1.x and cannot use numpy 2 ("Numpy is not available" in the first round);
    pip picks numpy 2 on Python >= 3.9 unless told otherwise."""
    try:
        import numpy
    except Exception as exc:
        return "", f"numpy is not importable ({type(exc).__name__}: {exc})"
    try:
        import torch

        back = torch.from_numpy(numpy.arange(3, dtype=numpy.float32)).numpy()
        if back.tolist() != [0.0, 1.0, 2.0]:
            raise RuntimeError("arrays do not round-trip")
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return numpy.__version__, (
            f"torch {torch.__version__} cannot use numpy {numpy.__version__} ({first}): torch "
            "older than 2.3 was built against numpy 1.x; install numpy 1.x into this "
            "environment: pip install \"numpy<2\"")
    return numpy.__version__, ""


def describe(f):
    """One line: what this device runs."""
    parts = [f"Jetson {f['jetpack']} (L4T {f['l4t']}, board {f['board']})"
             if f["l4t"] else "not a Jetson (no /etc/nv_tegra_release)", f["machine"],
             "glibc " + (f["glibc"] or "?"), "Python " + ".".join(map(str, f["python"])),
             ("torch " + f["torch"] + (", CUDA " + f["cuda"] if f["cuda"] else ", CPU build"))
             if f["torch"] else "no torch"]
    if f.get("numpy"):
        parts.append("numpy " + f["numpy"])
    return ", ".join(parts)


def verdict(f, need_torch=True):
    """(ok, what to change): the problems with this stack, each with the route for this device."""
    route = ROUTES.get(f["jetpack"], ROUTES["other"])
    problems = []
    if tuple(f["python"][:2]) < MIN_PYTHON:
        problems.append(f"Python {'.'.join(map(str, f['python']))} is older than 3.8")
    if need_torch and not f["torch"]:
        problems.append(f"torch is not importable ({f['torch_error'] or 'not installed'})")
    elif f["torch"] and _version(f["torch"]) < MIN_TORCH:
        problems.append(f"torch {f['torch']} is older than 1.12")
    if f.get("numpy_error"):
        problems.append(f["numpy_error"])
    if f["machine"] not in ("aarch64", "x86_64"):
        problems.append(f"architecture {f['machine']} is not supported (aarch64 and x86_64 are)")
    if not problems:
        gpu = "CUDA " + f["cuda"] if f["cuda"] else "CPU only"
        return True, f"supported ({gpu})"
    return False, "; ".join(problems) + ". Route: " + route + " (" + DOCS + ")"


def main(argv=None):
    """Print the stack and the verdict; exit 1 when unsupported (the ansible preflight's check).
    `--no-torch`: judge Python and the platform only (torch is installed later)."""
    args = sys.argv[1:] if argv is None else argv
    f = facts()
    ok, why = verdict(f, need_torch="--no-torch" not in args)
    print(describe(f))
    print(("ok: " if ok else "unsupported: ") + why)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # pragma: no cover
    main()
