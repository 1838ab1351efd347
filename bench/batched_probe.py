"""Would training a round's clients together pay on this machine? One training step of K clients
(batch 20 each, FedReG's ConvNet) as one torch.func vmap over stacked per-client weights, against
K sequential steps, and both against the machine's float32 matmul rate. The bound: one plain step on
a batch of K x 20 rows through one model, the most any batching of clients could gain.

    python bench/batched_probe.py [--clients 6] [--threads 2]

(The vmapped forward pools in NCHW: channels-last copies are not supported inside vmap.)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import fedseq.common.models as models
from fedseq.common.models import build_model


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    k, b = args.clients, args.batch
    model = build_model("convnet", (1, 28, 28), 10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(k, b, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (k, b), generator=g)

    class Whole(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, xb):
            return self.m.logits(self.m.features(xb), (self.m.spec.head,))

    whole = Whole(model)
    stacked = {f"m.{n}": p.detach().unsqueeze(0).repeat(k, *[1] * p.dim())
               for n, p in model.named_parameters()}

    def loss(params, xb, yb):
        return F.cross_entropy(functional_call(whole, params, (xb,)), yb)

    per_client_grads = vmap(grad(loss))
    nchw = models._pool
    models._pool = lambda t: F.max_pool2d(t, 2)
    try:
        batched = timed(lambda: per_client_grads(stacked, x, y))
    finally:
        models._pool = nchw

    def sequential() -> None:
        for i in range(k):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(whole(x[i]), y[i]).backward()

    seq = timed(sequential)

    def one_big_batch() -> None:  # K x 20 rows through one model: what batching could at best do
        model.zero_grad(set_to_none=True)
        F.cross_entropy(whole(x.flatten(0, 1)), y.flatten()).backward()

    bound = timed(one_big_batch)
    a = torch.randn(2048, 2048)
    mm = timed(lambda: a @ a, reps=10)
    print(f"{k} clients x batch {b}, {args.threads} threads: one vmapped step {1000 * batched:.1f} ms, "
          f"{k} sequential steps {1000 * seq:.1f} ms -> batched/sequential speed {seq / batched:.2f}x; "
          f"bound (one plain batch of {k * b} rows, shared weights) {1000 * bound:.1f} ms -> "
          f"{seq / bound:.2f}x; "
          f"2048^2 float32 matmul {2 * 2048**3 / mm / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
