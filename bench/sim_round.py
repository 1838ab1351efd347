"""Seconds per round of the in-process simulation on the FedReG testbed config.

Prints, per round, the wall time split into training (the selected clients) and evaluation
(global model + all clients' personalized models), the training's rate in GFLOP/s (FLOPs as the
coordinator counts them, common/flops.py) against this machine's 2048x2048 float32 matmul rate at
the same thread count, then the mean and its ratio to the PFLlib references on this machine kind
(issue 10: about 35 s per testbed round with the FedSeq paper's CNN, `--model cnn`; an earlier
measurement: about 50 s, 32 s training and 19 s evaluating). Issue 10's targets: training at
>= 70% of the matmul rate, >= 3x PFLlib.

    python bench/sim_round.py [--rounds 5] [--algorithm fedavg] [--data-root ../shared/data]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fedseq.common.config import load_config
from fedseq.server.pools.inprocess import InProcessPool
from fedseq.server.rounds.coordinator import Coordinator
from fedseq.server.rounds.experiment import load_experiment
from fedseq.server.rounds.pool_api import TrainRound

PFLLIB_SECONDS_PER_ROUND = 35.0  # issue 10's measurement on this machine kind
ROOT = Path(__file__).resolve().parent.parent


class TimedPool(InProcessPool):
    train_s = 0.0
    eval_s = 0.0
    steps = 0

    def train(self, round, clients, plan, weights, check, enough=None):
        inner = super().train(round, clients, plan, weights, check, enough)

        def timed():
            t = time.perf_counter()
            for u in inner:
                self.train_s += time.perf_counter() - t
                yield u
                t = time.perf_counter()
            return inner.outcome

        return TrainRound(timed())

    def evaluate(self, weights, eval_heads, check):
        t = time.perf_counter()
        rep = super().evaluate(weights, eval_heads, check)
        self.eval_s += time.perf_counter() - t
        return rep


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """The machine's float32 matmul rate at torch's current thread count (best of `repeats`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--config", default=str(ROOT / "examples" / "fmnist-testbed.toml"))
    ap.add_argument("--model", default=None,
                    help="override model.name: cnn is the model issue 10's PFLlib reference ran")
    args = ap.parse_args()
    over = [f"data.root={args.data_root!r}", f"rounds={args.rounds}",
            f"algorithm.name={args.algorithm}"]
    if args.model:
        over.append(f"model.name={args.model}")
    cfg = load_config(Path(args.config), over)
    exp = load_experiment(cfg)
    data, model, alg = exp.data, exp.model, exp.algorithm
    pool = TimedPool(data, model, alg.personal_blocks(), cfg.seed, cfg.train.eval_batch_size,
                     algorithm=alg.name)
    coord = Coordinator(cfg, alg, model, data, pool)
    print(f"{args.algorithm}, {cfg.model.name}, on {Path(args.config).name}: {cfg.data.num_clients} clients, "
          f"{cfg.clients_per_round()} per round, {cfg.train.local_epochs} local epochs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    peak = matmul_gflops()
    print(f"2048x2048 float32 matmul: {peak:.0f} GFLOP/s at {torch.get_num_threads()} threads")
    totals, rates = [], []
    for t in range(cfg.rounds):
        pool.train_s = pool.eval_s = 0.0
        start = time.perf_counter()
        row = coord.run_round(t)
        wall = time.perf_counter() - start
        totals.append(wall)
        samples = sum(len(data.clients[c].train) for c in row.clients) * cfg.train.local_epochs
        rate = row.train_flops / pool.train_s / 1e9
        rates.append(rate)
        print(f"round {t}: {wall:6.2f} s = train {pool.train_s:6.2f} s ({samples} samples, "
              f"{1000 * pool.train_s / samples * cfg.train.batch_size:.2f} ms/batch, "
              f"{row.train_flops / 1e9:,.0f} GFLOP at {rate:.0f} GFLOP/s = "
              f"{100 * rate / peak:.0f}% of the matmul rate) + "
              f"eval {pool.eval_s:5.2f} s + other {wall - pool.train_s - pool.eval_s:4.2f} s; "
              f"global {row.global_acc:.4f} personal {row.personal_acc:.4f}")
    mean = statistics.mean(totals)
    print(f"mean {mean:.2f} s/round over {len(totals)} rounds; training at "
          f"{statistics.mean(rates):.0f} GFLOP/s = {100 * statistics.mean(rates) / peak:.0f}% of the "
          f"matmul rate (target 70%); PFLlib reference {PFLLIB_SECONDS_PER_ROUND:.0f} s/round -> "
          f"{PFLLIB_SECONDS_PER_ROUND / mean:.2f}x (target 3x)")


if __name__ == "__main__":
    main()
