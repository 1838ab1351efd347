"""FedReG (paper sections 3.2-3.4): two heads and a rebalanced local dataset.

Phase 1 (original data): logits = global head + personal head; base and personal head train, the
global head is frozen (it still passes gradient to the base). Phase 2 (rebalanced data: every held
class brought to Q = C / #classes rows by subsampling or augmentation): base + global head train
on the global head's logits. Base and global head are uploaded; the server weights the base by the
original sample count d_k and the global head by the effective count (original rows in the
rebalanced set, eq. 6). C is the mean (or median / max) client training-set size.

Local procedure: by default `train.local_epochs` passes over each set (the paper's shared setting,
section 4.1: 5 local epochs for every algorithm), the original set's passes first, then the
rebalanced set's (Algorithm 1's two loops in that order), and the rebalanced set is built once per
client (Algorithm 3 is an input of Algorithm 1). `algorithm.fedreg_passes = "one"` runs Algorithm
1 literally (one pass each); `algorithm.fedreg_rebalance = "every-round"` re-draws the set and its
augmentations every round (what fedseq did before 0.2).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fedseq.common.algorithms.aggregate import ClientUpdate, block_of
from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.plan import ClientPlan, Objective, Phase


def threshold_of(train_sizes: list[int], kind: str) -> float:
    sizes = np.asarray(train_sizes, dtype=np.float64)
    if kind == "median":
        return float(np.median(sizes))
    return float(sizes.max() if kind == "max" else sizes.mean())


class FedReG(Algorithm):
    name = "fedreg"
    two_heads = True
    threshold: float | None = None  # set by the coordinator from the partition's sizes

    def personal_blocks(self) -> tuple[str, ...]:
        assert self.spec.personal_head is not None
        return (self.spec.personal_head,)

    def eval_heads(self) -> tuple[str, ...]:
        return self.spec.heads

    def set_train_sizes(self, sizes: list[int]) -> None:
        self.threshold = threshold_of(sizes, self.cfg.algorithm.rebalance_threshold)

    def phases(self, round: int) -> tuple[Phase, ...]:
        s = self.spec
        e = self.cfg.train.local_epochs if self.cfg.algorithm.fedreg_passes == "epochs" else 1
        local = Objective(s.heads, s.base + self.personal_blocks())
        balanced = Objective((s.head,), s.base + (s.head,))
        return (Phase(e, (local,)), Phase(e, (balanced,), data="rebalanced"))

    def plan(self, round: int) -> ClientPlan:
        if self.threshold is None:
            raise RuntimeError("FedReG needs set_train_sizes() before planning")
        once = self.cfg.algorithm.fedreg_rebalance == "once"
        return replace(super().plan(round), rebalance_threshold=self.threshold, rebalance_once=once)

    def aggregation_weights(self, update: ClientUpdate) -> dict[str, float]:
        if update.effective_samples is None:
            raise ValueError(f"client {update.client}: FedReG update without effective_samples")
        return {
            block_of(k): float(
                update.effective_samples if block_of(k) == self.spec.head else update.num_samples
            )
            for k in update.deltas
        }
