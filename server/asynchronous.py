"""Buffered asynchronous aggregation (FedBuff: Nguyen et al., AISTATS 2022), the second driver of a
run (train.mode = "async").

At most `concurrency` clients train at once. Each one trains on the model as it was when it was
dispatched; when its update arrives it is checked (the round contract of the version it trained
on, and its staleness) and folded into the buffer, and a newly selected client takes its place,
dispatched on the current model. Every `buffer` folded updates the server steps (the algorithm's
own server update), and that step is a round for everything that counts rounds: FedSeq's schedule,
evaluation, the checkpoint, the rows of metrics.jsonl, reports.

An update trained tau steps ago (its staleness) counts (1 + tau)^-alpha as much: its deltas are
scaled by that discount (and by algorithm.server_lr where the algorithm has no server update of
its own) before they are folded in, so the step's mean delta shrinks when stale updates fill it;
an update staler than train.max_staleness is refused ("too-stale").

In simulation, arrivals come in the order of the simulated fleet's virtual clock ([fleet],
server/fleet.py): a client's device starts it when the device is free, receives the blocks over
its link, trains at its pace and sends the update back. Training is lazy: a dispatched client
is trained when its update is first needed, together with every other client dispatched on the
same model version (one pool step: the `--workers` ranks train them in parallel). Selection is a
pure function of (seed, dispatch number) over the clients neither in flight nor already trained
on the current version, so the same config and seed give the same run in-process and with
`--workers`.

On a real fleet (OnFleet) the devices' own pace orders the arrivals: each device trains its
dispatched clients one after another on the newest model it holds, and an update says which
version that was (docs/protocol.md, "An asynchronous run").

A resumed run continues after its last checkpointed step; the clients then in flight are lost
(as a coordinator's crash loses them) and their places are filled again: a resumed asynchronous
run is not bitwise the uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fedseq.common.algorithms import Algorithm
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.algorithms.robust import make_aggregator
from fedseq.common.errors import ConfigError
from fedseq.common.evaluation import EvalReport
from fedseq.common.flops import plan_flops
from fedseq.common.models import Weights, in_blocks
from fedseq.common.seeding import numpy_rng
from fedseq.common.text import printable
from fedseq.server.checkpoint import Checkpoint
from fedseq.server.coordinator import Coordinator, RoundUpdates, add_wire, outliers
from fedseq.server.fleet import energy_j
from fedseq.server.mqtt.collect import Resender
from fedseq.server.mqtt.inbox import UpdateArrived
from fedseq.server.mqtt.pool import MqttPool
from fedseq.server.mqtt.session import DeviceOffline, StepFailed
from fedseq.server.pool import PoolState
from fedseq.server.records import Fold, Rejection, RoundRecord

log = logging.getLogger(__name__)


def staleness_discount(staleness: int, alpha: float) -> float:
    """FedBuff's polynomial staleness weight: (1 + staleness)^-alpha."""
    return float((1 + staleness) ** -alpha)


@dataclass
class Flight:
    """A dispatched client: the dispatch number, the model version (server step) it trains on,
    when its device starts on it, its seconds of training, when its update arrives (virtual
    seconds), and once trained its update or the reason it was refused."""

    seq: int
    client: int
    version: int
    start: float
    train_s: float
    arrival: float
    trained: bool = False
    update: ClientUpdate | None = None
    rejection: Rejection | None = None
    #: once trained: the client's personal state before, until its update arrives
    held: Weights | None = None


@dataclass
class Version:
    """A model version that clients train on: its plan, the blocks they need, what they are
    sent, what they were offered and the bound on their deltas, all as of that version."""

    plan: ClientPlan
    needed: list[str]
    sent: Weights
    offered: Weights
    bound: float


