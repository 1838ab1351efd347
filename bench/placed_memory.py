"""The coordinator's memory with the data on the devices (issue 77: with data.placement =
"device" the coordinator's memory does not grow with the devices' data). For each size, writes
two local devices' data folders (local01: one client, local02: two) of random 28x28 npz rows,
then runs one FedAvg round of a real deployment (embedded amqtt broker, two fedseq-client
daemons reading their folders) in a fresh interpreter, and prints the coordinator process's
peak RSS (the daemons are processes of their own, not counted) beside the rows the devices hold.

    python bench/placed_memory.py [--rows 500] [--scale 40]

It prints one line per size and the ratio of the coordinator's peak RSS at the larger size to
that at the smaller; the goal is about 1.0 (the coordinator holds data.validation alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CLIENTS = {"local01": ["."], "local02": ["north", "south"]}

RUN = """
import json, resource, sys
from pathlib import Path
from fedseq.common.config import load_config
from fedseq.server.ops.deployment import run_deployment
root = Path(sys.argv[1])
cfg = load_config(None, ['data.placement="device"', 'data.dataset="npz"',
                         "data.options.shape=[1,28,28]", "data.options.classes=10",
                         f"data.devices_root={str(root / 'devices')!r}",
                         f"data.validation={str(root / 'validation.npz')!r}",
                         "algorithm.name=fedavg", "rounds=1", "train.join_ratio=1.0",
                         "train.local_epochs=1", "train.batch_size=64", "deploy.port=0"])
res = run_deployment(cfg, root / "run", local_devices=2, client_threads=1,
                     announce=lambda m: None)
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "reported": res.rows[0]["reported"]}))
"""


def write_devices(root: Path, rows: int) -> float:
    """Each client's train (rows) and test (rows // 4) parts; the MB the devices hold."""
    rng = np.random.default_rng(0)
    total = 0
    for device, folders in CLIENTS.items():
        for name in folders:
            folder = root / "devices" / device / ("" if name == "." else name)
            folder.mkdir(parents=True, exist_ok=True)
            for part, n in (("train", rows), ("test", rows // 4)):
                x = rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8)
                np.savez(folder / f"{part}.npz", x=x, y=rng.integers(0, 10, n))
                total += x.nbytes
    val = rng.integers(0, 256, (300, 1, 28, 28), dtype=np.uint8)
    np.savez(root / "validation.npz", x=val, y=rng.integers(0, 10, 300))
    return total / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=500, help="training rows per client, smaller size")
    ap.add_argument("--scale", type=int, default=40, help="the larger size: rows x scale")
    args = ap.parse_args()
    peaks = []
    for rows in (args.rows, args.rows * args.scale):
        with tempfile.TemporaryDirectory(prefix="fedseq-placed-") as tmp:
            root = Path(tmp)
            held = write_devices(root, rows)
            out = subprocess.run([sys.executable, "-c", RUN, str(root)], capture_output=True,
                                 text=True, timeout=900)
            if out.returncode != 0:
                sys.exit(f"the deployment failed:\n{out.stderr[-3000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            assert got["reported"] == [0, 1, 2], got
            peaks.append(got["peak_rss_mb"])
            print(f"{rows:>6} training rows per client, {held:6.1f} MB on the devices: "
                  f"coordinator peak RSS {got['peak_rss_mb']:.1f} MB")
    print(f"coordinator peak RSS, {args.scale}x the devices' data against 1x: "
          f"{peaks[1] / peaks[0]:.3f}x; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
