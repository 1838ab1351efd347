"""[secagg] in a round: the aggregate the coordinator can unmask only as a sum (common/secagg.py).

`SecureSum` is a round's aggregation rule under [secagg]. Where the clients train in this
process (fedseq-sim, `--workers`), it plays their side of the protocol too: each client's key
stages before any update is folded, its masked input as its update arrives, its unmasking shares
at the end; a client whose update never counted (it failed, or the round contract refused it)
dropped after sharing its keys, and its masks are recovered from its neighbours' shares. What
the coordinator's side holds is only the masked inputs' sum; the unmasked sum goes to the rule it
wraps (the weighted mean, or DP-FedAvg's noised sum), so every algorithm's server step reads it
as it would read a plain round's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.algorithms.robust import Aggregator
from fedseq.common.config import ExperimentConfig
from fedseq.common.errors import AggregationError
from fedseq.common.models import Weights, block_of
from fedseq.common.secagg import (
    CIPHER_BYTES,
    KEY_BYTES,
    MASKED,
    SHARE_BYTES,
    Layout,
    SecAggClient,
    SecAggError,
    SecAggServer,
    Setup,
    client_vector,
    degree_for,
    from_signed,
    neighbours,
    ring_bits_for,
    scale_for,
    split_sum,
    threshold_for,
    vector_length,
)
from fedseq.common.seeding import derive_seed
from fedseq.server.privacy.dp import NoisedSum

log = logging.getLogger(__name__)


def round_setup(cfg: ExperimentConfig, t: int, clients: list[int], layout: Layout,
                max_weight: float) -> Setup:
    """Round t's [secagg] setup for `clients`: its graph (seeded by the selection's seed and t),
    threshold, vector length, ring (wire.up) and fixed-point scale."""
    s = cfg.secagg
    k = degree_for(len(clients), s.neighbours)
    graph = neighbours(clients, k, derive_seed(cfg.seed_for("selection"), "secagg-graph", t))
    bits = ring_bits_for(cfg.wire.up)
    # a client-level DP update is clipped to L2 norm C: no coordinate of it exceeds C
    b = min(s.clip_range, cfg.privacy.clip_norm) if cfg.privacy.client_level else s.clip_range
    return Setup(round=t, graph=graph, threshold=threshold_for(k, s.threshold),
                 length=vector_length(layout),
                 scale=scale_for(len(clients), max_weight, b, bits),
                 clip_range=b, ring_bits=bits, checked=True, opens=True,
                 paired=True)


def layout_of(reference: Weights) -> Layout:
    """The tensors a masked input carries, in the reference's order: every tensor of the
    round's upload (what the round contract expects)."""
    return [(k, v.numel()) for k, v in reference.items()]