class BufferedAsync(Coordinator):
    """The asynchronous driver: `run` (inherited) checkpoints after every server step and
    fine-tunes at the end; `run_round(t)` folds server step t's arrivals and steps."""

    clock: float

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._check_can_run()
        if self.alg.async_problem is not None:
            raise ConfigError(f"algorithm {self.alg.name} cannot run with train.mode = \"async\": "
                              f"{self.alg.async_problem}; use train.mode = \"sync\"")
        self.concurrency, self.buffer = self.cfg.async_shape()
        self.alpha = self.cfg.train.staleness_alpha
        # the server learning rate scales the folded deltas where the algorithm's server
        # update is FedAvg's (a server optimizer applies algorithm.server_lr itself)
        own_update = type(self.alg).server_update is not Algorithm.server_update
        self.server_lr = 1.0 if own_update else (self.cfg.algorithm.server_lr or 1.0)
        self.flights: list[Flight] = []
        self.seq = 0  # dispatches so far
        self.trained_on: dict[int, int] = {}  # client -> the version it was last dispatched on
        self.device_free: dict[str, float] = {}  # device -> virtual time it is free
        # the versions a flight waiting to be trained needs
        self._versions: dict[int, Version] = {}
        self._bytes_down_step = 0
        self._extra_j = 0.0  # the step's modelled joules above idle

    def _check_can_run(self) -> None:
        if self.fleet is None:
            raise ConfigError("train.mode = \"async\" needs a [fleet]: the devices' paces order "
                              "the updates' arrivals; e.g. --set "
                              "'fleet.devices=[{profile=\"nano\",count=5},"
                              "{profile=\"orin-nano\",count=5}]'")

    def _version(self, t: int) -> Version:
        """The current model (version t) as its clients get it; kept while a flight needs it."""
        if t not in self._versions:
            plan, needed = self._plan(t)
            offered = self.offered()
            self._versions[t] = Version(plan, needed, self._sent(in_blocks(offered, needed)),
                                        offered, self._delta_bound())
        return self._versions[t]

    # -- dispatch --------------------------------------------------------------------------
    def _fill(self, t: int) -> None:
        """Dispatch newly selected clients on the current model (version t) until `concurrency`
        are in flight, or no client is left that is not in flight and has not trained on it."""
        busy = {f.client for f in self.flights}
        while len(self.flights) < self.concurrency:
            eligible = [c for c in range(self.cfg.data.num_clients)
                        if c not in busy and self.trained_on.get(c) != t and self._can_train(c)]
            if not eligible:
                return
            rng = numpy_rng(self.cfg.seed_for("selection"), "async-select", self.seq)
            client = eligible[int(rng.integers(len(eligible)))]
            self._dispatch(t, client)
            busy.add(client)

    def _can_train(self, client: int) -> bool:
        """Whether `client` may be selected now (every client of a simulated fleet)."""
        return True

    def _dispatch(self, t: int, client: int) -> None:
        """Start `client` on version t: its device starts when it is free, receives the blocks,
        trains at its pace and sends its update (virtual seconds)."""
        assert self.fleet is not None
        v = self._version(t)
        nbytes = self._client_bytes_down(client, v.plan, v.needed)
        self._bytes_down_step += nbytes
        device = self.fleet.device_of[client]
        start = max(self.clock, self.device_free.get(device.name, 0.0)) + device.down_s(nbytes)
        flops = plan_flops(self.model, v.plan, self.data, self.data.clients[client],
                           self.flop_cache)
        train_s = self.fleet.train_s(client, flops, self.seq)
        self.device_free[device.name] = start + train_s
        arrival = start + train_s + device.up_s(self._upload_size(v.plan))
        self.flights.append(Flight(self.seq, client, t, start, train_s, arrival))
        self.trained_on[client] = t
        self.seq += 1

    def _train_flights(self, flights: list[Flight]) -> None:
        """Train `flights` (clients dispatched on one version) in one pool step, each against
        the round contract of its version."""
        version = flights[0].version
        v = self._versions[version]
        waiting = {f.client: f for f in flights}
        clients = sorted(waiting)
        contract = self._contract(version, clients, v.plan, v.offered, v.bound)

        def check(update: ClientUpdate) -> Rejection | None:
            reason = contract.check(update)
            if reason is not None and update.client in waiting:
                waiting[update.client].rejection = reason
            return reason

        before = self.pool.snapshot().personal  # a trained flight's state until it arrives
        for f in flights:
            f.held = before.get(f.client)
        for update in self.pool.train(version, clients, v.plan, v.sent, check):
            waiting[update.client].update = update
        for f in flights:
            f.trained = True
            if f.update is None and f.rejection is None:
                f.rejection = Rejection("diverged", "no update came back")

    def _arrivals(self, t: int, got: RoundUpdates) -> Iterator[Flight]:
        """Server step t's arrivals in virtual-time order, until the buffer is full; each is
        replaced by a newly dispatched client."""
        assert self.fleet is not None
        self._fill(t)
        # a step that cannot fill its buffer (every update refused) gives up after this many
        limit, arrived = self.concurrency + 4 * self.buffer, 0
        while len(got.reported) < self.buffer and self.flights and arrived < limit:
            f = min(self.flights, key=lambda f: (f.arrival, f.seq))
            if not f.trained:
                self._train_flights([g for g in self.flights
                                     if g.version == f.version and not g.trained])
                del self._versions[f.version]  # none of its flights waits to be trained now
            self.flights.remove(f)
            self.clock = f.arrival
            self._extra_j += self.fleet.extra_j(f.client, f.train_s)
            arrived += 1
            yield f
            self._fill(t)

    # -- one server step -------------------------------------------------------------------
    def run_round(self, t: int) -> RoundRecord:
        """Fold step t's arrivals (each discounted by its staleness; the stale beyond the bound
        refused), then step the server, evaluate when due, and make the step's row."""
        start = time.perf_counter()
        began: float = self.clock
        got = RoundUpdates(make_aggregator(self.cfg.aggregation))
        folds: list[Fold] = []
        for f in self._arrivals(t, got):
            staleness = t - f.version
            if f.rejection is None and self.cfg.train.max_staleness is not None \
                    and staleness > self.cfg.train.max_staleness:
                f.rejection = Rejection("too-stale", f"trained on the model of step {f.version}, "
                                        f"{staleness} steps ago > train.max_staleness="
                                        f"{self.cfg.train.max_staleness}")
            fold = Fold(client=f.client, version=f.version, staleness=staleness)
            if f.rejection is not None:
                log.warning("step %d: rejected update of client %d: %s", t, f.client, f.rejection)
                got.rejected[f.client] = f.rejection
                fold.refused = f.rejection.code
            else:
                assert f.update is not None
                discount = staleness_discount(staleness, self.alpha)
                self._fold(got, f.update, self.alg.plan(f.version),
                           discount * self.server_lr)
                fold.discount = round(discount, 6)
            folds.append(fold)
        got.outliers, _ = outliers(got.norms, self.cfg.aggregation.outlier_factor)
        refused = self._apply(t, got)
        self._evaluate_if_due(t)
        arrived = sorted({f.client for f in folds})
        rec = self._row(t, self.alg.plan(t), got, refused, arrived, arrived,
                        self._bytes_down_step, start)
        rec.folds = folds
        if refused is None:
            rec.max_staleness = max((f.staleness for f in folds if f.refused is None),
                                    default=None)
        if self.fleet is not None:
            spent = self.clock - began
            rec.set_virtual(spent, self.clock, energy_j(self.fleet, spent, {}) + self._extra_j)
        self._bytes_down_step, self._extra_j = 0, 0.0
        self._finish(t, rec, got)
        return rec

    def _finish(self, t: int, rec: RoundRecord, got: RoundUpdates) -> None:
        """What a driver adds to step t's row (nothing in simulation)."""

    # -- what never arrived ----------------------------------------------------------------
    def _not_arrived(self) -> dict[int, Weights]:
        """The clients trained ahead of their arrival (with others of their version) whose update
        has not arrived: their personal state as it was before. A client's state changes when
        its update arrives, so an update that never arrives (the run ended, or the coordinator
        stopped) changes nothing, and a run's rows say all that moved (`--replay`)."""
        return {f.client: f.held for f in self.flights if f.trained and f.held is not None}

    def _rounds_done(self) -> None:
        self.pool.restore(PoolState(None, self._not_arrived()))

    def _evaluate(self) -> tuple[EvalReport, tuple[int, int] | None]:
        """The scores with every client's state as of its last arrival."""
        undo = self._not_arrived()
        if not undo:
            return super()._evaluate()
        current = self.pool.snapshot().personal
        ahead = {c: current[c] for c in undo}
        self.pool.restore(PoolState(None, undo))
        try:
            return super()._evaluate()
        finally:
            self.pool.restore(PoolState(None, ahead))

    def _checkpoint(self, next_round: int, row: RoundRecord | None) -> Checkpoint:
        ckpt = super()._checkpoint(next_round, row)
        undo = self._not_arrived()
        if undo:  # the flights in flight are lost on resume: so is their training
            ckpt.pool = PoolState(ckpt.pool.state, {**ckpt.pool.personal, **undo})
        return ckpt

    # -- checkpoint ------------------------------------------------------------------------
    def _driver_state(self) -> dict[str, Any] | None:
        return {"seq": self.seq,
                "trained_on": {str(c): v for c, v in self.trained_on.items()},
                "device_free": self.device_free,
                "in_flight": [[f.client, f.version] for f in self.flights]}

    def _restore(self, ckpt: Checkpoint) -> int:
        first = super()._restore(ckpt)
        state = ckpt.loop.driver
        if state is None:
            raise ConfigError("--resume: the checkpoint is a synchronous run's; resume it with "
                              "train.mode = \"sync\"")
        self.seq = int(state["seq"])
        # the clients in flight at the checkpoint are lost; they may be selected again
        lost = {int(c) for c, _ in state["in_flight"]}
        self.trained_on = {int(c): int(v) for c, v in state["trained_on"].items()
                           if int(c) not in lost}
        self.device_free = {d: float(s) for d, s in state["device_free"].items()}
        return first


