"""A secure round's stages over MQTT ([secagg]; common/secagg.py): the coordinator relays.

The train step carries the round's setup. Each device answers for its clients in the round:
stage 1 (their public keys) on fedseq/secagg/<device>; the coordinator sends each device its
clients' neighbours' keys on fedseq/device/<device>/secagg, and takes back (stage 2) their
encrypted shares, which it routes to their receivers the same way. The devices then train and
send masked inputs as their updates (collected as any round's); after the collection, stage 4
asks each device whose clients sent one for the shares that unmask the sum. A stage waits until
every device it asked answered, said it cannot run the step or went offline, or its deadline
passed; a client whose device did not answer, or answered junk, drops out of the round (the
reason is logged) and the protocol recovers the sum without it while enough shares remain.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fedseq.common.protocol.messages import SecAggMessage
from fedseq.common.secagg import (
    SecAggError,
    answer_from_wire,
    keys_from_wire,
    relay_to_wire,
    shares_from_wire,
    to_text,
)
from fedseq.server.pools.mqtt.broker_session import DeviceOffline, ServerSession, SessionEvent, StepFailed
from fedseq.server.pools.mqtt.inbox import SecAggArrived
from fedseq.server.privacy.secure_sum import SecureSum

log = logging.getLogger(__name__)


class SecureStages:
    """The stages of the secure round of train step `seq` (`secure`: the round's SecureSum,
    whose SecAggServer checks and routes every stage), for `clients` held by `owner`'s devices.
    Events that are not this round's stages (a device failing, an early update) are kept in
    `held` for the update collection."""

    def __init__(self, session: ServerSession, seq: int, secure: SecureSum,
                 owner: dict[int, str], stage_s: float):
        self.session, self.seq, self.secure, self.stage_s = session, seq, secure, stage_s
        self.owner = {c: owner[c] for c in secure.setup.clients if c in owner}
        self.held: list[SessionEvent] = []
        self.gone: set[str] = set()  # devices offline or failing the step

    def _devices(self, clients: Any) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for c in sorted(clients):
            if c in self.owner:
                out.setdefault(self.owner[c], []).append(c)
        return out

    def _exchange(self, stage: str, asked: dict[str, list[int]], down: dict[int, Any] | None,
                  timeout: float) -> dict[int, Any]:
        """Send each device of `asked` its clients' items of `down` (None: the step asked
        already), and collect their answers to `stage` until all came or `timeout`; client ->
        its answer (only the device's own clients of `asked`). The stage sent down is the one
        before: the neighbours' keys ask for shares, the unmasking requests for unmasking."""
        topics = self.session.topics
        if down is not None:
            sent = "keys" if stage == "shares" else stage
            for device, clients in sorted(asked.items()):
                msg = SecAggMessage(run_id=self.session.run_id, seq=self.seq, stage=sent,
                                    device=device, items={c: down[c] for c in clients if c in down})
                self.session.link.publish(topics.secagg_relay(device), msg)
        waiting = {d for d in asked if d not in self.gone and d in self.session.online}
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            for ev in self.session.drain(min(1.0, max(0.0, deadline - time.monotonic()))):
                if isinstance(ev, SecAggArrived):
                    m = ev.message
                    if m.stage != stage or ev.device not in waiting:
                        continue  # a duplicate, or a stage that is over
                    waiting.discard(ev.device)
                    theirs = set(asked[ev.device])
                    for c, item in m.items.items():
                        if c in theirs:
                            got[c] = item
                            self.secure.wire[c] = self.secure.wire.get(c, 0) + ev.size // max(
                                1, len(m.items))
                        else:
                            log.warning("secure round %d: %s answered %s for client %d, not one "
                                        "of its clients in the round: ignored",
                                        self.secure.setup.round, ev.device, stage, c)
                    continue
                if isinstance(ev, DeviceOffline) or (isinstance(ev, StepFailed)
                                                     and ev.seq in (self.seq, -1)):
                    self.gone.add(ev.device)
                    waiting.discard(ev.device)
                self.held.append(ev)
        if waiting:
            log.warning("secure round %d: no %s stage from %s within %.0f s",
                        self.secure.setup.round, stage, ", ".join(sorted(waiting)), timeout)
        return got

    def _parsed(self, stage: str, got: dict[int, Any], parse: Any) -> dict[int, Any]:
        out = {}
        for c, item in got.items():
            try:
                out[c] = parse(item)
            except SecAggError as exc:
                if stage == "unmask":  # its masked input still counts; its shares do not
                    self.secure.server.blamed.setdefault(c, f"unmask: {exc}")
                else:
                    self.secure.server.drop(c, f"{stage}: {exc}")
                log.warning("secure round %d: client %d's %s stage is junk: %s",
                            self.secure.setup.round, c, stage, exc)
        return out

    def share_keys(self, first_s: float) -> None:
        """Stages 1 and 2 and the shares' relay (stage 3's input); `first_s`: how long the
        devices may take to answer the step (they answer once its weights are in)."""
        server, setup = self.secure.server, self.secure.setup
        every = self._devices(setup.clients)
        keys = self._parsed("advertise", self._exchange("keys", every, None, first_s),
                            keys_from_wire)
        theirs = server.advertised(keys)
        down = {c: {str(v): [to_text(k) for k in pair] for v, pair in nbrs.items()}
                for c, nbrs in theirs.items()}
        sent = self._parsed("share keys", self._exchange(
            "shares", self._devices(theirs), down, self.stage_s), shares_from_wire)
        routed = server.shared(sent)
        relay = {c: relay_to_wire(blobs, server.checks_for(c)) for c, blobs in routed.items()}
        for device, clients in sorted(self._devices(routed).items()):
            self.session.link.publish(self.session.topics.secagg_relay(device), SecAggMessage(
                run_id=self.session.run_id, seq=self.seq, stage="shares", device=device,
                items={c: relay[c] for c in clients}))
        for c, why in sorted(server.dropped.items()):
            log.warning("secure round %d: client %d dropped out (%s)", setup.round, c, why)

    def sharing(self) -> set[int]:
        """The clients that shared their keys: the only ones whose masked input can count."""
        return set(self.secure.server.commitments) - set(self.secure.server.dropped)

    def unmask(self, requests: dict[int, tuple[list[int], list[int]]]) -> dict[int, Any]:
        """Stage 4: ask each device for its surviving clients' shares; client -> its answer."""
        down = {c: [alive, gone] for c, (alive, gone) in requests.items()}
        got = self._exchange("unmask", self._devices(requests), down, self.stage_s)
        return self._parsed("unmask", got, answer_from_wire)