class SecureSum(Aggregator):
    """A secure round's aggregate (module docstring): `inner`, the rule the unmasked sum feeds
    (its `sums`, `weights` and `clients` are set from it). `local`: the clients' side is played
    here (a simulation); else the clients are devices, whose stages the MQTT pool relays
    (server/pools/mqtt/secure_relay.py): their updates arrive masked, and `ask_unmask` (set by the pool)
    asks them for stage 4's shares."""

    def __init__(self, inner: WeightedDeltaSum, setup: Setup, layout: Layout,
                 local: bool = True):
        self.inner, self.setup, self.layout, self.local = inner, setup, layout, local
        self.unweighted = isinstance(inner, NoisedSum)
        self.server = SecAggServer(setup)
        self.recovered: list[int] = []
        self.wire = {c: 0 for c in setup.clients}  # each client's bytes up
        self.clients: dict[int, SecAggClient] = {}
        self.ask_unmask: Callable[[dict[int, tuple[list[int], list[int]]]], dict[int, Any]] = \
            lambda requests: {}
        self.routed: dict[int, dict[int, bytes]] = {}
        if local:
            self._key_stages()

    def _key_stages(self) -> None:
        """Stages 1 and 2 with every client, in this process."""
        setup = self.setup
        self.clients = {c: SecAggClient(c, setup) for c in setup.clients}
        advertised = {c: x.advertise() for c, x in self.clients.items()}
        for c, (channel, _) in advertised.items():  # (a channel key a neighbour when paired)
            self.wire[c] += (1 + (len(channel) if isinstance(channel, dict) else 1)) * KEY_BYTES
        keys = self.server.advertised(advertised)
        sent = {}
        for c, theirs in keys.items():
            try:
                sent[c] = self.clients[c].share_keys(theirs)
            except SecAggError as exc:
                log.warning("secure round %d: client %d stops: %s", setup.round, c, exc)
                continue
            self.wire[c] += len(sent[c][0]) * (CIPHER_BYTES + (64 if sent[c][2] else 0)) + 32
        self.routed = self.server.shared(sent)

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int,
            device: str | None = None) -> None:
        """Client `client`'s masked input, made from its update as its device would, joins the
        sum (the coordinator's side sees only the masked vector). From a device, `deltas` is
        that masked input (MASKED, checked by the round contract)."""
        if not self.local:
            y = from_signed(deltas[MASKED].numpy(), self.setup)  # the contract checked its type
            self.server.add_masked(client, y)
            self.wire[client] = self.wire.get(client, 0) + y.nbytes
            return
        # DP-FedAvg's noised sum weighs every update 1 (NoisedSum.add)
        per_tensor = {k: 1.0 if self.unweighted else weight_of[block_of(k)] for k in deltas}
        bound = self.setup.weight_bound
        if max(per_tensor.values(), default=0.0) > bound:
            raise AggregationError(f"client {client}'s weight exceeds the round's bound "
                                   f"{bound:.6g}: the secure sum could wrap")
        x, clamped = client_vector(deltas, per_tensor, self.layout, self.setup,
                                   toward_zero=self.unweighted)
        if clamped:  # what the device would log: its own update, not the coordinator's view
            log.warning("secure round %d: client %d clamped %d coordinates to +-%g before "
                        "masking; raise secagg.clip_range above its updates' largest value",
                        self.setup.round, client, clamped, self.setup.clip_range)
        try:
            y = self.clients[client].masked_input(x, self.routed.get(client, {}),
                                                  self.server.checks_for(client))
        except SecAggError as exc:
            log.warning("secure round %d: client %d stops: %s", self.setup.round, client, exc)
            return
        self.server.add_masked(client, y)
        self.wire[client] += y.nbytes

    def count(self) -> int:
        return len(self.server.masked)

    def clients_added(self) -> list[int]:
        return list(self.server.masked)

    def apply(self, global_weights: Weights) -> Weights:
        """Unmask the sum (`unmask`) and step `global_weights` with the inner rule."""
        return self.unmask(global_weights).apply(global_weights)

    def unmask(self, global_weights: Weights) -> WeightedDeltaSum:
        """Unmask the sum (stage 4 with every client whose masked input counted), decode it and
        hand it to the inner rule, which it returns (an edge site's partial is made of it:
        server/rounds/sites.py). AggregationError where it cannot be unmasked (too few shares:
        the round fails, its sum unknown) or decodes outside what clamped updates can sum to."""
        requests = self.server.unmask_requests()
        shares: dict[int, Any] = {} if self.local else self.ask_unmask(requests)
        if self.local:
            for c, (alive, gone) in requests.items():
                answer = self.clients[c].unmask(alive, gone)
                if answer is not None:  # None: the device went silent
                    shares[c] = answer
                    self.wire[c] += len(answer) * (SHARE_BYTES + 5)
        try:
            total = self.server.unmasked(shares)
        except SecAggError as exc:
            raise AggregationError(f"secure aggregation: {exc}") from None
        self.recovered = sorted(set(self.server.commitments) - set(self.server.masked))
        sums, weights = split_sum(total, self.layout, self.setup.scale, self.setup.clip_range)
        self._check_sum(sums, weights)
        inner = self.inner
        inner.clients = list(self.server.masked)
        for k, s in sums.items():
            if weights[k] > 0:
                inner.sums[k] = torch.from_numpy(s.reshape(global_weights[k].shape).copy())
                inner.weights[k] = weights[k]
        return inner

    def _check_sum(self, sums: dict[str, np.ndarray], weights: dict[str, float]) -> None:
        """AggregationError where the unmasked sum is not what the masked clients' clamped (under
        DP: clipped, weight 1) updates can sum to, so a junk masked input fails the round
        instead of moving the model: a tensor's coordinates beyond its weight times B; a weight
        below zero, or zero under a non-zero sum, or (every tensor at zero) no weight at all;
        under DP, a tensor's weight that is not a whole count of the masked clients, or a sum
        whose L2 norm exceeds masked clients x C (the contract cannot check a masked update's
        clipping: this checks what the clipped updates can add up to)."""
        n = len(self.server.masked)
        quantum = n / self.setup.scale  # the encoding's error on a sum of n values, at most
        wq = quantum / self.setup.clip_range  # that of a sum of weights (encoded times B)
        junk = "secure aggregation: the unmasked sum {} (a masked input was junk)"
        for k, s in sums.items():
            w, top = weights[k], float(np.abs(s).max(initial=0.0))
            if w < -wq or (abs(w) <= wq and top > quantum):
                raise AggregationError(junk.format(f"of {k} has weight {w:.6g}, not that of "
                                                   "the clients that sent it"))
            # a mean of values clamped to [-B, B]: outside it, some masked input was junk
            if top > max(w, 0.0) * self.setup.clip_range * (1 + 1e-6) + quantum + 1e-6:
                raise AggregationError(junk.format(f"of {k} lies outside what clamped updates "
                                                   "can sum to"))
            if self.unweighted and (w > n + wq or abs(w - round(w)) > wq):
                raise AggregationError(junk.format(f"of {k} has weight {w:.6g}: under DP each of "
                                                   f"the {n} masked clients weighs 1 or 0"))
        if n and all(w <= wq for w in weights.values()):
            raise AggregationError(junk.format("has no weight: no masked client's update counts"))
        if isinstance(self.inner, NoisedSum):  # (self.unweighted)
            clip = self.inner.clip
            norm = math.sqrt(sum(float(np.dot(s, s)) for s in sums.values()))
            slack = quantum * math.sqrt(sum(s.size for s in sums.values()))
            if norm > n * clip * (1 + 1e-6) + slack:
                raise AggregationError(junk.format(
                    f"has an L2 norm of {norm:.6g}, more than its {n} masked clients' updates "
                    f"clipped to C = {clip:g} can sum to ({n * clip:.6g})"))

    def moved(self) -> set[str]:
        return self.inner.moved()

    def bytes_up(self) -> int:
        """What the round's clients sent in its four stages (payloads)."""
        return sum(self.wire.values())
