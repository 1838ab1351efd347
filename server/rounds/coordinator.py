"""The run loop and the synchronous driver of its rounds.

`Coordinator` runs a federated experiment: restore from a checkpoint, every round by its driver, a
checkpoint and a row after each, the algorithm's final fine-tuning, the run directory's outputs.
A driver decides what a round (or server step) is:

- `Rounds` (here): train.mode = "sync", select clients, train them, count the first valid updates;
- `BufferedAsync` (buffered.py): train.mode = "async", fold updates as they arrive, a server
  step per buffer of them, in the order of the simulated fleet (`VirtualArrivals`), a real fleet
  (server/pools/mqtt/arrivals.py `MqttArrivals`) or a finished run's log (`LoggedArrivals`, --replay).

Drivers do not subclass each other: each uses the run's `Ledger` (ledger.py: versions, bytes, the
round contract, the fold, the server step, the row) and offers the `Driver` protocol (driver.py).
Every decision of a run is here and in the ledger (who is selected, which update counts, whether a
round has its quorum, when to evaluate, what a checkpoint holds); the ClientPool (pool_api.py)
only transports, and the RunDir only writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedseq.common.algorithms import Algorithm
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData
from fedseq.common.errors import ConfigError, TransportError
from fedseq.common.evaluation import EvalReport
from fedseq.common.flops import plan_flops, plan_steps
from fedseq.common.models import BlockModel, Weights, count_params, in_blocks
from fedseq.server.privacy.dp import check_budget, check_record_level, statement
from fedseq.server.privacy.secure_sum import SecureSum
from fedseq.server.rounds.checkpoint import Checkpoint, save_checkpoint
from fedseq.server.rounds.contract import RoundContract, secure_stages
from fedseq.server.rounds.driver import Driver, DriverFactory
from fedseq.server.rounds.ledger import (
    Ledger,
    RoundUpdates,
    add_wire,
    outliers,
    select_clients,
    torch_threads,
)
from fedseq.server.rounds.pool_api import ClientPool, PoolState, RoundOutcome
from fedseq.server.rounds.records import ClientEnergy, RoundRecord, SlowestDevice
from fedseq.server.rounds.rundir import RunDir
from fedseq.server.rounds.sites import EdgeSites
from fedseq.server.rounds.virtual_fleet import ClientTiming, energy_j, sync_round

log = logging.getLogger(__name__)

__all__ = ["Coordinator", "Driver", "Rounds", "RunPaused", "RunResult", "select_clients"]


class RunPaused(KeyboardInterrupt):
    """A run stopped on purpose after a checkpoint (bench/advance_runs.py): resumable."""


@dataclass
class RunResult:
    """The end of a run: the final global weights, the last evaluation (fine-tuned where the
    algorithm fine-tunes) and every round's record (this run's: a resumed run's earlier rounds
    are in its metrics.jsonl)."""

    global_weights: Weights
    final: EvalReport
    records: list[RoundRecord]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The records as metrics.jsonl holds them."""
        return [r.to_json() for r in self.records]


