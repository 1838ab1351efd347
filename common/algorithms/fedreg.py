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

from typing import Any, Literal, Optional

import numpy as np
import torch
from pydantic import Field

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.hooks import ClientSide
from fedseq.common.algorithms.plan import Objective, Phase
from fedseq.common.config import AlgorithmParams
from fedseq.common.data.federated import ClientShard, FederatedData
from fedseq.common.data.rebalance import rebalance, rebalanced_size, simple_augment
from fedseq.common.errors import FedseqError, ProtocolError
from fedseq.common.models import block_of
from fedseq.common.seeding import torch_rng


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


#: the data source of FedReG's second phase (`Phase.data`)
REBALANCED = "rebalanced"


class RegSide(ClientSide):
    """FedReG's client: the rebalanced set its second phase trains on, from the plan's `params`
    (`threshold`: C; `rebalance`: "once" or "every-round")."""

    @property
    def threshold(self) -> float:
        """The rebalancing threshold C the coordinator put in the plan (params.threshold); a plan
        without it is a protocol error."""
        if self.params.get("threshold") is None:
            raise ProtocolError("a FedReG plan without its rebalancing threshold (params.threshold)")
        return float(self.params["threshold"])

    def phase_rows(self, phase: Phase, data: FederatedData, shard: ClientShard, seed: int,
                   round: int) -> Optional[Any]:
        from fedseq.common.training import PhaseRows

        if phase.data != REBALANCED:
            return None
        if self.params.get("rebalance", "once") == "once":
            rb, xs = fixed_rebalanced(data, shard, self.threshold, seed)
            return PhaseRows(torch.arange(len(xs)), xs.__getitem__, data.y[rb.indices],
                             effective=rb.effective)
        g = torch_rng(seed, "rebalance", round, shard.client)  # its augmentations draw on after it
        rb = rebalance(shard.train, data.y, self.threshold, g)
        return PhaseRows(rb.indices, data.images, data.y, rb.augment, rb.effective,
                         data.pixel_stats(), g)

    def phase_size(self, phase: Phase, counts: torch.Tensor) -> Optional[int]:
        return rebalanced_size(counts, self.threshold)[0] if phase.data == REBALANCED else None


def fixed_rebalanced(data: FederatedData, shard: ClientShard, threshold: float, seed: int
                     ) -> tuple[Any, torch.Tensor]:
    """FedReG's rebalanced set as Algorithm 3 builds it, once per client: the rows and their
    images, augmented ones generated once. A pure function of (seed, client): recomputing it
    each round (a few ms) is the same set, and a device needs no state for it."""
    g = torch_rng(seed, "rebalance-once", shard.client)
    rb = rebalance(shard.train, data.y, threshold, g)
    xs = data.images(rb.indices)
    if rb.augment.any():
        xs[rb.augment] = simple_augment(xs[rb.augment], g, data.pixel_stats())
    return rb, xs


class FedReG(Algorithm):
    """FedReG (see the module docstring): two heads and a rebalanced local set."""

    name = "fedreg"
    params_model = RegParams
    client_class = RegSide
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
        return (Phase(e, (local,)), Phase(e, (balanced,), data=REBALANCED))

    def client_params(self) -> dict[str, Any]:
        if self.threshold is None:
            raise FedseqError("FedReG plans need prepare(train_sizes) first (the round loop calls it)")
        return {"threshold": self.threshold, "rebalance": self.params.rebalance}

    def effective_samples(self, counts: torch.Tensor) -> int | None:
        """The original rows of the rebalanced set a client with these class counts builds
        (eq. 6): what its update's effective_samples must say."""
        assert self.threshold is not None
        return rebalanced_size(counts, self.threshold)[1]

    def aggregation_weights(self, update: ClientUpdate) -> dict[str, float]:
        if update.effective_samples is None:
            raise ProtocolError(f"client {update.client}: FedReG update without effective_samples")
        return {
            block_of(k): float(
                update.effective_samples if block_of(k) == self.spec.head else update.num_samples
            )
            for k in update.deltas
        }
