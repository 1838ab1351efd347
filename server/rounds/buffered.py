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
server/rounds/virtual_fleet.py): a client's device starts it when the device is free, receives the blocks over
its link, trains at its pace and sends the update back. Training is lazy: a dispatched client
is trained when its update is first needed, together with every other client dispatched on the
same model version (one pool step: the `--workers` ranks train them in parallel). Selection is a
pure function of (seed, dispatch number) over the clients neither in flight nor already trained
on the current version, so the same config and seed give the same run in-process and with
`--workers`.

On a real fleet (server/pools/mqtt/arrivals.py, MqttArrivals) the devices' own pace orders the
arrivals: each device trains its dispatched clients one after another on the newest model it
holds, and an update says which version that was (docs/protocol.md, "An asynchronous run").

A resumed run continues after its last checkpointed step; the clients then in flight are lost
(as a coordinator's crash loses them) and their places are filled again: a resumed asynchronous
run is not bitwise the uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.errors import ConfigError
from fedseq.common.models import Weights, in_blocks
from fedseq.common.seeding import numpy_rng
from fedseq.server.rounds.driver import Driver
from fedseq.server.rounds.ledger import Ledger, RoundUpdates, add_wire, outliers
from fedseq.server.rounds.pool_api import PoolState
from fedseq.server.rounds.records import Fold, Rejection, RoundRecord
from fedseq.server.rounds.virtual_fleet import energy_j

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
    #: on a real fleet: the pool step that dispatched it (what its update answers; None until
    #: published) and when (monotonic seconds)
    answers: int | None = None
    sent_at: float = 0.0
    #: the version its staleness counts from, where that is not `version`: on a real fleet the
    #: version the coordinator dispatched it on (a device trains on the newest model it holds and
    #: says which; what it says picks the contract, never a smaller staleness)
    dispatched: int | None = None

    def staleness(self, t: int) -> int:
        """Server steps since the model its staleness counts from (at step t)."""
        return t - (self.version if self.dispatched is None else self.dispatched)


@dataclass
class Version:
    """A model version that clients train on: its plan, the blocks they need, what they are
    sent, what they were offered and the bound on their deltas, all as of that version."""

    plan: ClientPlan
    needed: list[str]
    sent: Weights
    offered: Weights
    bound: float


class Arrivals(Protocol):
    """Where an asynchronous run's updates come from and in which order: the simulated fleet's
    clock (`VirtualArrivals`), a real fleet (server/pools/mqtt/arrivals.py `MqttArrivals`) or a finished
    run's log (`LoggedArrivals`). Built on the driver (`ArrivalsFactory`), whose flights, model
    versions and ledger it reads."""

    def can_train(self, client: int) -> bool:
        """Whether `client` may be selected now."""
        ...

    def dispatch(self, t: int, client: int, seq: int) -> Flight:
        """Dispatch number `seq`: `client` starts on model version t; its flight."""
        ...

    def filled(self, t: int) -> None:
        """The driver selected clients until its concurrency is in flight (a fleet publishes)."""
        ...

    def arrivals(self, t: int, got: RoundUpdates) -> Iterator[Flight]:
        """Server step t's arrivals, until its buffer is full (`got`: what it folded so far)."""
        ...

    def wire(self) -> tuple[int, int] | None:
        """The (sent, received) bytes of the step's arrivals (None: not measured)."""
        ...

    def step_done(self, t: int, rec: RoundRecord, got: RoundUpdates) -> None:
        """What this source adds to server step t's row."""
        ...

    def rounds_done(self) -> None:
        """After the last step: what the source settles."""
        ...

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the source, beside the driver's state."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (ConfigError: this source cannot)."""
        ...


class BufferedAsync(Driver):
    """The asynchronous driver (module docstring): `run_round(t)` folds server step t's
    arrivals, each discounted by its staleness, then steps the server. Who is selected and how
    a step folds are here; the order of arrivals is its `Arrivals` source's."""

    def __init__(self, book: Ledger, arrivals: ArrivalsFactory):
        self.book = book
        cfg = book.cfg
        if book.alg.async_problem is not None:
            raise ConfigError(f"algorithm {book.alg.name} cannot run with train.mode = \"async\": "
                              f"{book.alg.async_problem}; use train.mode = \"sync\"")
        self.concurrency, self.buffer = cfg.async_shape()
        self.alpha = cfg.train.staleness_alpha
        # the server learning rate scales the folded deltas where the algorithm's server
        # update is FedAvg's (a server optimizer applies algorithm.server_lr itself)
        self.server_lr = (1.0 if book.alg.own_server_step
                          else (cfg.algorithm.server_lr or 1.0))
        self.flights: list[Flight] = []
        self.seq = 0  # dispatches so far
        self.trained_on: dict[int, int] = {}  # client -> the version it was last dispatched on
        #: the model versions a flight may still need (to be trained, or to be checked against)
        self.versions: dict[int, Version] = {}
        self.bytes_down_step = 0
        self.extra_j = 0.0  # the step's modelled joules above idle
        #: [privacy]: the clients that arrived this step; none is dispatched again before the
        #: step ends, so no client is in a step's noised sum twice (its sensitivity is C)
        self.arrived_this_step: set[int] = set()
        self.source = arrivals(self)

    def version(self, t: int) -> Version:
        """The current model (version t) as its clients get it; kept while a flight needs it."""
        if t not in self.versions:
            book = self.book
            plan, needed = book.plan(t)
            offered = book.offered()
            self.versions[t] = Version(plan, needed, book.sent(in_blocks(offered, needed)),
                                       offered, book.delta_bound())
        return self.versions[t]

    # -- dispatch --------------------------------------------------------------------------
    def fill(self, t: int) -> None:
        """Dispatch newly selected clients on the current model (version t) until `concurrency`
        are in flight, or no client is left that is not in flight and has not trained on it;
        then tell the source."""
        busy = {f.client for f in self.flights}
        while len(self.flights) < self.concurrency:
            eligible = [c for c in range(self.book.cfg.data.num_clients)
                        if c not in busy and self.trained_on.get(c) != t
                        and c not in self.arrived_this_step and self.source.can_train(c)]
            if not eligible:
                break
            rng = numpy_rng(self.book.cfg.seed_for("selection"), "async-select", self.seq)
            client = eligible[int(rng.integers(len(eligible)))]
            self.flights.append(self.source.dispatch(t, client, self.seq))
            self.trained_on[client] = t
            self.seq += 1
            busy.add(client)
        self.source.filled(t)

    def train_flights(self, flights: list[Flight]) -> None:
        """Train `flights` (clients dispatched on one version) in one pool step, each against
        the round contract of its version."""
        book = self.book
        version = flights[0].version
        v = self.versions[version]
        waiting = {f.client: f for f in flights}
        clients = sorted(waiting)
        contract = book.contract(version, clients, v.plan, v.offered, v.bound)

        def check(update: ClientUpdate) -> Rejection | None:
            reason = contract.admit(update)
            if reason is not None and update.client in waiting:
                waiting[update.client].rejection = reason
            return reason

        before = book.pool.snapshot().personal  # a trained flight's state until it arrives
        for f in flights:
            f.held = before.get(f.client)
        for update in book.pool.train(version, clients, v.plan, v.sent, check):
            waiting[update.client].update = update
        for f in flights:
            f.trained = True
            if f.update is None and f.rejection is None:
                f.rejection = Rejection("diverged", "no update came back")

    def admit(self, update: ClientUpdate, dispatched_on: int, t: int
              ) -> tuple[int, Rejection | None]:
        """An update that came back from a fleet at step t (the async policy, here, not in the
        pool): (the version it is counted on, why it is refused or None). It must name a version
        between its dispatch's and the current step, one still kept, and pass that version's
        round contract."""
        if not dispatched_on <= update.round <= t:
            return dispatched_on, Rejection(
                "bad-version", f"trained on the model of step {update.round}, but dispatched on "
                f"step {dispatched_on} before step {t}")
        v = self.versions.get(update.round)
        if v is None:  # older than any update may be folded
            return update.round, Rejection(
                "too-stale", f"trained on the model of step {update.round}, {t - update.round} "
                f"steps ago > train.max_staleness={self.book.cfg.train.max_staleness}")
        contract = self.book.contract(update.round, [update.client], v.plan, v.offered, v.bound)
        return update.round, contract.admit(update)

    # -- one server step -------------------------------------------------------------------
    def run_round(self, t: int) -> RoundRecord:
        """Fold step t's arrivals (each discounted by its staleness; the stale beyond the bound
        refused), then step the server, evaluate when due, and make the step's row."""
        book, cfg = self.book, self.book.cfg
        start = time.perf_counter()
        began: float = book.clock
        # 1. the step's aggregate (plain, or [privacy]'s noised sum: privacy/dp.py)
        got = book.updates(t)
        # 2. collect: the arrivals the source orders (dispatching to fill the buffer), each
        #    checked, discounted by its staleness and folded in
        self.arrived_this_step.clear()
        folds = [self._fold(t, f, got) for f in self.source.arrivals(t, got)]
        got.outliers, _ = outliers(got.norms, cfg.aggregation.outlier_factor)
        # 3. aggregate: the server step, where the buffer has its quorum
        refused = book.apply(t, got)
        arrived_wire = self.source.wire()
        # 4. evaluate, when due
        eval_wire = self._evaluate_if_due(t)
        # 5. record: the step's row
        arrived = sorted({f.client for f in folds})
        rec = book.row(t, book.alg.plan(t), got, refused, arrived, arrived,
                       self.bytes_down_step, start)
        rec.folds = folds
        if refused is None:
            rec.max_staleness = max((f.staleness for f in folds if f.refused is None),
                                    default=None)
        if book.fleet is not None:
            spent = book.clock - began
            rec.set_virtual(spent, book.clock, energy_j(book.fleet, spent, {}) + self.extra_j)
        if arrived_wire is not None:  # measured: the step's dispatches and arrivals, its evaluation
            rec.wire_bytes_out, rec.wire_bytes_in = add_wire(arrived_wire, eval_wire) or (0, 0)
        self.bytes_down_step, self.extra_j = 0, 0.0
        self.source.step_done(t, rec, got)
        return rec

    def _fold(self, t: int, f: Flight, got: RoundUpdates) -> Fold:
        """One arrival of step t: refused (its reason kept, too stale beyond
        train.max_staleness), or folded into `got` with its staleness discount; its Fold row."""
        book, cfg = self.book, self.book.cfg
        if cfg.privacy.client_level:
            self.arrived_this_step.add(f.client)
        plan = book.alg.plan(f.version)
        book.privacy.spent(f.client, plan)
        staleness = f.staleness(t)
        if f.rejection is None and cfg.train.max_staleness is not None \
                and staleness > cfg.train.max_staleness:
            f.rejection = Rejection("too-stale", f"dispatched on the model of step "
                                    f"{t - staleness}, {staleness} steps ago > "
                                    f"train.max_staleness={cfg.train.max_staleness}")
        fold = Fold(client=f.client, version=f.version, staleness=staleness)
        if f.rejection is not None:
            log.warning("step %d: rejected update of client %d: %s", t, f.client, f.rejection)
            got.rejected[f.client] = f.rejection
            fold.refused = f.rejection.code
        else:
            assert f.update is not None
            discount = staleness_discount(staleness, self.alpha)
            book.fold(got, f.update, plan, discount * self.server_lr)
            fold.discount = round(discount, 6)
        return fold

    # -- what never arrived ----------------------------------------------------------------
    def _not_arrived(self) -> dict[int, Weights]:
        """The clients trained ahead of their arrival (with others of their version) whose update
        has not arrived: their personal state as it was before. A client's state changes when
        its update arrives, so an update that never arrives (the run ended, or the coordinator
        stopped) changes nothing, and a run's rows say all that moved (`--replay`)."""
        return {f.client: f.held for f in self.flights if f.trained and f.held is not None}

    def _evaluate_if_due(self, t: int) -> tuple[int, int] | None:
        """The ledger's evaluation, with every client's state as of its last arrival."""
        pool = self.book.pool
        undo = self._not_arrived()
        if not undo:
            return self.book.evaluate_if_due(t)
        current = pool.snapshot().personal
        ahead = {c: current[c] for c in undo}
        pool.restore(PoolState(None, undo))
        try:
            return self.book.evaluate_if_due(t)
        finally:
            pool.restore(PoolState(None, ahead))

    def rounds_done(self) -> None:
        """The trained flights that did not arrive leave their clients' state as it was."""
        undo = self._not_arrived()
        if undo:
            self.book.pool.restore(PoolState(None, undo))
        self.source.rounds_done()

    def pool_state(self, state: PoolState) -> PoolState:
        """The flights in flight are lost on resume: so is their training."""
        undo = self._not_arrived()
        return PoolState(state.state, {**state.personal, **undo}) if undo else state

    # -- checkpoint ------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        return {"seq": self.seq,
                "trained_on": {str(c): v for c, v in self.trained_on.items()},
                "in_flight": [[f.client, f.version] for f in self.flights],
                **self.source.state()}

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ConfigError("--resume: the checkpoint is a synchronous run's; resume it with "
                              "train.mode = \"sync\"")
        self.source.restore(state)
        self.seq = int(state["seq"])
        # the clients in flight at the checkpoint are lost; they may be selected again
        lost = {int(c) for c, _ in state["in_flight"]}
        self.trained_on = {int(c): int(v) for c, v in state["trained_on"].items()
                           if int(c) not in lost}


