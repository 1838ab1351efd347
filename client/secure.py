"""A device's side of a secure round ([secagg], common/secagg.py) over MQTT.

A train step that carries a setup (Step.secagg) starts one `SecureRound` for the device's clients
in it: the network thread answers each stage the coordinator relays (keys, then shares, then
unmasking) at once, and the worker masks each client's update once the shares addressed to that
client are here. Fresh keys and seeds for every step: a step sent again after a coordinator's
restart is a new round with new keys.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from fedseq.common.models import Weights, block_of
from fedseq.common.secagg import (
    MASKED,
    Checks,
    Layout,
    SecAggClient,
    SecAggError,
    Setup,
    answer_to_wire,
    client_vector,
    keys_from_wire,
    keys_to_wire,
    relay_from_wire,
    setup_from_dict,
    shares_to_wire,
    to_signed,
)

log = logging.getLogger(__name__)

__all__ = ["MASKED", "SecureRound", "to_signed"]


class SecureRound:
    """The secure round of train step `seq` for this device's clients `mine` (those in the
    setup's graph). Each method takes one stage's items and returns this device's answer to it
    (client -> its part); a client whose stage fails stops (logged), and the coordinator counts
    it as dropped."""

    def __init__(self, seq: int, raw_setup: object, mine: List[int]):
        self.seq = seq
        setup, layout, unweighted = setup_from_dict(raw_setup)
        self.setup: Setup = setup
        self.layout: Layout = layout
        self.unweighted = unweighted
        self.parties = {c: SecAggClient(c, setup) for c in mine if c in setup.graph}
        self.routed: Dict[int, Dict[int, bytes]] = {}  # client -> sender -> its encrypted share
        self.checks: Dict[int, Checks] = {}  # client -> sender -> its checks of that share
        self.stopped: Dict[int, str] = {}

    def _stop(self, c: int, why: object) -> None:
        self.stopped[c] = str(why)
        log.warning("secure round %d: client %d stops: %s", self.setup.round, c, why)

    def keys(self) -> Dict[int, Any]:
        """Stage 1: each client's two public keys."""
        return {c: keys_to_wire(p.advertise()) for c, p in self.parties.items()}

    def share(self, items: Mapping[int, object]) -> Dict[int, Any]:
        """Stage 2: the neighbours' keys in; each client's encrypted shares, commitment and (a
        checked setup) the shares' checks out."""
        out: Dict[int, Any] = {}
        for c, entry in sorted(items.items()):
            p = self.parties.get(c)
            if p is None or c in self.stopped or p.keys:
                continue  # not ours, stopped, or answered already (a duplicate relay)
            try:
                if not isinstance(entry, dict):
                    raise SecAggError("neighbours' keys: expected {neighbour: keys}")
                blobs, commitment, checks = p.share_keys({int(v): keys_from_wire(k)
                                                          for v, k in entry.items()})
            except (SecAggError, ValueError) as exc:
                self._stop(c, exc)
                continue
            out[c] = shares_to_wire(blobs, commitment, checks)
        return out

    def take_shares(self, items: Mapping[int, object]) -> None:
        """Stage 3's input: the shares addressed to each client, with their owners' checks
        (kept until it is masked)."""
        for c, entry in items.items():
            if c not in self.parties or c in self.stopped or c in self.routed:
                continue
            try:
                self.routed[c], self.checks[c] = relay_from_wire(entry)
            except SecAggError as exc:
                self._stop(c, exc)

    def ready(self, c: int) -> bool:
        """Whether client c can be masked now (its shares came) or never will be (it stopped)."""
        return c in self.routed or c in self.stopped or c not in self.parties

    def masked(self, c: int, deltas: Weights, weights: Mapping[str, float]) -> Optional[np.ndarray]:
        """Stage 3: client c's update (its deltas, `weights` per block) masked; None where c
        stopped (it drops out of the round)."""
        p = self.parties.get(c)
        if p is None or c in self.stopped or c not in self.routed:
            return None
        per_tensor = {k: 1.0 if self.unweighted else float(weights[block_of(k)]) for k in deltas}
        s = self.setup
        bound = s.weight_bound
        if max(per_tensor.values(), default=0.0) > bound:
            self._stop(c, f"its weight exceeds the round's bound {bound:.6g}")
            return None
        try:
            # DP's updates (each weighs 1) truncated: encoding keeps them within C
            x, clamped = client_vector(deltas, per_tensor, self.layout, s,
                                       toward_zero=self.unweighted)
            if clamped:
                log.warning("secure round %d: client %d clamped %d coordinates to +-%g before "
                            "masking; raise secagg.clip_range above its updates' largest value",
                            s.round, c, clamped, s.clip_range)
            return p.masked_input(x, self.routed[c], self.checks.get(c))
        except (SecAggError, KeyError) as exc:
            self._stop(c, exc)
            return None

    def unmask(self, items: Mapping[int, object]) -> Dict[int, Any]:
        """Stage 4: per client, who survived and who dropped in; its shares for them out."""
        out: Dict[int, Any] = {}
        for c, entry in sorted(items.items()):
            p = self.parties.get(c)
            if p is None or c in self.stopped:
                continue
            try:
                if not isinstance(entry, list) or len(entry) != 2:
                    raise SecAggError("unmask: expected [survivors, dropped]")
                alive, gone = ([int(v) for v in entry[0]], [int(v) for v in entry[1]])
                out[c] = answer_to_wire(p.unmask(alive, gone))
            except (SecAggError, TypeError, ValueError) as exc:
                self._stop(c, exc)
        return out
