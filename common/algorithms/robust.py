"""Aggregation rules that bound what one Byzantine update can do to the global model.

Every rule takes validated named deltas with their per-block weights (sample counts) and returns
new global tensors, like WeightedDeltaSum, which is the `mean` rule (exact weighted FedAvg).

- `clipped-mean`: each update's delta is scaled to an L2 norm of at most a bound (absolute, or a
  multiple of the round's median update norm), then the weighted mean is taken. One update among
  clients of total weight W moves the model by at most (its weight / W) * bound.
- `trimmed-mean` and `median`: coordinate-wise, unweighted (Yin et al., ICML 2018). With k updates
  trimmed from each end, any k Byzantine updates leave every coordinate within the range of the
  honest ones. These keep every update of the round in memory (coordinate-wise statistics need
  them all); `mean` and an absolute `clipped-mean` stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.config import AggregationConfig
from fedseq.common.models import Weights


class Aggregator(Protocol):
    """A streaming aggregation rule: add updates one by one, then apply to the global weights."""

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int) -> None: ...

    def apply(self, global_weights: Weights) -> Weights: ...


def update_norm(deltas: Weights) -> float:
    """L2 norm of an update's whole delta (all its tensors as one vector)."""
    return math.sqrt(sum(float(d.double().pow(2).sum()) for d in deltas.values()))


def _scaled(deltas: Weights, bound: float) -> Weights:
    norm = update_norm(deltas)
    if norm <= bound or norm == 0.0:
        return deltas
    return {k: d * (bound / norm) for k, d in deltas.items()}


@dataclass
class ClippedMean:
    """Weighted mean of deltas clipped to `clip_norm`, or to `clip_factor` x the median norm."""

    clip_norm: float | None = None
    clip_factor: float = 2.0
    _sum: WeightedDeltaSum = field(default_factory=WeightedDeltaSum)
    _held: list[tuple[Weights, dict[str, float], int]] = field(default_factory=list)
    bound: float | None = None  # the bound used, known after apply()

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int) -> None:
        if self.clip_norm is not None:
            self._sum.add(_scaled(deltas, self.clip_norm), weight_of, client)
        else:
            self._held.append((deltas, weight_of, client))

    def apply(self, global_weights: Weights) -> Weights:
        if self.clip_norm is not None:
            self.bound = self.clip_norm
        elif self._held:
            norms = torch.tensor([update_norm(d) for d, _, _ in self._held], dtype=torch.float64)
            self.bound = self.clip_factor * float(norms.median())
            for deltas, weight_of, client in self._held:
                self._sum.add(_scaled(deltas, self.bound), weight_of, client)
        return self._sum.apply(global_weights)


@dataclass
class CoordinateWise:
    """Coordinate-wise trimmed mean (trim_ratio > 0) or median (trim_ratio None), unweighted."""

    trim_ratio: float | None = None
    _held: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int) -> None:
        for k, d in deltas.items():
            self._held.setdefault(k, []).append(d)

    def trimmed(self, n: int) -> int:
        """Updates dropped from each end of every coordinate (0 for the median rule)."""
        if self.trim_ratio is None:
            return 0
        return math.ceil(self.trim_ratio * n)

    def apply(self, global_weights: Weights) -> Weights:
        out = dict(global_weights)
        for k, ds in self._held.items():
            stack = torch.stack([d.to(torch.float64) for d in ds])
            k_trim = self.trimmed(len(ds))
            if self.trim_ratio is None or len(ds) <= 2 * k_trim:
                # torch.median takes the lower middle value; average the two middle ones instead
                srt = stack.sort(dim=0).values
                n = len(ds)
                agg = (srt[(n - 1) // 2] + srt[n // 2]) / 2
            else:
                agg = stack.sort(dim=0).values[k_trim : len(ds) - k_trim].mean(dim=0)
            g = global_weights[k]
            out[k] = (g.to(torch.float64) + agg).to(g.dtype)
        return out


def make_aggregator(cfg: AggregationConfig) -> Aggregator:
    """The configured rule; `mean` is exact weighted FedAvg (the parity-tested default)."""
    if cfg.rule == "clipped-mean":
        return ClippedMean(cfg.clip_norm, cfg.clip_factor)
    if cfg.rule == "trimmed-mean":
        return CoordinateWise(cfg.trim_ratio)
    if cfg.rule == "median":
        return CoordinateWise(None)
    return WeightedDeltaSum()


__all__ = ["Aggregator", "ClippedMean", "CoordinateWise", "make_aggregator", "update_norm"]