ArrivalsFactory = Callable[[BufferedAsync], Arrivals]


class VirtualArrivals(Arrivals):
    """The simulated fleet's order ([fleet], server/rounds/virtual_fleet.py): a dispatched client's device
    starts it when the device is free, receives the blocks over its link, trains at its pace
    and sends the update back (virtual seconds). Training is lazy: a client is trained when its
    update is first needed, with every other client dispatched on the same model version, in
    one step of any ClientPool (in process, or the `--workers` ranks in parallel)."""

    def __init__(self, driver: BufferedAsync):
        if driver.book.fleet is None:
            raise ConfigError("train.mode = \"async\" needs a [fleet]: the devices' paces order "
                              "the updates' arrivals; e.g. --set "
                              "'fleet.devices=[{profile=\"nano\",count=5},"
                              "{profile=\"orin-nano\",count=5}]'")
        self.driver, self.book, self.fleet = driver, driver.book, driver.book.fleet
        self.device_free: dict[str, float] = {}  # device -> virtual time it is free

    def can_train(self, client: int) -> bool:
        """Every client of a simulated fleet."""
        return True

    def dispatch(self, t: int, client: int, seq: int) -> Flight:
        book, device = self.book, self.fleet.device_of[client]
        v = self.driver.version(t)
        nbytes = book.client_bytes_down(client, v.plan, v.needed)
        self.driver.bytes_down_step += nbytes
        start = max(book.clock, self.device_free.get(device.name, 0.0)) + device.down_s(nbytes)
        train_s = self.fleet.train_s(client, book.flops(client, v.plan), seq)
        self.device_free[device.name] = start + train_s
        arrival = start + train_s + device.up_s(book.upload_size(v.plan))
        return Flight(seq, client, t, start, train_s, arrival)

    def filled(self, t: int) -> None:
        """Nothing to publish: the flights' times are known."""

    def arrivals(self, t: int, got: RoundUpdates) -> Iterator[Flight]:
        """In virtual-time order, until the buffer is full; each is replaced by a newly
        dispatched client."""
        d = self.driver
        d.fill(t)
        # a step that cannot fill its buffer (every update refused) gives up after this many
        limit, arrived = d.concurrency + 4 * d.buffer, 0
        while len(got.reported) < d.buffer and d.flights and arrived < limit:
            f = min(d.flights, key=lambda f: (f.arrival, f.seq))
            if not f.trained:
                d.train_flights([g for g in d.flights if g.version == f.version and not g.trained])
                del d.versions[f.version]  # none of its flights waits to be trained now
            d.flights.remove(f)
            self.book.clock = f.arrival
            d.extra_j += self.fleet.extra_j(f.client, f.train_s)
            arrived += 1
            yield f
            d.fill(t)

    def wire(self) -> tuple[int, int] | None:
        return None

    def step_done(self, t: int, rec: RoundRecord, got: RoundUpdates) -> None:
        """Nothing to add."""

    def rounds_done(self) -> None:
        """Nothing to settle."""

    def state(self) -> dict[str, Any]:
        return {"device_free": self.device_free}

    def restore(self, state: dict[str, Any]) -> None:
        self.device_free = {d: float(s) for d, s in state.get("device_free", {}).items()}


