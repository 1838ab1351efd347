"""train.mode = "async" on an MQTT fleet: the asynchronous driver (server/rounds/buffered.py
`BufferedAsync`) with the devices' own pace ordering the arrivals (docs/protocol.md, "An
asynchronous run"), over any pool.AsyncPool (the MQTT pool)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any, cast

from fedseq.common.errors import TransportError
from fedseq.common.text import printable
from fedseq.server.pools.mqtt.broker_session import DeviceOffline, StepFailed
from fedseq.server.pools.mqtt.inbox import UpdateArrived
from fedseq.server.rounds.buffered import Arrivals, BufferedAsync, Flight
from fedseq.server.rounds.ledger import RoundUpdates
from fedseq.server.rounds.pool_api import AsyncPool
from fedseq.server.rounds.records import RoundRecord

log = logging.getLogger(__name__)


class MqttArrivals(Arrivals):
    """The arrivals of a real fleet: the devices' own pace orders them.

    Every fill publishes an async step: the current model version and every client in flight
    with the step that dispatched it. A device trains its clients' dispatches one after another,
    each on the newest model it holds, and its update says which version that was (its round):
    the version it is checked against (that version's round contract, kept while an update may
    still come for it) and discounted by. A client is selected only while its device is online;
    a flight is dropped when its device goes offline or fails the step, or when no answer came
    within deploy.round_timeout_s (else round_timeout_max_s); its client may be selected again.
    A resumed run re-selects: the devices' answers to the crashed coordinator's dispatches come
    too late and are dropped (the pool's steps jump past them)."""

    def __init__(self, driver: BufferedAsync):
        self.driver, self.book = driver, driver.book
        self.pool = cast(AsyncPool, driver.book.pool)  # the run's transport offers it
        self.published = -1  # the model version the last async step carried
        self.events: list[Any] = []  # what the fleet sent, not handled yet
        self.lost: list[int] = []  # the step's clients whose flight was dropped
        self.late = 0  # updates of flights no longer in flight
        self.failing: dict[str, str] = {}  # device -> why it could not train, this step

    def can_train(self, client: int) -> bool:
        """Its device is online and has not said this step that it cannot train."""
        return self.pool.can_train(client, self.failing)

    def dispatch(self, t: int, client: int, seq: int) -> Flight:
        """Its time is the device's: the flight is published by the fill's step (`filled`)."""
        return Flight(seq, client, t, 0.0, 0.0, math.inf)

    def filled(self, t: int) -> None:
        """Publish the async step when a client was dispatched or the model moved on."""
        d = self.driver
        new = [f for f in d.flights if f.answers is None]
        if not new and self.published == t:
            return
        v = d.version(t)
        seq = self.pool.dispatch(t, {f.client: f.answers for f in d.flights}, v.plan, v.sent)
        now = time.monotonic()
        for f in new:
            f.answers, f.sent_at = seq, now
            d.bytes_down_step += self.book.client_bytes_down(f.client, v.plan, v.needed)
        self.published = t

    def _land(self, f: Flight, why: str | None = None) -> None:
        """`f` is no longer in flight (`why`: it was dropped, and why)."""
        self.driver.flights.remove(f)
        if why is not None:
            log.warning("client %d: dropped from flight (%s); it may be selected again", f.client,
                        why)
            self.lost.append(f.client)

    def _expire(self) -> None:
        cfg = self.book.cfg
        limit = cfg.deploy.round_timeout_s or cfg.deploy.round_timeout_max_s
        now = time.monotonic()
        for f in [f for f in self.driver.flights if now - f.sent_at > limit]:
            self._land(f, f"no update within {limit:.0f} s")

    def _wait_for_a_flight(self, t: int) -> bool:
        """No client is in flight: wait for devices as a round does before its step (each has
        deploy.wait_devices_s for the run), then select again. Whether a client is in flight
        now; a fleet whose devices all said they cannot train stops the run with their reasons
        (as a round does)."""
        self.pool.await_devices()
        self.driver.fill(t)
        if self.driver.flights:
            return True
        online = self.pool.online_devices()
        why = {**self.failing, **self.pool.cannot_run()}
        if online and online <= set(why):
            raise TransportError("no device can train: " + "; ".join(
                f"{d}: {why[d]}" for d in sorted(online)) + " (fix it on the devices, check with "
                "fedseq-client doctor, then start the run again)")
        log.warning("step %d: no client can train now (no device of theirs online, or every one "
                    "trained on this model already)", t)
        return False

    def _answer(self, ev: Any, t: int, got: RoundUpdates) -> Flight | None:
        """The flight an event of the fleet lands (its update checked), or None; a refusal that
        leaves its flight in flight goes into `got.rejected`."""
        d = self.driver
        if isinstance(ev, (DeviceOffline, StepFailed)):
            why = "its device went offline"
            if isinstance(ev, StepFailed):
                self.failing[ev.device] = ev.reason
                why = f"its device cannot train: {printable(ev.reason, 200)}"
            for gone in [g for g in d.flights if self.pool.device_of(g.client) == ev.device]:
                self._land(gone, why)
            return None
        if not isinstance(ev, UpdateArrived):
            return None  # a late evaluation
        c = ev.update.client
        f = next((f for f in d.flights if f.client == c), None)
        if f is None or f.answers != ev.seq:
            self.late += 1
            log.info("late update of client %d (answering step %d) dropped", c, ev.seq)
            self.pool.release(ev)
            return None
        update = self.pool.take(ev)
        version, rejection = self.driver.admit(update, f.version, t)
        # Refused and landed: an update too stale, or its own device saying it diverged. Any
        # other refusal, as in a round, displaces no valid update: the flight waits for its
        # client's valid answer (or its device going, or its deadline), and the refusal goes into
        # the step's row, not into its folds (nothing was trained for it here).
        lands = rejection is None or rejection.code == "too-stale" or (
            update.diverged_at is not None and self.pool.device_of(c) == ev.device)
        if not lands:
            log.warning("step %d: rejected update of client %d (still in flight): %s", t, c,
                        rejection)
            got.rejected[c] = rejection
            return None
        self._land(f)
        # trained on `version` (its contract, its plan), stale since its dispatch (f.version
        # until now): the coordinator's record, not the update's word
        f.dispatched, f.version, f.rejection = f.version, version, rejection
        if rejection is None:
            f.update = update
        d.trained_on[c] = max(d.trained_on.get(c, f.version), f.version)
        return f

    def arrivals(self, t: int, got: RoundUpdates) -> Iterator[Flight]:
        """As the devices send them, until the buffer is full; each landed flight is replaced
        by a newly dispatched client."""
        d = self.driver
        d.fill(t)
        limit, arrived = d.concurrency + 4 * d.buffer, 0
        # answers lost on the broker's queue: asked for again after a silence (as a round does)
        again = self.pool.asker()
        while len(got.reported) < d.buffer and arrived < limit:
            if not self.events:
                self._expire()
                d.fill(t)
                if not d.flights and not self._wait_for_a_flight(t):
                    return
                self.events = self.pool.async_events(1.0)
                again.poll(sorted(f.client for f in d.flights))
                continue
            f = self._answer(self.events.pop(0), t, got)
            if f is not None:
                arrived += 1
                yield f
                d.fill(t)

    def wire(self) -> tuple[int, int] | None:
        """The step's dispatches' and arrivals' bytes (its evaluation's are added)."""
        return self.pool.wire_bytes()

    def step_done(self, t: int, rec: RoundRecord, got: RoundUpdates) -> None:
        """The fleet's part of the row: flights lost, late updates, who sent each counted update
        and its measured pace."""
        self._prune_versions(t + 1)
        self.failing.clear()  # a device that failed is asked again next step (as in a round)
        if self.lost:
            rec.failed, self.lost = sorted(self.lost), []
        rec.late_updates, self.late = self.late, 0
        rec.reporters = {c: d for c in got.reported if (d := self.pool.device_of(c)) is not None}
        rec.set_paces(got.paces)

    def _prune_versions(self, t: int) -> None:
        """Keep the model versions an update may still come for (from the oldest in flight's
        dispatch, and no staler than train.max_staleness at step t)."""
        d = self.driver
        floor = min((f.version for f in d.flights), default=t)
        max_staleness = self.book.cfg.train.max_staleness
        if max_staleness is not None:
            floor = max(floor, t - max_staleness)
        for v in [v for v in d.versions if v < floor]:
            del d.versions[v]

    def rounds_done(self) -> None:
        """Updates coming after the last step are late; no personal state moved here."""
        self.pool.end_async()

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        self.published = -1
