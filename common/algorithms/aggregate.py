"""Aggregation: named deltas + weights -> new global blocks, as a streaming weighted sum."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from fedseq.common.errors import AggregationError
from fedseq.common.models import Weights, block_of, is_statistic


@dataclass(frozen=True)
class DeviceCost:
    """What one client-round cost on its device: measured there (client/executor.py), carried
    in its update's header, and read back as the coordinator accepted it (server/pools/mqtt/inbox.py);
    informational, never aggregated. Each figure is None where the device measured nothing or
    sent an implausible value."""

    energy_j: float | None = None
    energy_w: float | None = None  # mean watts over the client-round
    energy_rails: dict[str, float] | None = None  # joules per power rail
    energy_source: str | None = None  # the power sensor, or why there is none
    max_temp_c: float | None = None
    throttled: bool | None = None
    gpu_load: float | None = None  # 0-1, after the client-round
    mem_available_mb: int | None = None  # after the client-round


@dataclass
class ClientUpdate:
    """What a client returns: deltas of the shared blocks it trained, and its sample counts."""

    client: int
    round: int
    deltas: Weights
    num_samples: int
    effective_samples: int | None = None  # FedReG: original rows in the rebalanced set
    train_seconds: float = 0.0  # the client's local computation: training and its local score
    # (correct, total) of the client's model right after its local training, on its own test
    # rows: what FedReG's testbed scores as personalized accuracy (docs/results.md)
    local_score: tuple[int, int] | None = None
    # the device (broker login) it came from, as its topic says; None in simulation, where every
    # client is its own device. Robust rules vote once per device.
    device: str | None = None
    # what the client-round cost on its device (energy, health), as the coordinator accepted it;
    # informational, never aggregated; None in simulation or where the device measured nothing
    cost: DeviceCost | None = None
    # the batch (from 1) where the client's training hit a NaN or Inf loss and stopped; such an
    # update is refused (server/rounds/contract.py); None: training stayed finite
    diverged_at: int | None = None
    # [privacy] adaptive clipping: whether the update's norm was at most the clip norm before it
    # was clipped (its one bit for the clip norm's quantile); None: not clipped
    under_clip: bool | None = None
    # the frame bytes of the update as it came, in its wire codec (set by the round contract
    # when it decodes a compressed update; None: deltas are as they came)
    upload_bytes: int | None = None


@dataclass
class WeightedDeltaSum:
    """Running sum of weight * delta per tensor, and of the weights per tensor.

    Memory is one accumulator per tensor, whatever the number of clients. Each tensor is averaged
    over the clients that sent it, so a block trained by only some clients is still a proper mean.
    """

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    clients: list[int] = field(default_factory=list)

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int,
            device: str | None = None) -> None:
        """weight_of maps a block name to this client's weight for it (`device`: unused, the mean
        bounds nothing whoever sent it)."""
        for k, d in deltas.items():
            w = float(weight_of[block_of(k)])
            if k in self.sums:
                self.sums[k].add_(d, alpha=w)
            elif d.is_sparse:  # a top-k update (codecs.decode(sparse=True)): its entries only
                self.sums[k] = torch.zeros(d.shape, dtype=torch.float64).add_(d, alpha=w)
            else:
                self.sums[k] = d.to(torch.float64) * w
            self.weights[k] = self.weights.get(k, 0.0) + w
        self.clients.append(client)

    def add_partial(self, deltas: Weights, weights: dict[str, float], clients: list[int]) -> None:
        """Fold in another tier's partial aggregate (server/rounds/sites.py): per tensor its mean
        delta and the total weight behind it, for `clients` (whose updates it folded)."""
        for k, d in deltas.items():
            w = float(weights[k])
            if k in self.sums:
                self.sums[k].add_(d, alpha=w)
            else:
                self.sums[k] = d.to(torch.float64) * w
            self.weights[k] = self.weights.get(k, 0.0) + w
        self.clients.extend(clients)

    def count(self) -> int:
        """How many updates were added."""
        return len(self.clients)

    def clients_added(self) -> list[int]:
        """The clients whose updates were added, in order."""
        return list(self.clients)

    def apply(self, global_weights: Weights) -> Weights:
        """New global tensors: old + weighted mean delta; a tensor nobody sent (with a positive
        weight) is left as it was (`moved` names the others)."""
        out = dict(global_weights)
        for k, s in self.sums.items():
            # The round contract rejects a non-finite update before it is added; this is the
            # safety net, once per round instead of once per update: a NaN or Inf anywhere in a
            # sum refuses the whole round. One float64 total is NaN or Inf exactly when an
            # element is (sums of contract-bounded float32 deltas cannot overflow it), in one
            # pass without the boolean tensor isfinite() allocates.
            if not math.isfinite(float(s.sum())):
                raise AggregationError(f"the aggregate of {k} has NaN or Inf; the round is refused")
            if self.weights[k] > 0:
                g = global_weights[k]
                out[k] = in_dtype(k, g.to(torch.float64) + s / self.weights[k], g.dtype)
        return out

    def moved(self) -> set[str]:
        """The tensors `apply` changes: those some update sent with a positive weight."""
        return {k for k, w in self.weights.items() if w > 0}


@dataclass
class ServerStep:
    """What a server step returns (`Algorithm.server_update`): the new global tensors and the
    names of those it changed (the model's and the algorithm's broadcast tensors alike). The
    round loop gives the blocks of `changed`, and only those, a new version: a client holding
    an older one is sent it again."""

    weights: Weights
    changed: frozenset = frozenset()


def update_norm(deltas: Weights) -> float:
    """L2 norm of an update's whole delta (all its tensors as one vector)."""
    return math.sqrt(sum(_squares(d) for d in deltas.values()))


