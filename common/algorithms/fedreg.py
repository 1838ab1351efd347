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
client (Algorithm 3 is an input of Algorithm 1). `algorithm.fedreg.passes = "one"` runs Algorithm
1 literally (one pass each); `algorithm.fedreg.rebalance = "every-round"` re-draws the set and its
augmentations every round (what fedseq did before 0.2).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import numpy as np
from pydantic import Field

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.plan import ClientPlan, Objective, Phase
from fedseq.common.config import AlgorithmParams
from fedseq.common.errors import FedseqError, ProtocolError
from fedseq.common.models import block_of


def threshold_of(train_sizes: list[int], kind: str) -> float:
    """The rebalancing threshold C of the clients' training-set sizes: mean, median or max."""
    sizes = np.asarray(train_sizes, dtype=np.float64)
    if kind == "median":
        return float(np.median(sizes))
    return float(sizes.max() if kind == "max" else sizes.mean())


class RegParams(AlgorithmParams):
    """[algorithm.fedreg]"""

    threshold: Literal["mean", "median", "max"] = Field("mean", description=(
        "The client size a client's rebalanced set is filled up to."))
    passes: Literal["epochs", "one"] = Field("epochs", description=(
        "Passes over the original and over the rebalanced set per round: `epochs` "
        "(train.local_epochs each, section 4.1) or `one` (one each, Algorithm 1 as written)."))
    rebalance: Literal["once", "every-round"] = Field("once", description=(
        "Build a client's rebalanced set with its augmented images once (Algorithm 3, an input "
        "of Algorithm 1) or again with fresh augmentations every round."))


class FedReG(Algorithm):
    """FedReG (see the module docstring): two heads and a rebalanced local set."""

    name = "fedreg"
    params_model = RegParams
    two_heads = True
    threshold: float | None = None  # C, from the partition's sizes (prepare)

    @property
    def params(self) -> RegParams:
        """[algorithm.fedreg]"""
        return self.cfg.algorithm.table(self.name, RegParams)

    def personal_blocks(self) -> tuple[str, ...]:
        assert self.spec.personal_head is not None
        return (self.spec.personal_head,)

    def eval_heads(self) -> tuple[str, ...]:
        return self.spec.heads

    def prepare(self, train_sizes: list[int]) -> None:
        """C: the mean (or median, max) of the clients' training-set sizes."""
        self.threshold = threshold_of(train_sizes, self.params.threshold)

    def phases(self, round: int) -> tuple[Phase, ...]:
        s = self.spec
        e = self.cfg.train.local_epochs if self.params.passes == "epochs" else 1
        local = Objective(s.heads, s.base + self.personal_blocks())
        balanced = Objective((s.head,), s.base + (s.head,))
        return (Phase(e, (local,)), Phase(e, (balanced,), data="rebalanced"))

    def plan(self, round: int) -> ClientPlan:
        if self.threshold is None:
            raise FedseqError("FedReG plans need prepare(train_sizes) first (the round loop calls it)")
        once = self.params.rebalance == "once"
        return replace(super().plan(round), rebalance_threshold=self.threshold, rebalance_once=once)

    def aggregation_weights(self, update: ClientUpdate) -> dict[str, float]:
        if update.effective_samples is None:
            raise ProtocolError(f"client {update.client}: FedReG update without effective_samples")
        return {
            block_of(k): float(
                update.effective_samples if block_of(k) == self.spec.head else update.num_samples
            )
            for k in update.deltas
        }
