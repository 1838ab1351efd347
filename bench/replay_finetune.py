"""Replay one client's fine-tuning of a finished run from its checkpoint, with the loss per epoch:
how the FedSeq-Anti seed 2 divergence of docs/results.md was examined.

    python bench/replay_finetune.py docs/results/testbed/runs/fedseq-anti/seed-2 29
    python bench/replay_finetune.py RUN 29 --set 'algorithm.finetune_blocks="head"'

The run's `checkpoint.safetensors` (the federated model after its last round and the clients'
personal blocks) must still be there: finished runs of the sweep keep it on disk, not in git.
Prints the client's score, where a NaN or Inf loss stopped training (current code) and, per
epoch, the mean and largest loss. One thread, as the sweep's runs.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from fedseq.common import training
from fedseq.common.config import load_config
from fedseq.server.checkpoint import load_checkpoint
from fedseq.server.experiment import load_experiment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("client", type=int)
    ap.add_argument("--set", action="append", default=[], help="config override, as fedseq-sim's")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.run / "config.toml", args.set)
    exp = load_experiment(cfg)
    ckpt = load_checkpoint(args.run)
    plan = exp.algorithm.finetune_plan()
    if plan is None:
        raise SystemExit(f"{cfg.algorithm.name} with these settings does not fine-tune")
    losses: list[float] = []
    step = training.train_step

    def logged(*a):  # train_plan looks train_step up in its module at every batch
        loss = step(*a)
        losses.append(loss)
        return loss

    training.train_step = logged
    shard = exp.data.clients[args.client]
    start = {**ckpt.global_weights, **ckpt.personal.get(args.client, {})}
    (correct, total), diverged = training.finetune_and_score(
        exp.model, start, plan, exp.data, shard, cfg.seed_for("training"), (exp.model.spec.head,))
    how = f"diverged at batch {diverged}" if diverged else "finite throughout"
    print(f"client {args.client} after round {ckpt.next_round - 1}: trainable {plan.trainable}, "
          f"{cfg.algorithm.finetune_epochs} epochs: {correct}/{total} = "
          f"{100 * correct / total:.2f}%; {how}")
    per_epoch = -(-len(shard.train) // plan.batch_size)
    for e in range(0, len(losses), per_epoch):
        chunk = losses[e : e + per_epoch]
        print(f"epoch {e // per_epoch}: mean loss {statistics.fmean(chunk):.4g}, "
              f"largest {max(chunk):.3g} ({len(chunk)} batches)")


if __name__ == "__main__":
    main()