def _squares(d: torch.Tensor) -> float:
    """The sum of d's squares in float64: squared in place in d's one float64 copy (torch's
    pow(2) is x * x, so bitwise what `d.double().pow(2).sum()` gives, without a second buffer).
    A sparse d (a top-k update): its entries' squares, summed in another order than d's dense
    form's, so the last bits may differ from it."""
    x = (d.coalesce().values() if d.is_sparse else d).to(torch.float64, copy=True)
    return float(x.mul_(x).sum())


def pseudo_gradients(global_weights: Weights, new: Weights, moved: Iterable[str]
                     ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, the global tensor, new - global in float64) of every tensor the round's aggregate
    `new` moved (`moved`: the aggregation rule's `moved()`) that a server-side step treats as a
    gradient: floating point and not a running statistic (those take the aggregate as FedAvg
    does), in `new`'s order. The server optimizers, FedDyn, SCAFFOLD and FedNova step along
    these; the result goes back to the model's dtype with `in_dtype`."""
    moved = set(moved)
    for k, v in new.items():
        g = global_weights[k]
        if k not in moved or not g.is_floating_point() or is_statistic(k):
            continue
        yield k, g, v.to(torch.float64) - g.to(torch.float64)


def in_dtype(key: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`value` (an aggregate computed in float64) cast to the model's `dtype`, refused with an
    AggregationError where the cast leaves a NaN or Inf (a float64 sum can be finite and still
    overflow float32): every aggregation rule's last step, so no rule can make weights infinite."""
    out = value.to(dtype)
    # one float64 total is NaN or Inf exactly when an element is (a sum of finite float32
    # values cannot overflow float64), without the boolean tensor isfinite() allocates
    if out.is_floating_point() and out.numel() and not math.isfinite(
            float(out.sum(dtype=torch.float64))):
        raise AggregationError(f"the aggregate of {key} is NaN or Inf in {dtype} "
                               "(its values overflow the model's dtype); the round is refused")
    return out


def aggregate_weighted(
    global_weights: Weights, updates: Iterable[tuple[Weights, dict[str, float]]]
) -> Weights:
    """Pure helper: (deltas, per-block weights) pairs -> new global weights."""
    acc = WeightedDeltaSum()
    for i, (deltas, weight_of) in enumerate(updates):
        acc.add(deltas, weight_of, i)
    return acc.apply(global_weights)
