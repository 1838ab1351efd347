"""What secure aggregation and DP clipping cost a device, measured on the emulated aarch64 device
(deploy/emulated_device.py: Debian 11 arm64 under qemu-user-static, Python 3.9, torch 1.12.1):
bench/secagg_cost.py (a client's SecAgg+ stages: key agreement and sharing, masking, unmasking)
runs inside it, with the fedseq wheel and `cryptography` installed there. Needs root (chroot,
binfmt). (bench/dp_cost.py needs the coordinator's code, Python >= 3.10: not on this device.)

    sudo .venv/bin/python bench/arm_cost.py [--dir /var/tmp/fedseq-arm64] [--clients 10 30 100]

The device is built by emulated_device.py's `build` step when it is not there (debootstrap and
torch under qemu: several minutes). Emulation runs aarch64 code several times slower than an
aarch64 CPU of the same clock would: read the figures as an upper bound for a Cortex-A57, and
their ratio to the same client's training (both emulated) as the device's share.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy"))
from emulated_device import build, in_device, mounted  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/fedseq-arm64"))
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 30, 100])
    ap.add_argument("--mirror", default="http://deb.debian.org/debian")
    a = ap.parse_args()
    rootfs = a.dir / "rootfs"
    build(rootfs, a.mirror)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp,
                        str(ROOT)], check=True)
        (wheel,) = Path(tmp).glob("fedseq-*.whl")
        shutil.copy(wheel, rootfs / "tmp" / wheel.name)
    shutil.copytree(ROOT / "bench", rootfs / "tmp" / "bench", dirs_exist_ok=True)
    with mounted(rootfs):
        in_device(rootfs, "python3", "-m", "pip", "install", "-q", "--no-cache-dir",
                  f"/tmp/{wheel.name}", "cryptography", "numpy<2")
        in_device(rootfs, "python3", "-c", "import platform, torch, cryptography; print("
                  "platform.machine(), platform.python_version(), torch.__version__, "
                  "cryptography.__version__)")
        in_device(rootfs, "python3", "/tmp/bench/secagg_cost.py", "--clients",
                  *map(str, a.clients), "--dropout", "0")
        in_device(rootfs, "python3", "/tmp/bench/clip_probe.py")


if __name__ == "__main__":
    main()