class Rounds(Driver):
    """train.mode = "sync": per round, select clients (a pure function of seed and round), ask
    the algorithm for the plan, dispatch it, check every update against the round contract and
    fold the valid ones into a streaming aggregate as they arrive, step the server if the round
    has its quorum, evaluate when due."""

    def __init__(self, book: Ledger):
        self.book = book
        #: [hierarchy]: the run's edge sites (sites.py); None: one tier
        self.sites = EdgeSites(book) if book.cfg.hierarchy else None

    def run_round(self, t: int) -> RoundRecord:
        """Round t, top to bottom; returns its record."""
        book = self.book
        start = time.perf_counter()
        # 1. select: who trains (a pure function of seed and round) and what the plan asks
        selected = book.select(t)
        plan, needed = book.plan(t)
        down = {c: book.client_bytes_down(c, plan, needed) for c in selected}
        timing, trainers, enough = self._over_selection(t, selected, plan, down)
        # 2. the round's contract (what a valid update looks like) and its aggregate: the plain
        #    weighted sum, [privacy]'s noised sum, or [secagg]'s secure sum feeding either,
        #    whose key stages run now (privacy/dp.py, privacy/secure_sum.py)
        contract = book.contract(t, trainers, plan, book.offered(), book.delta_bound())
        # (with edge sites, a secure sum runs within each site: sites.py)
        got = book.updates(t, None if self._at_sites() else trainers, contract.reference)
        contract, relay = secure_stages(contract, got.aggregate)
        # 3. send and collect: the pool dispatches the plan; every update is checked against
        #    the contract and the valid ones folded into the aggregate as they arrive
        if trainers:  # Poisson sampling ([privacy]) may draw nobody: nothing to dispatch
            self._send_and_collect(t, trainers, plan, needed, enough, contract, relay, got)
        for c in trainers:  # [privacy] level = "record": their DP-SGD steps count
            book.privacy.spent(c, plan)
        self._no_device_can_train(selected, got.reported, got.outcome)
        # 4. aggregate: the server step, where the round has its quorum (the noise is added and
        #    the secure sum unmasked here)
        refused = book.apply(t, got)
        # 5. evaluate, when due
        wire = add_wire(got.outcome.wire, book.evaluate_if_due(t))
        # 6. record: the round's row
        rec = book.row(t, plan, got, refused, selected, trainers, sum(down.values()), start)
        if got.outcome.deadline_s is not None:  # a fleet: its deadlines, what the devices measured
            record_transport(rec, got.outcome)
            rec.set_device_energy(got.costs)
            rec.set_paces(got.paces)
        if wire is not None:  # measured on the coordinator's connection, this round's steps
            rec.wire_bytes_out, rec.wire_bytes_in = wire
        rec.cancelled = sorted(set(selected) - set(trainers)) or got.outcome.cancelled
        if timing is not None:
            self._advance_clock(rec, timing, trainers)
        if self.sites is not None:
            self._record_sites(t, rec, got, trainers, plan, down, needed)
        return rec

    def _at_sites(self) -> bool:
        """Whether updates are folded at edge sites ([hierarchy] with edge aggregation)."""
        return self.sites is not None and self.book.cfg.hierarchy.edge_aggregation

    def _record_sites(self, t: int, rec: RoundRecord, got: RoundUpdates, trainers: list[int],
                      plan: ClientPlan, down: dict[int, int], needed: list[str]) -> None:
        """[hierarchy]: what reached the coordinator, and the round on the simulated fleet
        over the sites' tree (sites.py `EdgeSites.timing`)."""
        assert self.sites is not None
        book = self.book
        if book.cfg.hierarchy.edge_aggregation:
            rec.upstream_messages, rec.upstream_bytes = self.sites.upstream
            if book.cfg.secagg.enabled and rec.status == "ok":
                rec.secure_recovered = self.sites.recovered
            if self.sites.excluded:
                rec.excluded = self.sites.excluded
            if got.outcome.device_failures and got.outcome.deadline_s is None:
                rec.device_failures = got.outcome.device_failures  # a site's round that failed
        else:
            rec.upstream_messages, rec.upstream_bytes = len(got.reported), got.bytes_up
        if book.fleet is not None and trainers:
            end, trained = self.sites.timing(t, trainers, plan, down, needed)
            rec.set_virtual(end, book.clock + end, energy_j(book.fleet, end, trained))
            book.clock += end

    def _over_selection(self, t: int, selected: list[int], plan: ClientPlan, down: dict[int, int]
                        ) -> tuple[dict[int, ClientTiming] | None, list[int], int | None]:
        """The simulated fleet's timing of the round (None without [fleet]), who trains, and how
        many valid updates are enough. Over-selection: the first clients_per_round() updates to
        arrive count; the others are cancelled (on a simulated fleet by its clock: they are not
        trained; on a real one the pool stops waiting for them, `enough`)."""
        book, cfg = self.book, self.book.cfg
        timing = (self._timing(t, selected, plan, down)
                  if book.fleet is not None and self.sites is None else None)
        trainers, enough = selected, None
        if len(selected) > cfg.clients_per_round() and not cfg.privacy.client_level:
            if timing is not None:
                first = sorted(selected, key=lambda c: (timing[c].arrival, c))
                trainers = sorted(first[:cfg.clients_per_round()])
            else:
                enough = cfg.clients_per_round()
        return timing, trainers, enough

    def _timing(self, key: int, clients: list[int], plan: ClientPlan, down: dict[int, int]
                ) -> dict[int, ClientTiming]:
        """When each of a round's clients would start, train and arrive on the simulated fleet."""
        book = self.book
        assert book.fleet is not None
        flops = {c: book.flops(c, plan) for c in clients}
        return sync_round(book.fleet, clients, flops, down, book.upload_size(plan), key)

    def _advance_clock(self, rec: RoundRecord, timing: dict[int, ClientTiming],
                       counted: list[int]) -> None:
        """A synchronous round on the simulated fleet lasts until its last counted update has
        arrived (with none: until every client's has); a cancelled client trained until then."""
        book = self.book
        assert book.fleet is not None
        end = max(timing[c].arrival for c in counted or timing)
        trained = {c: min(x.train_s, max(0.0, end - x.start)) for c, x in timing.items()}
        rec.set_virtual(end, book.clock + end, energy_j(book.fleet, end, trained))
        book.clock += end

    def _send_and_collect(self, t: int, trainers: list[int], plan: ClientPlan, needed: list[str],
                          enough: int | None, contract: RoundContract,
                          relay: dict[str, SecureSum], got: RoundUpdates) -> None:
        """Dispatch the round and fold every valid update into `got`'s aggregate as it arrives
        (in client order: the same sums in simulation and deployment); `enough`: the pool stops
        waiting once that many valid updates came (over-selection on a real fleet); `relay`:
        the secure stages the pool relays between devices; with edge sites, each site's
        rounds and its partial (sites.py). Then the norms' outliers."""
        book = self.book

        checker = got.checker(t)

        # The pool yields only updates that passed `check`, at most one per client, in client
        # order; `rejected` keeps every refusal, also of a client whose valid update came later.
        with torch_threads(book.collect_threads):
            if self.sites is not None and self._at_sites():
                self.sites.train(t, trainers, plan, needed, contract, got, checker)
            else:
                dispatch = book.pool.train(t, trainers, plan,
                                           book.sent(in_blocks(book.offered(), needed)),
                                           checker(contract), enough, **relay)
                for update in dispatch:
                    book.fold(got, update, plan)
                    got.costs[update.client] = (update.device, update.cost)
                got.outcome = dispatch.outcome
        factor = book.cfg.aggregation.outlier_factor
        got.outliers, median = outliers(got.norms, factor)
        for c in got.outliers:
            log.warning("round %d: update of client %d has norm %.4g, > %g x the round's median %.4g",
                        t, c, got.norms[c], factor, median)

    @staticmethod
    def _no_device_can_train(selected: list[int], reported: list[int],
                             outcome: RoundOutcome) -> None:
        """A run that cannot make progress stops with the devices' own reasons: nothing came, the
        selected clients' devices said why, and no other device of the fleet could train (one
        failing device holding a whole round's selection is that round's loss, not the run's)."""
        if (not reported and outcome.device_failures and set(selected) <= outcome.blocked
                and not outcome.able_devices):
            raise TransportError("no device can train: " + "; ".join(
                f"{d}: {r}" for d, r in sorted(outcome.device_failures.items())) + " (fix it on "
                "the devices, check with fedseq-client doctor, then start the run again)")

    def rounds_done(self) -> None:
        """Nothing to settle: every round ended with its updates."""

    def state(self) -> dict[str, Any] | None:
        return None

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            raise ConfigError("--resume: the checkpoint is an asynchronous run's; resume it with "
                              "train.mode = \"async\"")

    def pool_state(self, state: PoolState) -> PoolState:
        return state


