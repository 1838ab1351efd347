"""The imagefolder dataset's cost (issue: 10,000 28x28 PNGs decoded in at most 10 s on one core,
then read from the cache): writes N grayscale PNGs in 10 class folders, then times the first
load (every image decoded, the cache written) and a second (read from the cache), in one
process pinned to one core. Prints both, the images a second and the load average.

    python bench/imagefolder.py [--images 10000] [--size 28]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=28)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory(prefix="fedseq-imagefolder-") as tmp:
        root = Path(tmp)
        os.environ["FEDSEQ_CACHE"] = str(root / "cache")
        rng = np.random.default_rng(0)
        classes = [f"c{i}" for i in range(10)]
        for i in range(args.images):
            folder = root / "pics" / classes[i % 10]
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (args.size, args.size), dtype=np.uint8)
            Image.fromarray(pixels, "L").save(folder / f"{i:05d}.png")
        from fedseq.common.data.datasets import dataset

        opts = {"path": "pics", "classes": classes, "size": args.size, "channels": 1}
        t = time.perf_counter()
        first = dataset("imagefolder").load(root, opts)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        second = dataset("imagefolder").load(root, opts)
        warm = time.perf_counter() - t
        assert np.array_equal(first.images, second.images) and len(first.labels) == args.images
        print(f"{args.images} PNGs of {args.size}x{args.size} on one core: first load {cold:.2f} s "
              f"({args.images / cold:,.0f} images/s, decoded and cached), second {warm:.3f} s "
              f"(from the cache); load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
