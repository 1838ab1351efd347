"""Seconds per round of the in-process simulation on the FedReG testbed config.

Prints, per round, the wall time split into training (the selected clients) and evaluation
(global model + all clients' personalized models), then the mean and its ratio to the PFLlib
reference on this machine kind (about 50 s per round: 32 s training, 19 s evaluating).

    python bench/sim_round.py [--rounds 5] [--algorithm fedavg] [--data-root ../shared/data]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fedseq.common.algorithms import algorithm_class, make_algorithm
from fedseq.common.config import load_config
from fedseq.common.data.federated import load_federated
from fedseq.server.coordinator import Coordinator
from fedseq.server.pool import InProcessPool, make_model

PFLLIB_SECONDS_PER_ROUND = 50.0
ROOT = Path(__file__).resolve().parent.parent


class TimedPool(InProcessPool):
    train_s = 0.0
    eval_s = 0.0
    steps = 0

    def train(self, round, clients, plan, weights, check):
        t = time.perf_counter()
        for u in super().train(round, clients, plan, weights, check):
            self.train_s += time.perf_counter() - t
            yield u
            t = time.perf_counter()

    def evaluate(self, weights, eval_heads):
        t = time.perf_counter()
        rep = super().evaluate(weights, eval_heads)
        self.eval_s += time.perf_counter() - t
        return rep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--config", default=str(ROOT / "examples" / "fmnist-testbed.toml"))
    args = ap.parse_args()
    cfg = load_config(Path(args.config), [f"data.root={args.data_root!r}", f"rounds={args.rounds}",
                                          f"algorithm.name={args.algorithm}"])
    data = load_federated(cfg.data, cfg.seed)
    model = make_model(cfg.model.name, data, algorithm_class(cfg.algorithm.name).two_heads, cfg.seed)
    alg = make_algorithm(cfg, model.spec)
    pool = TimedPool(data, model, alg.personal_blocks(), cfg.seed, cfg.train.eval_batch_size)
    coord = Coordinator(cfg, alg, model, data, pool)
    print(f"{args.algorithm} on {Path(args.config).name}: {cfg.data.num_clients} clients, "
          f"{cfg.clients_per_round()} per round, {cfg.train.local_epochs} local epochs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    totals = []
    for t in range(cfg.rounds):
        pool.train_s = pool.eval_s = 0.0
        start = time.perf_counter()
        row = coord.run_round(t)
        wall = time.perf_counter() - start
        totals.append(wall)
        samples = sum(len(data.clients[c].train) for c in row["clients"]) * cfg.train.local_epochs
        print(f"round {t}: {wall:6.2f} s = train {pool.train_s:6.2f} s ({samples} samples, "
              f"{1000 * pool.train_s / samples * cfg.train.batch_size:.2f} ms/batch) + "
              f"eval {pool.eval_s:5.2f} s + other {wall - pool.train_s - pool.eval_s:4.2f} s; "
              f"global {row['global_acc']:.4f} personal {row['personal_acc']:.4f}")
    mean = statistics.mean(totals)
    print(f"mean {mean:.2f} s/round over {len(totals)} rounds; "
          f"PFLlib reference {PFLLIB_SECONDS_PER_ROUND:.0f} s/round -> "
          f"{PFLLIB_SECONDS_PER_ROUND / mean:.2f}x")


if __name__ == "__main__":
    main()