def default_driver(book: Ledger) -> Driver:
    """The driver train.mode names: `Rounds`, or `BufferedAsync` on the simulated fleet."""
    if book.cfg.train.mode == "async":
        from fedseq.server.rounds.buffered import BufferedAsync, VirtualArrivals

        return BufferedAsync(book, VirtualArrivals)
    return Rounds(book)


class Coordinator:
    """One federated run over a ClientPool: `run` restores from a checkpoint, makes every round
    with its driver (default: the one train.mode names), writes a checkpoint and then the row
    after each, and ends with the algorithm's fine-tuning and the run directory's outputs."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        algorithm: Algorithm,
        model: BlockModel,
        data: FederatedData,
        pool: ClientPool,
        run_dir: RunDir | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        collect_threads: int | None = None,
        pause_after: int | None = None,
        driver: DriverFactory | None = None,
    ):
        check_budget(cfg)  # [privacy]: a run over its epsilon budget does not start
        self.book = Ledger(cfg, algorithm, model, data, pool, collect_threads)
        check_record_level(cfg, algorithm, model)  # (after the ledger prepared the algorithm)
        said = statement(cfg, count_params(model, algorithm.shared_blocks()))
        if said is not None:
            log.warning("%s", said)
        self.driver = (driver or default_driver)(self.book)
        self.cfg, self.alg, self.model, self.data, self.pool = cfg, algorithm, model, data, pool
        self.run_dir = run_dir
        self.on_round = on_round or (lambda row: None)
        self.on_progress = on_progress or (lambda done, total: None)  # fine-tuning: clients done
        #: stop (resumably, after its checkpoint) once this many rounds are complete
        self.pause_after = pause_after

    @property
    def global_weights(self) -> Weights:
        """The current global model (the ledger's)."""
        return self.book.global_weights

    def run_round(self, t: int) -> RoundRecord:
        """Round (or server step) t by the driver; its record."""
        return self.driver.run_round(t)

    def run(self, resume: Checkpoint | None = None) -> RunResult:
        """All rounds (after the checkpoint's last complete one when resuming), a checkpoint
        after each, then the algorithm's fine-tuning; writes the run directory's outputs."""
        book = self.book
        records = []
        first = self._restore(resume) if resume is not None else 0
        if resume is None:
            book.broadcast(initial=True)  # its first version; a resumed run's is checkpointed
        if resume is not None and self.run_dir is not None:
            # the pool's step numbers and block versions now start past the checkpoint's: record
            # that before anything is published, so that a crash before this run's first round
            # ends cannot make a second resume re-use numbers the devices have already seen
            save_checkpoint(self.run_dir.path, self._checkpoint(first, resume.loop.last_row))
        self.pool.open(book.sent(book.offered(), self.alg.personal_blocks()),
                       self.alg.personal_blocks())
        if (reached := book.over_budget(first)) is not None:
            raise ConfigError(self._over_budget(first, reached) + "; raise the budget or "
                              "privacy.noise_multiplier")
        rounds = self.cfg.rounds
        for t in range(first, self.cfg.rounds):
            rec = self.driver.run_round(t)
            records.append(rec)
            if (reached := book.over_budget(t + 1)) is not None:  # t was evaluated as the last
                rec.stopped = self._over_budget(t + 1, reached) + "; the federated rounds end here"
                log.warning("%s", rec.stopped)
                rounds = t + 1
            # checkpoint first, then the row: a row in metrics.jsonl always has its checkpoint,
            # and a stop in between is healed on resume (the checkpoint holds the row)
            if self.run_dir is not None:
                save_checkpoint(self.run_dir.path, self._checkpoint(t + 1, rec))
            self._emit(rec)
            if rec.stopped is not None:
                break
            if self.pause_after is not None and t + 1 >= self.pause_after and t + 1 < self.cfg.rounds:
                raise RunPaused(f"paused after round {t} (resume to continue)")
        self.driver.rounds_done()
        final = book.last_report
        assert final is not None
        plan = self.alg.finetune_plan()
        if plan is not None:
            final, rec = self._finetune(plan, final, rounds)
            records.append(rec)
            self._emit(rec)
        if self.run_dir is not None:
            self.run_dir.write_outputs(self.data, final.per_client, book.global_weights, self.cfg)
        return RunResult(book.global_weights, final, records)

    def _over_budget(self, t: int, reached: float) -> str:
        """What privacy.target_epsilon says of round t, which would take a client to `reached`."""
        p = self.cfg.privacy
        return (f"privacy.target_epsilon = {p.target_epsilon:g}: round {t} would take a client "
                f"to epsilon {reached:.3g} at delta {p.delta:g}")

    def _finetune(self, plan: ClientPlan, last: EvalReport, rounds: int
                  ) -> tuple[EvalReport, RoundRecord]:
        """The algorithm's final fine-tuning on every client after `rounds` federated rounds:
        the final evaluation (the last global score, the fine-tuned personalized ones) and its
        row."""
        book = self.book
        start = time.perf_counter()
        ft = self.pool.finetune(plan, book.sent(book.global_weights, self.alg.personal_blocks()),
                                (self.model.spec.head,), book.check_score, self.on_progress)
        final = EvalReport(last.global_correct, last.global_total, ft.scores, last.federated)
        tuned = sorted(ft.scores)
        rec = RoundRecord(
            round=rounds, phase="finetune",
            global_acc=final.global_acc, personal_acc=final.personal_acc,
            **({"federated_acc": final.federated_acc} if final.federated else {}),
            local_acc=final.personal_acc,  # the fine-tuned models are the local ones
            clients=tuned,
            finetune_epochs=self.cfg.algorithm.finetune_epochs,
            trainable_params=count_params(self.model, plan.trainable),
            # the fine-tuning's measured training compute (as a round's train_flops)
            train_flops=sum(plan_flops(self.model, plan, self.data, self.data.clients[c],
                                       book.flop_cache) for c in tuned),
            client_steps=sum(plan_steps(plan, self.data, self.data.clients[c]) for c in tuned),
            seconds=round(time.perf_counter() - start, 3),
            # clients whose fine-tuning hit a NaN or Inf loss -> the batch where it stopped;
            # their scores (in P) are their diverged models'
            diverged=dict(sorted(ft.diverged.items())),
        )
        if self.cfg.privacy.enabled:  # fine-tuning sends nothing back: the rounds' budget
            rec.epsilon = book.privacy.epsilon(self.cfg.rounds)
        if rec.diverged:
            log.warning("fine-tuning diverged (NaN or Inf loss) for clients %s: their scores "
                        "are their diverged models' (lower train.lr to avoid it)",
                        ", ".join(map(str, rec.diverged)))
        if ft.energy is not None:  # a fleet: the fine-tuning's joules as the devices measured
            rec.set_energy(ClientEnergy(clients=dict(sorted(ft.energy.items())),
                                        unmeasured=sorted(set(tuned) - set(ft.energy))))
        return final, rec

    def _checkpoint(self, next_round: int, row: RoundRecord | None) -> Checkpoint:
        book = self.book
        return Checkpoint(next_round, book.global_weights,
                          book.loop_state(row, self.driver.state()),
                          self.driver.pool_state(self.pool.snapshot()), self.alg.server_state(),
                          book.rule.state())

    def _restore(self, ckpt: Checkpoint) -> int:
        """Continue after the checkpoint's last complete round; returns the next round."""
        if ckpt.loop.driver is not None and self.driver.state() is None:
            raise ConfigError("--resume: the checkpoint is an asynchronous run's; resume it with "
                              "train.mode = \"async\"")
        self.book.restore(ckpt)
        self.driver.restore(ckpt.loop.driver)
        row = ckpt.loop.last_row
        if row is not None and self.run_dir is not None and \
                row.round not in self.run_dir.logged_rounds:
            self._emit(row)  # stopped after the checkpoint, before its row was written
        return ckpt.next_round

    def _emit(self, row: RoundRecord) -> None:
        if self.run_dir is not None:
            self.run_dir.log_round(row)
        self.on_round(row)


def record_transport(rec: RoundRecord, outcome: RoundOutcome) -> None:
    """What a transport with deadlines (a fleet) saw of a round, onto its row: the deadline, who
    sent each update, which devices could not train, late updates, the slowest device."""
    assert outcome.deadline_s is not None
    rec.deadline_s = float(f"{outcome.deadline_s:.1f}")
    rec.reporters = dict(sorted(outcome.reporters.items()))
    rec.device_failures = outcome.device_failures
    rec.late_updates = outcome.late_updates
    rec.missed_deadline = outcome.missed_deadline
    rec.slowest_device = None if outcome.slowest is None else SlowestDevice(
        device=outcome.slowest[0], waited_s=round(outcome.slowest[1], 3))