class OnFleet(BufferedAsync):
    """train.mode = "async" on a real fleet (MqttPool): the devices' own pace orders arrivals.

    Every fill publishes an async step: the current model version and every client in flight
    with the step that dispatched it. A device trains its clients' dispatches one after another,
    each on the newest model it holds, and its update says which version that was (its round):
    the version it is checked against (that version's round contract, kept while an update may
    still come for it) and discounted by. A client is selected only while its device is online;
    a flight is dropped when its device goes offline or fails the step, or when no answer came
    within deploy.round_timeout_s (else round_timeout_max_s); its client may be selected again.
    A resumed run re-selects: the devices' answers to the crashed coordinator's dispatches come
    too late and are dropped (the pool's steps jump past them)."""

    pool: MqttPool

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.wire: dict[int, int] = {}  # client in flight -> the step that dispatched it
        self.since: dict[int, float] = {}  # client in flight -> when (monotonic)
        self.published = -1  # the model version the last async step carried
        self.events: list[Any] = []  # what the fleet sent, not handled yet
        self.lost: list[int] = []  # the step's clients whose flight was dropped
        self.late = 0  # updates of flights no longer in flight
        self._wire: tuple[int, int] | None = None  # the step's (sent, received) bytes

    def _check_can_run(self) -> None:
        """The devices' own pace orders the arrivals: no [fleet] is needed."""

    def _can_train(self, client: int) -> bool:
        device = self.pool.owner.get(client)
        return device in self.pool.session.online and device not in self.pool.session.incompatible

    def _dispatch(self, t: int, client: int) -> None:
        self.flights.append(Flight(self.seq, client, t, 0.0, 0.0, math.inf))
        self.trained_on[client] = t
        self.seq += 1

    def _fill(self, t: int) -> None:
        """Select clients until `concurrency` are in flight, then publish the async step when a
        client was dispatched or the model moved on."""
        super()._fill(t)
        new = [f.client for f in self.flights if f.client not in self.wire]
        if not new and self.published == t:
            return
        v = self._version(t)
        seq = self.pool.dispatch(t, {f.client: self.wire.get(f.client) for f in self.flights},
                                 v.plan, v.sent)
        now = time.monotonic()
        for c in new:
            self.wire[c], self.since[c] = seq, now
            self._bytes_down_step += self._client_bytes_down(c, v.plan, v.needed)
        self.published = t

    def _land(self, f: Flight, why: str | None = None) -> None:
        """`f` is no longer in flight (`why`: it was dropped, and why)."""
        self.flights.remove(f)
        self.wire.pop(f.client, None)
        self.since.pop(f.client, None)
        if why is not None:
            log.warning("client %d: dropped from flight (%s); it may be selected again", f.client,
                        why)
            self.lost.append(f.client)

    def _expire(self) -> None:
        limit = self.cfg.deploy.round_timeout_s or self.cfg.deploy.round_timeout_max_s
        now = time.monotonic()
        for f in [f for f in self.flights if now - self.since.get(f.client, now) > limit]:
            self._land(f, f"no update within {limit:.0f} s")

    def _answer(self, ev: Any, t: int) -> Flight | None:
        """The flight an event of the fleet lands (its update checked), or None."""
        if isinstance(ev, (DeviceOffline, StepFailed)):
            why = ("its device went offline" if isinstance(ev, DeviceOffline)
                   else f"its device cannot train: {printable(ev.reason, 200)}")
            for gone in [g for g in self.flights if self.pool.owner.get(g.client) == ev.device]:
                self._land(gone, why)
            return None
        if not isinstance(ev, UpdateArrived):
            return None  # a late evaluation
        c = ev.update.client
        f = next((f for f in self.flights if f.client == c), None)
        if f is None or self.wire.get(c) != ev.seq:
            self.late += 1
            log.info("late update of client %d (answering step %d) dropped", c, ev.seq)
            self.pool.release(ev)
            return None
        update = self.pool.take(ev)
        self._land(f)
        dispatched_on, f.version = f.version, update.round
        v = self._versions.get(f.version)
        if not dispatched_on <= f.version <= t:
            f.version = dispatched_on
            f.rejection = Rejection("bad-version", f"trained on the model of step {update.round},"
                                    f" but dispatched on step {dispatched_on} before step {t}")
        elif v is None:  # older than any update may be folded
            f.rejection = Rejection("too-stale", f"trained on the model of step {f.version}, "
                                    f"{t - f.version} steps ago > train.max_staleness="
                                    f"{self.cfg.train.max_staleness}")
        else:
            contract = self._contract(f.version, [c], v.plan, v.offered, v.bound)
            f.rejection = contract.check(update)
            if f.rejection is None:
                f.update = update
        self.trained_on[c] = max(self.trained_on.get(c, f.version), f.version)
        return f

    def _arrivals(self, t: int, got: RoundUpdates) -> Iterator[Flight]:
        self._fill(t)
        limit, arrived = self.concurrency + 4 * self.buffer, 0
        # answers lost on the broker's queue: asked for again after a silence (as a round does)
        again = Resender(self.pool.session, self.pool.seq, self.pool.update_chunks)
        while len(got.reported) < self.buffer and arrived < limit:
            if not self.events:
                self._expire()
                self._fill(t)
                if not self.flights:
                    log.warning("step %d: no client can train (none eligible online)", t)
                    return
                self.events = self.pool.async_events(1.0)
                again.seq = self.pool.seq  # a device answers an ask of its current step
                again.poll(sorted(self.wire))
                continue
            f = self._answer(self.events.pop(0), t)
            if f is not None:
                arrived += 1
                yield f
                self._fill(t)

    def _finish(self, t: int, rec: RoundRecord, got: RoundUpdates) -> None:
        """The fleet's part of the row: flights lost, late updates, who sent each counted update
        and its measured pace, the wire bytes."""
        self._prune_versions(t + 1)
        if self.lost:
            rec.failed, self.lost = sorted(self.lost), []
        if self._wire is not None:
            rec.wire_bytes_out, rec.wire_bytes_in = self._wire
        rec.late_updates, self.late = self.late, 0
        rec.reporters = {c: self.pool.owner[c] for c in got.reported}
        rec.set_paces(got.paces)

    def _evaluate_if_due(self, t: int) -> tuple[int, int] | None:
        """(and the step's wire bytes: its dispatches' and arrivals', and its evaluation's)"""
        arrivals = self.pool.session.wire_bytes()
        wire = super()._evaluate_if_due(t)
        self._wire = add_wire(arrivals, wire)
        return wire

    def _prune_versions(self, t: int) -> None:
        """Keep the model versions an update may still come for (from the oldest in flight's
        dispatch, and no staler than train.max_staleness at step t)."""
        floor = min((f.version for f in self.flights), default=t)
        if self.cfg.train.max_staleness is not None:
            floor = max(floor, t - self.cfg.train.max_staleness)
        for v in [v for v in self._versions if v < floor]:
            del self._versions[v]

    def _rounds_done(self) -> None:
        """Updates coming after the last step are late; no personal state moved here."""
        self.pool.end_async()

    def _restore(self, ckpt: Checkpoint) -> int:
        first = super()._restore(ckpt)
        self.published = -1
        return first


