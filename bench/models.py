"""The model zoo on this machine: per model, its parameters, the bytes a whole-model update is on
the wire (a safetensors frame, float32), and seconds per local optimizer step (SGD, batch 20,
forward + backward + step, 1 torch thread unless --threads) on 1x28x28 (Fashion-MNIST) and
3x32x32 (CIFAR) input; the median of --steps steps after two warm-up steps.

    python bench/models.py [--steps 10] [--threads 1] [--models cnn convnet 4convnet ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from fedseq.common.models import build_model, get_blocks
from fedseq.common.protocol.tensors import frame_size
from fedseq.common.registry import REGISTRY
from fedseq.common.training import Sgd, set_trainable


def step_seconds(name: str, shape: tuple[int, int, int], classes: int, steps: int) -> float:
    model = build_model(name, shape, classes, generator_seed=0)
    opt = Sgd(set_trainable(model, model.spec.blocks), lr=0.01, momentum=0.9)
    x, y = torch.rand(20, *shape), torch.randint(0, classes, (20,))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model.logits(model.features(x), (model.spec.head,)), y).backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", nargs="*", default=[e.name for e in REGISTRY.entries("models") if e.builtin])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'model':10s} {'blocks':>6s} {'params (CIFAR-10)':>18s} {'update MB':>10s} "
          f"{'s/step 1x28x28':>15s} {'s/step 3x32x32':>15s}")
    for name in args.models:
        m = build_model(name, (3, 32, 32), 10)
        params = sum(p.numel() for p in m.parameters())
        mb = frame_size(get_blocks(m, m.spec.blocks)) / 1e6
        fm = step_seconds(name, (1, 28, 28), 10, args.steps)
        cf = step_seconds(name, (3, 32, 32), 10, args.steps)
        print(f"{name:10s} {len(m.spec.base):6d} {params:18,d} {mb:10.2f} {fm:15.4f} {cf:15.4f}",
              flush=True)


if __name__ == "__main__":
    main()
