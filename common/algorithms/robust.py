"""Aggregation rules that bound what Byzantine devices can do to the global model.

Every rule takes validated named deltas with their per-block weights (sample counts the
coordinator knows, never a device's claim) and returns new global tensors, like WeightedDeltaSum,
which is the `mean` rule (exact weighted FedAvg, no bound at all).

An attacker holds a device login, not a client: it controls every client its device hosts (three
of thirty on the testbed) and learns from each step how many of them are selected. The robust
rules therefore vote once per device: a device's updates are first combined into their weighted
mean (its "vote", with the sum of their weights), then the rule runs over the votes. In
simulation every client is its own device. With n devices reporting, f of them Byzantine
(`aggregation.byzantine_devices`, default 1 for these rules):

- `clipped-mean`: each vote is scaled to an L2 norm of at most a bound (absolute `clip_norm`, or
  `clip_factor` x the median vote norm, which lies within the honest norms when n >= 2f+1), then
  the weighted mean is taken: the f devices move the model by at most (their weight / all the
  round's weight) x bound.
- `trimmed-mean` (k = max(ceil(trim_ratio x n), f) votes dropped per end of every coordinate) and
  `median`: coordinate-wise, unweighted (Yin et al., ICML 2018). Every coordinate stays within the
  range of the honest devices' votes when n >= 2f+1 (median) or n > 2k (trimmed mean).
- `krum` (Blanchard et al., NeurIPS 2017): the vote closest to its n - f - 2 nearest others is
  applied whole; it needs n >= 2f+3 devices.
- Quorum: a round counts only when at least 2f+1 devices reported (and deploy.min_updates
  updates): a round where only the attacker's device reported is refused, not applied.

They keep the round's updates in memory (per-device votes and coordinate-wise statistics need
them all); `mean` streams. Each rule is an entry point of the group fedseq.aggregators
(pyproject.toml), a callable (AggregationConfig) -> Aggregator, as a plugin's rule is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Protocol, Tuple

import torch
from pydantic import ValidationError

from fedseq.common.algorithms.aggregate import WeightedDeltaSum, in_dtype, update_norm
from fedseq.common.config import AggregationConfig
from fedseq.common.errors import AggregationError, ConfigError, validation_problem
from fedseq.common.models import Weights, block_of


class Aggregator(Protocol):
    """A streaming aggregation rule: add updates one by one (with the device that sent each;
    None: the client is its own device), then apply to the global weights."""

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int,
            device: str | None = None) -> None:
        """Fold in one valid update: its deltas, its weight per block (the algorithm's
        `aggregation_weights`), its client and the device that sent it."""
        ...

    def count(self) -> int:
        """How many updates were added (SCAFFOLD scales its control variate's step by it)."""
        ...

    def clients_added(self) -> list[int]:
        """The clients whose updates were added, in order (FedNova weighs its step by their
        local work)."""
        ...

    def apply(self, global_weights: Weights) -> Weights:
        """The new global tensors under the rule (every tensor of `global_weights`: those it
        did not move as they were). AggregationError (the round is refused) where the result
        would be non-finite or below quorum."""
        ...

    def moved(self) -> set[str]:
        """After `apply`: the tensors it changed (a server step's pseudo-gradients and the
        blocks that get a new version)."""
        ...


def _scaled(deltas: Weights, bound: float) -> Weights:
    norm = update_norm(deltas)
    if norm <= bound or norm == 0.0:
        return deltas
    return {k: d * (bound / norm) for k, d in deltas.items()}


Vote = Tuple[Weights, Dict[str, float]]  # one device's combined deltas, its weight per block


@dataclass
class DeviceVotes:
    """A round's updates grouped by the device that sent them; one vote per device."""

    byzantine: int = 1  # f: the quorum is 2f+1 devices
    groups: dict[str, list[Vote]] = field(default_factory=dict)
    clients: list[int] = field(default_factory=list)

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int,
            device: str | None) -> None:
        """Hold one client's update (top-k's sparse deltas made dense) in its device's group: the
        clients of one device make one vote."""
        dense = {k: d.to_dense() if d.is_sparse else d for k, d in deltas.items()}  # top-k's
        self.clients.append(client)
        self.groups.setdefault(device if device is not None else f"client {client}",
                               []).append((dense, weight_of))

    def count(self) -> int:
        """How many updates were added, over every device."""
        return sum(len(g) for g in self.groups.values())

    def votes(self, rule: str) -> list[Vote]:
        """One (deltas, weights) per device, in arrival order; AggregationError below quorum."""
        need = 2 * self.byzantine + 1
        if len(self.groups) < need:
            raise AggregationError(
                f"{len(self.groups)} devices reported; the {rule} rule with "
                f"aggregation.byzantine_devices={self.byzantine} needs at least {need}")
        return [_combined(ups) for ups in self.groups.values()]