class Replay(BufferedAsync):
    """`fedseq-sim --replay RUN_DIR`: an asynchronous run re-executed in the order its rows
    record (`folds`: client and model version of every arrival, step by step), so a deployed
    asynchronous run gives its global model again, bitwise with equal threads. Every arrival
    is trained again (a refused one too: its client's personal state moved on its device) and
    checked again; the time and order come from the log, not from a fleet."""

    def __init__(self, *args: Any, log: dict[int, list[Fold]], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.log = log
        # version -> the last step that folds an update trained on it
        self.last_use: dict[int, int] = {}
        for t, folds in sorted(log.items()):
            for f in folds:
                self.last_use[f.version] = t

    def _check_can_run(self) -> None:
        """A replay needs no fleet: the order is the log's."""

    def _arrivals(self, t: int, got: RoundUpdates) -> Iterator[Flight]:
        if t in self.last_use:
            self._version(t)  # clients of a later step train on this version
        for fold in self.log.get(t, []):
            if fold.version not in self._versions:
                raise ConfigError(f"--replay: step {t} folds an update trained on step "
                                  f"{fold.version}, which the log never reached; the run "
                                  "directory's rows are not an asynchronous run's")
            f = Flight(-1, fold.client, fold.version, 0.0, 0.0, 0.0)
            self._train_flights([f])
            yield f
        for version in [v for v, last in self.last_use.items() if last <= t]:
            self._versions.pop(version, None)

    def _driver_state(self) -> dict[str, Any] | None:
        return {"replay": True}

    def _restore(self, ckpt: Checkpoint) -> int:
        raise ConfigError("--replay runs into a new --out from the start; it does not resume")


def fold_log(rows: list[RoundRecord]) -> dict[int, list[Fold]]:
    """An asynchronous run's arrivals per server step, from its rows (metrics.jsonl); a ConfigError
    where the rows are not an asynchronous run's."""
    log = {r.round: list(r.folds) for r in rows if r.phase == "train"}
    if not log or not any(log.values()):
        raise ConfigError("--replay: the run directory's rows record no asynchronous arrivals "
                          "(folds); only a train.mode = \"async\" run can be replayed")
    return log