class LoggedArrivals(Arrivals):
    """`fedseq-sim --replay RUN_DIR`: an asynchronous run re-executed in the order its rows
    record (`folds`: client and model version of every arrival, step by step), so a deployed
    asynchronous run gives its global model again, bitwise with equal threads. Every arrival
    is trained again (a refused one too: its client's personal state moved on its device) and
    checked again; one the run refused is refused again, whatever the reason was (a forged or
    malformed update that was refused is, trained again here, a valid one); the time and order
    come from the log, not from a fleet."""

    def __init__(self, driver: BufferedAsync, log: dict[int, list[Fold]]):
        self.driver = driver
        self.log = log
        # version -> the last step that folds an update trained on it
        self.last_use: dict[int, int] = {}
        for t, folds in sorted(log.items()):
            for f in folds:
                self.last_use[f.version] = t

    def can_train(self, client: int) -> bool:
        return False  # nobody is selected: the log says who arrives

    def dispatch(self, t: int, client: int, seq: int) -> Flight:
        raise AssertionError("a replay dispatches nobody")

    def filled(self, t: int) -> None:
        """Nothing to publish."""

    def arrivals(self, t: int, got: RoundUpdates) -> Iterator[Flight]:
        d = self.driver
        if t in self.last_use:
            d.version(t)  # clients of a later step train on this version
        for fold in self.log.get(t, []):
            if fold.version not in d.versions:
                raise ConfigError(f"--replay: step {t} folds an update trained on step "
                                  f"{fold.version}, which the log never reached; the run "
                                  "directory's rows are not an asynchronous run's")
            f = Flight(-1, fold.client, fold.version, 0.0, 0.0, 0.0,
                       dispatched=t - fold.staleness)  # the staleness the run counted
            d.train_flights([f])
            if fold.refused is not None:
                f.update, f.rejection = None, Rejection(fold.refused, "refused in the run")
            yield f
        for version in [v for v, last in self.last_use.items() if last <= t]:
            d.versions.pop(version, None)

    def wire(self) -> tuple[int, int] | None:
        return None

    def step_done(self, t: int, rec: RoundRecord, got: RoundUpdates) -> None:
        """Nothing to add."""

    def rounds_done(self) -> None:
        """Nothing to settle."""

    def state(self) -> dict[str, Any]:
        return {"replay": True}

    def restore(self, state: dict[str, Any]) -> None:
        raise ConfigError("--replay runs into a new --out from the start; it does not resume")


def fold_log(rows: list[RoundRecord]) -> dict[int, list[Fold]]:
    """An asynchronous run's arrivals per server step, from its rows (metrics.jsonl); a ConfigError
    where the rows are not an asynchronous run's."""
    log = {r.round: list(r.folds) for r in rows if r.phase == "train"}
    if not log or not any(log.values()):
        raise ConfigError("--replay: the run directory's rows record no asynchronous arrivals "
                          "(folds); only a train.mode = \"async\" run can be replayed")
    return log