def _combined(ups: list[Vote]) -> Vote:
    """A device's clients' updates as their weighted mean (unchanged for a single client)."""
    if len(ups) == 1:
        return ups[0]
    deltas: Weights = {}
    for k, first in ups[0][0].items():
        ws = [float(w[block_of(k)]) for _, w in ups]
        total = sum(ws)
        if total <= 0:  # no weight anywhere: the plain mean
            ws, total = [1.0] * len(ups), float(len(ups))
        acc = sum(d[k].to(torch.float64) * w for (d, _), w in zip(ups, ws))
        deltas[k] = (acc / total).to(first.dtype)
    weights: dict[str, float] = {}
    for _, w in ups:
        for b, v in w.items():
            weights[b] = weights.get(b, 0.0) + float(v)
    return deltas, weights


class _PerDeviceVotes:
    """What every rule over per-device votes shares: it holds the round's updates (`_held`)."""

    _held: DeviceVotes

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int,
            device: str | None = None) -> None:
        self._held.add(deltas, weight_of, client, device)

    def count(self) -> int:
        return self._held.count()

    def clients_added(self) -> list[int]:
        return list(self._held.clients)


@dataclass
class ClippedMean(_PerDeviceVotes):
    """Weighted mean of per-device votes clipped to `clip_norm`, or to `clip_factor` x the
    median vote norm."""

    clip_norm: float | None = None
    clip_factor: float = 2.0
    byzantine: int = 1
    _held: DeviceVotes = field(init=False)
    bound: float | None = None  # the bound used, known after apply()
    _clipped: WeightedDeltaSum = field(init=False, default_factory=WeightedDeltaSum)

    def __post_init__(self) -> None:
        self._held = DeviceVotes(self.byzantine)

    def apply(self, global_weights: Weights) -> Weights:
        """New global tensors: old + the weighted mean of the devices' votes, each clipped to the
        bound (clip_norm, else clip_factor x the median vote norm; `bound` then holds it)."""
        votes = self._held.votes("clipped-mean")
        self.bound = self.clip_norm
        if self.bound is None:
            norms = torch.tensor([update_norm(d) for d, _ in votes], dtype=torch.float64)
            self.bound = self.clip_factor * float(norms.median())
        out = self._clipped = WeightedDeltaSum()
        for i, (deltas, weight_of) in enumerate(votes):
            out.add(_scaled(deltas, self.bound), weight_of, i)
        return out.apply(global_weights)

    def moved(self) -> set[str]:
        """The tensors `apply` changed."""
        return self._clipped.moved()


