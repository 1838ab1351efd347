"""Replay one client's fine-tuning of a finished run from its checkpoint, with the loss per epoch:
how the FedSeq-Anti seed 2 divergence of docs/results.md was examined.

    python bench/replay_finetune.py docs/results/testbed/runs/fedseq-anti/seed-2 29
    python bench/replay_finetune.py RUN 29 --set 'algorithm.finetune_blocks="head"'
    python bench/replay_finetune.py RUN 29 --set train.lr=0.005
    python bench/replay_finetune.py RUN 29 --clip-grad-norm 10

The run's `checkpoint.safetensors` (the federated model after its last round and the clients'
personal blocks) must be there: finished runs of the sweep keep it on disk, not in git (a run
carried mid-way has one in git history; resuming a copy of it gives the finished state).
Prints the client's score, where a NaN or Inf loss stopped training (current code) and, per
epoch, the mean and largest loss and the largest gradient norm with the block that had it
(reading the gradients changes nothing). `--clip-grad-norm` clips the gradient of every step
to that norm (a diagnostic: fedseq's training has no clipping). One thread, as the sweep's runs.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from fedseq.common import training
from fedseq.common.config import load_config
from fedseq.common.models import block_of
from fedseq.server.rounds.checkpoint import load_checkpoint
from fedseq.server.rounds.experiment import load_experiment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("client", type=int)
    ap.add_argument("--set", action="append", default=[], help="config override, as fedseq-sim's")
    ap.add_argument("--clip-grad-norm", type=float, default=None,
                    help="clip every step's gradient to this L2 norm (diagnostic)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.run / "config.toml", args.set)
    exp = load_experiment(cfg)
    ckpt = load_checkpoint(args.run)
    plan = exp.algorithm.finetune_plan()
    if plan is None:
        raise SystemExit(f"{cfg.algorithm.name} with these settings does not fine-tune")
    losses: list[float] = []
    grads: list[tuple[float, str]] = []  # per step: total gradient norm, the block with the most
    step = training.train_step

    def logged(model, obj, opt, *rest):  # train_plan looks train_step up at every batch
        if not getattr(opt, "_replay_wrapped", False):
            opt.step = _measured(opt.step, model, grads, args.clip_grad_norm)
            opt._replay_wrapped = True
        loss = step(model, obj, opt, *rest)
        losses.append(loss)
        return loss

    training.train_step = logged
    shard = exp.data.clients[args.client]
    start = {**ckpt.global_weights, **ckpt.pool.personal.get(args.client, {})}
    (correct, total), diverged = training.finetune_and_score(
        exp.model, start, plan, exp.data, shard, cfg.seed_for("training"), (exp.model.spec.head,))
    how = f"diverged at batch {diverged}" if diverged else "finite throughout"
    print(f"client {args.client} after round {ckpt.next_round - 1}: trainable {plan.trainable}, "
          f"{cfg.algorithm.finetune_epochs} epochs: {correct}/{total} = "
          f"{100 * correct / total:.2f}%; {how}")
    per_epoch = -(-len(shard.train) // plan.batch_size)
    for e in range(0, len(losses), per_epoch):
        chunk = losses[e : e + per_epoch]
        norm, block = max(grads[e : e + per_epoch])
        print(f"epoch {e // per_epoch}: mean loss {statistics.fmean(chunk):.4g}, "
              f"largest {max(chunk):.3g} ({len(chunk)} batches); largest gradient norm "
              f"{norm:.3g} ({block} the largest part)")


def _measured(step, model, grads, clip):
    """opt.step that first records the gradient's norm (and clips it, with `clip`)."""
    def measured(*a, **kw):
        parts: dict[str, float] = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                parts[block_of(name)] = parts.get(block_of(name), 0.0) + float(p.grad.pow(2).sum())
        total = sum(parts.values()) ** 0.5
        total = total if total == total else float("inf")  # NaN: the step that diverged
        grads.append((total, max(parts, key=parts.__getitem__) if parts else "-"))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                           clip)
        return step(*a, **kw)
    return measured


if __name__ == "__main__":
    main()
