"""What model.norm does to a run, on real Fashion-MNIST: per algorithm and norm ("batch",
"running", "fedbn"), the global and the personalized accuracy after the last round (after the
fine-tuning for FedSeq), the bytes a client uploads in round 0 and the run's seconds. A smoke
comparison (one seed, a few rounds), not a paper table.

Settings: 5% of Fashion-MNIST over 5 clients (Dirichlet 0.5, seed 0), 3 a round, 1 local epoch,
batch 20, lr 0.01, one torch thread; FedSeq-Anti with unfreeze_rounds [0,1,1,2] and 1
fine-tuning epoch.

    python bench/norms.py [--data-root ../shared/data] [--model 4convnet] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from fedseq.common.config import load_config
from fedseq.server.ops.simulation import run_simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data-root", default="../shared/data")
    ap.add_argument("--model", default="4convnet")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "fedseq-anti"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'algorithm':<12} {'norm':<8} {'global':>7} {'personal':>8} {'up r0 B':>9} {'s':>6}")
    for alg in args.algorithms:
        for norm in ("batch", "running", "fedbn"):
            cfg = load_config(None, [
                f"data.root={args.data_root!r}", "data.dataset=fmnist", "data.fraction=0.05",
                "data.num_clients=5", "data.alpha=0.5", "data.min_samples=40",
                f"rounds={args.rounds}", "train.join_ratio=0.6", "train.local_epochs=1",
                "train.batch_size=20", "train.threads=1", "algorithm.finetune_epochs=1",
                "algorithm.unfreeze_rounds=[0,1,1,2]", f"algorithm.name={alg}",
                f"model.name={args.model}", f"model.norm={norm}"])
            start = time.perf_counter()
            run = run_simulation(cfg, out=None)
            last = run.rows[-1]
            print(f"{alg:<12} {norm:<8} {last['global_acc']:>7.4f} {last['personal_acc']:>8.4f} "
                  f"{run.rows[0]['bytes_up']:>9} {time.perf_counter() - start:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