@dataclass
class CoordinateWise(_PerDeviceVotes):
    """Coordinate-wise trimmed mean (trim_ratio > 0) or median (trim_ratio None) over the
    per-device votes, unweighted."""

    trim_ratio: float | None = None
    byzantine: int = 1
    _held: DeviceVotes = field(init=False)
    _moved: set = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._held = DeviceVotes(self.byzantine)

    def trimmed(self, n: int) -> int:
        """Votes dropped from each end of every coordinate (0 for the median rule)."""
        if self.trim_ratio is None:
            return 0
        return max(math.ceil(self.trim_ratio * n), self.byzantine)

    def apply(self, global_weights: Weights) -> Weights:
        """New global tensors: old + the coordinate-wise median or trimmed mean of the devices'
        votes."""
        votes = self._held.votes("median" if self.trim_ratio is None else "trimmed-mean")
        out = dict(global_weights)
        for k in votes[0][0]:
            stack = torch.stack([d[k].to(torch.float64) for d, _ in votes])
            n = len(votes)
            k_trim = self.trimmed(n)
            srt = stack.sort(dim=0).values
            if self.trim_ratio is None or n <= 2 * k_trim:
                # torch.median takes the lower middle value; average the two middle ones instead
                agg = (srt[(n - 1) // 2] + srt[n // 2]) / 2
            else:
                agg = srt[k_trim : n - k_trim].mean(dim=0)
            g = global_weights[k]
            out[k] = in_dtype(k, g.to(torch.float64) + agg, g.dtype)
        self._moved = set(votes[0][0])
        return out

    def moved(self) -> set[str]:
        """The tensors `apply` changed: those some vote holds."""
        return set(self._moved)


@dataclass
class Krum(_PerDeviceVotes):
    """Krum (Blanchard et al., NeurIPS 2017) over the per-device votes: the vote whose n - f - 2
    nearest other votes are closest to it (sum of squared L2 distances) is applied as it is;
    it needs n >= 2f + 3 devices. One vote's deltas move the model, so an attacker's vote is
    applied only where it lies among honest ones."""

    byzantine: int = 1
    _held: DeviceVotes = field(init=False)
    chosen: int | None = None  # the index (arrival order) of the vote applied, after apply()
    _moved: set = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._held = DeviceVotes(self.byzantine)

    def apply(self, global_weights: Weights) -> Weights:
        """New global tensors: old + the one vote whose n - f - 2 nearest other votes are closest
        to it (`chosen` then names it); fewer than 2f + 3 devices is an AggregationError."""
        votes = self._held.votes("krum")
        n, f = len(votes), self.byzantine
        if n < 2 * f + 3:
            raise AggregationError(f"{n} devices reported; the krum rule with "
                                   f"aggregation.byzantine_devices={f} needs at least {2 * f + 3}")
        flat = torch.stack([torch.cat([d[k].to(torch.float64).flatten() for k in votes[0][0]])
                            for d, _ in votes])
        dist = torch.cdist(flat, flat).pow(2)
        scores = [float(dist[i][torch.arange(n) != i].sort().values[: n - f - 2].sum())
                  for i in range(n)]
        self.chosen = min(range(n), key=lambda i: (scores[i], i))
        out = dict(global_weights)
        for k, d in votes[self.chosen][0].items():
            g = global_weights[k]
            out[k] = in_dtype(k, g.to(torch.float64) + d.to(torch.float64), g.dtype)
        self._moved = set(votes[self.chosen][0])
        return out

    def moved(self) -> set[str]:
        """The tensors `apply` changed: those the chosen votes hold."""
        return set(self._moved)


class Rule:
    """An aggregation rule as a run holds it: built once at the run's start from
    [aggregation] (its own options from [aggregation.options], validated by `options_model`),
    kept across rounds, and asked by `round()` for a fresh Aggregator each round, site round or
    asynchronous server step. A rule with state (server momentum, a running statistic) keeps it
    on itself, updates it in its aggregators' `apply` (after any check that refuses the round),
    and gives it to the checkpoint as tensors (`state`, `load_state`): a resumed run is then
    bitwise the uninterrupted one. A registered rule is a subclass of this, or a plain callable
    (AggregationConfig) -> Aggregator, which is a rule without options or state."""

    #: a pydantic model of [aggregation.options]; None: the rule takes no options
    options_model: Any = None

    def __init__(self, cfg: AggregationConfig, options: Any = None) -> None:
        self.cfg, self.options = cfg, options

    def round(self) -> Aggregator:
        """A fresh aggregator for one round."""
        raise NotImplementedError

    def state(self) -> Weights:
        """The rule's state as tensors, for the checkpoint (empty: it keeps none)."""
        return {}

    def load_state(self, state: Weights) -> None:
        """Continue from `state()`'s tensors (resume)."""


class _Stateless(Rule):
    """A registered callable (AggregationConfig) -> Aggregator: called afresh every round."""

    def __init__(self, cfg: AggregationConfig, factory: Callable[[AggregationConfig], Aggregator]):
        super().__init__(cfg)
        self.factory = factory

    def round(self) -> Aggregator:
        return self.factory(self.cfg)


def _is_rule_class(rule: Any) -> bool:
    """Whether a registered rule is a `Rule` subclass (else a plain callable)."""
    return isinstance(rule, type) and issubclass(rule, Rule)


def rule_options(cfg: AggregationConfig, rule: Any) -> Any:
    """[aggregation.options] as the registered `rule` reads them; ConfigError in one line."""
    model = rule.options_model if _is_rule_class(rule) else None
    if model is None:
        if cfg.options:
            raise ConfigError(f"aggregation.options {sorted(cfg.options)}: the rule {cfg.rule} "
                              "takes no options; remove [aggregation.options]")
        return None
    try:
        return model.model_validate(cfg.options)
    except ValidationError as exc:
        p = validation_problem(exc)
        raise ConfigError(f"aggregation.options{'.' + p.where if p.where else ''} (rule "
                          f"{cfg.rule}): {p.msg}{p.more}") from None


def build_rule(cfg: AggregationConfig) -> Rule:
    """The configured rule (aggregation.rule, from the registry), built once for a run."""
    from fedseq.common.registry import REGISTRY

    rule = REGISTRY.load("aggregators", cfg.rule)
    options = rule_options(cfg, rule)
    if _is_rule_class(rule):
        return rule(cfg, options)
    return _Stateless(cfg, rule)


# The built-in rules as entry points of the group fedseq.aggregators (common/registry.py): each a
# callable (AggregationConfig) -> Aggregator, a rule without options or state.
def mean(cfg: AggregationConfig) -> Aggregator:
    """Exact weighted FedAvg, streamed (the parity-tested default; no bound at all)."""
    return WeightedDeltaSum()


def clipped_mean(cfg: AggregationConfig) -> Aggregator:
    """Per-device votes clipped to a bound, then their weighted mean."""
    return ClippedMean(cfg.clip_norm, cfg.clip_factor, cfg.byzantine())


def trimmed_mean(cfg: AggregationConfig) -> Aggregator:
    """Coordinate-wise trimmed mean of the per-device votes."""
    return CoordinateWise(cfg.trim_ratio, cfg.byzantine())


def median(cfg: AggregationConfig) -> Aggregator:
    """Coordinate-wise median of the per-device votes."""
    return CoordinateWise(None, cfg.byzantine())


def krum(cfg: AggregationConfig) -> Aggregator:
    """The Krum-selected per-device vote."""
    return Krum(cfg.byzantine())


__all__ = ["Aggregator", "ClippedMean", "CoordinateWise", "DeviceVotes", "Krum", "Rule", "build_rule",
           "update_norm"]
