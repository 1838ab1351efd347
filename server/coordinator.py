"""The round loop: select clients, send what they need, aggregate what comes back, evaluate.

It owns every decision of a run: who is selected, which update counts (the round contract), whether
a round has its quorum, when to evaluate, what a checkpoint holds. It talks to a ClientPool (in
process or MQTT, server/pool.py) that only transports, and to a RunDir that only writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedseq.common.algorithms import Algorithm
from fedseq.common.algorithms.aggregate import ClientUpdate, DeviceCost
from fedseq.common.algorithms.plan import ClientPlan, ordered_union
from fedseq.common.algorithms.robust import Aggregator, make_aggregator, update_norm
from fedseq.common.codecs import encode, expected
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData
from fedseq.common.errors import AggregationError, ConfigError, TransportError
from fedseq.common.evaluation import EvalReport, evaluate, pooled_accuracy
from fedseq.common.flops import FlopCache, plan_flops, plan_steps
from fedseq.common.models import BlockModel, Weights, block_of, count_params, get_blocks, in_blocks
from fedseq.common.protocol.tensors import frame_size
from fedseq.common.seeding import numpy_rng
from fedseq.server.checkpoint import Checkpoint, LoopState, save_checkpoint
from fedseq.server.fleet import ClientTiming, VirtualFleet, energy_j, sync_round
from fedseq.server.pool import ClientPool, RoundOutcome
from fedseq.server.privacy import (
    NoisedSum,
    check_budget,
    epsilon,
    next_clip,
    poisson_clients,
    update_noise,
)
from fedseq.server.records import ClientEnergy, Rejection, RoundRecord
from fedseq.server.rundir import RunDir
from fedseq.server.validation import (
    RoundContract,
    parameter_scale,
    round_contract,
    score_problem,
)

log = logging.getLogger(__name__)


def select_clients(seed: int, round: int, num_clients: int, per_round: int) -> list[int]:
    """The round's participants: a pure function of (seed, round)."""
    rng = numpy_rng(seed, "select", round)
    return sorted(int(c) for c in rng.choice(num_clients, per_round, replace=False))


def outliers(norms: dict[int, float], factor: float) -> tuple[list[int], float]:
    """Clients whose update norm exceeds factor x the round's median norm, and that median."""
    if len(norms) < 3:
        return [], 0.0
    median = float(np.median(list(norms.values())))
    return sorted(c for c, n in norms.items() if n > factor * median), median


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with n torch threads (None: as it is), then restore the count."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RunPaused(KeyboardInterrupt):
    """A run stopped on purpose after a checkpoint (bench/advance_runs.py): resumable."""


@dataclass
class RoundUpdates:
    """One round's valid updates, folded into `aggregate` as they arrived, with what the round's
    row reports about them."""

    aggregate: Aggregator
    reported: list[int] = field(default_factory=list)  # clients whose update counted, in order
    local_scores: dict[int, tuple[int, int]] = field(default_factory=dict)  # fresh local scores
    rejected: dict[int, Rejection] = field(default_factory=dict)  # client -> why, every refusal
    norms: dict[int, float] = field(default_factory=dict)
    outliers: list[int] = field(default_factory=list)
    flops: int = 0
    steps: int = 0
    bytes_up: int = 0
    #: client -> (its training seconds where it trained, the FLOPs counted for it)
    paces: dict[int, tuple[float, int]] = field(default_factory=dict)
    costs: dict[int, tuple[str | None, DeviceCost | None]] = field(default_factory=dict)
    outcome: RoundOutcome = field(default_factory=RoundOutcome)
    within: int = 0  # [privacy] adaptive clipping: counted updates within the clip norm


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


class Coordinator:
    """One federated run's round loop over a ClientPool.

    Per round (`run_round`): select clients (a pure function of seed and round), ask the
    algorithm for the plan, dispatch it, check every update against the round contract and fold
    the valid ones into a streaming aggregate as they arrive, apply it if the round has its
    quorum, evaluate, and write the round's row. `run` adds checkpoints after every round, resume,
    and the final fine-tuning.

    `collect_threads`: torch threads while updates are collected (a deployment uses 1: checking
    and folding in an update is memory-bound, and OpenMP threads would spin on the cores the
    broker and the network thread need); None leaves the count as it is (simulation).
    """

    #: simulated time ([fleet]): the virtual clock, seconds since the run's start
    clock: float

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
    ):
        self.cfg = cfg
        self.alg = algorithm
        self.model = model
        self.data = data
        self.pool = pool
        self.run_dir = run_dir
        self.on_round = on_round or (lambda row: None)
        self.on_progress = on_progress or (lambda done, total: None)  # fine-tuning: clients done
        self.collect_threads = collect_threads
        self.global_weights = get_blocks(model, model.spec.blocks)
        #: stop (resumably, after its checkpoint) once this many rounds are complete
        self.pause_after = pause_after
        algorithm.prepare([len(c.train) for c in data.clients])
        check_budget(cfg)  # [privacy]: a run over its epsilon budget does not start
        #: [privacy]: the clip norm of the next round (adaptive clipping moves it)
        self.clip = cfg.privacy.clip_norm
        # Block versions: version 0 of every block is the seed-derived initial model. bytes_down
        # counts a block for a client when the client does not hold its current version; a client
        # holds nothing before its first round (-1): a deployment does send version 0.
        self.version = dict.fromkeys(model.spec.blocks, 0)
        self.client_version = {c.client: dict.fromkeys(model.spec.blocks, -1)
                               for c in data.clients}
        # what the algorithm sends besides the model (SCAFFOLD's control variate), as of its
        # last change; its blocks are versioned with the model's
        self.extra: Weights = {}
        # the wire codecs (common/codecs.py): the updates' and the global blocks' (the clients
        # get `_sent`, the downlink's form of the current version; this master copy stays float32)
        self.up, self.down = cfg.wire.codec("up"), cfg.wire.codec("down")
        self._down_cache: dict[str, tuple[int, Weights]] = {}  # block -> (version, its wire form)
        self._frame_sizes: dict[tuple[str, int], int] = {}
        self._update_sizes: dict[tuple, int] = {}  # tensors' (name, dtype, shape) -> frame bytes
        self._last_report: EvalReport | None = None
        # client -> (correct, total) of its most recent locally trained model (FedReG's testbed)
        self.local_scores: dict[int, tuple[int, int]] = {}
        self.flop_cache: FlopCache = {}
        # simulated time ([fleet]): the devices' paces and links, and the virtual clock (seconds
        # since the run's start); None: no model of time
        self.fleet = VirtualFleet(cfg) if cfg.fleet else None
        self.clock = 0.0
        self._upload_sizes: dict[tuple[str, ...], int] = {}

    # -- one round -------------------------------------------------------------------------
    def run_round(self, t: int) -> RoundRecord:
        """Train, aggregate and (when due) evaluate round t; returns its record."""
        start = time.perf_counter()
        selected = self._select(t)
        plan, needed = self._plan(t)
        down = {c: self._client_bytes_down(c, plan, needed) for c in selected}
        bytes_down = sum(down.values())
        # over-selection: the first clients_per_round() updates to arrive count; the others are
        # cancelled (on a simulated fleet, by its clock: they are not trained; on a real one the
        # pool stops waiting for them)
        timing = self._timing(t, selected, plan, down) if self.fleet is not None else None
        trainers, enough = selected, None
        if len(selected) > self.cfg.clients_per_round() and not self.cfg.privacy.enabled:
            if timing is not None:
                first = sorted(selected, key=lambda c: (timing[c].arrival, c))
                trainers = sorted(first[:self.cfg.clients_per_round()])
            else:
                enough = self.cfg.clients_per_round()
        got = self._train(t, trainers, plan, needed, enough)
        self._no_device_can_train(selected, got.reported, got.outcome)
        refused = self._apply(t, got)
        wire = add_wire(got.outcome.wire, self._evaluate_if_due(t))
        rec = self._row(t, plan, got, refused, selected, trainers, bytes_down, start)
        if got.outcome.deadline_s is not None:  # a fleet: its deadlines, what the devices measured
            rec.set_transport(got.outcome)
            rec.set_device_energy(got.costs)
            rec.set_paces(got.paces)
        if wire is not None:  # measured on the coordinator's connection, this round's steps
            rec.wire_bytes_out, rec.wire_bytes_in = wire
        rec.cancelled = sorted(set(selected) - set(trainers)) or got.outcome.cancelled
        if timing is not None:
            self._advance_clock(rec, timing, trainers)
        return rec

    def _select(self, t: int) -> list[int]:
        """Round t's clients: train.join_ratio x the clients, or under [privacy] each client
        with that probability (Poisson sampling, what the accountant assumes)."""
        n = self.cfg.data.num_clients
        if self.cfg.privacy.enabled:
            return poisson_clients(self.cfg.seed_for("selection"), t, n, self.cfg.train.join_ratio)
        return select_clients(self.cfg.seed_for("selection"), t, n, self.cfg.selected_per_round())

    def _aggregator(self, t: int) -> Aggregator:
        """A fresh aggregate for round (or server step) t: the configured rule, or under
        [privacy] DP-FedAvg's noised sum over the expected number of clients."""
        p = self.cfg.privacy
        if p.enabled:
            expected = self.cfg.train.join_ratio * self.cfg.data.num_clients
            return NoisedSum(self.clip, update_noise(self.cfg), expected,
                             self.cfg.seed_for("noise"), t)
        return make_aggregator(self.cfg.aggregation)

    def _epsilon(self, rounds: int) -> float | None:
        """[privacy]: epsilon after `rounds` rounds at privacy.delta; None without it."""
        p = self.cfg.privacy
        return (epsilon(self.cfg.train.join_ratio, p.noise_multiplier, rounds, p.delta)
                if p.enabled else None)

    def _evaluate_if_due(self, t: int) -> tuple[int, int] | None:
        """Evaluate after round t when it is due (train.eval_every, and the last round): the
        report is kept for the round's row; returns the step's wire bytes."""
        self._last_report, wire = None, None
        if (t + 1) % self.cfg.train.eval_every == 0 or t == self.cfg.rounds - 1:
            self._last_report, wire = self._evaluate()
        return wire

    def _row(self, t: int, plan: ClientPlan, got: RoundUpdates, refused: str | None,
             clients: list[int], trainers: list[int], bytes_down: int, start: float
             ) -> RoundRecord:
        """Round t's row from what it got (`refused`: why its aggregate did not count; None: it
        did), its clients, those of them that trained and its last evaluation."""
        report, counted = self._last_report, refused is None
        rec = RoundRecord(
            round=t, phase="train",
            global_acc=report.global_acc if report else None,
            personal_acc=report.personal_acc if report else None,
            local_acc=self._local_acc(report) if report else None,
            round_local_acc=pooled_accuracy(got.local_scores.values()) if counted else None,
            clients=clients,
            reported=got.reported if counted else [],
            status="ok" if counted and got.reported else "failed",
            failed=sorted(set(trainers) - set(got.reported if counted else [])),
            rejected={c: r.text for c, r in sorted(got.rejected.items())},
            outliers=got.outliers if counted else [],
            bytes_down=bytes_down, bytes_up=got.bytes_up,
            trainable_params=count_params(self.model, plan.trainable),
            uploaded_blocks=list(plan.upload),
            train_flops=got.flops, client_steps=got.steps,
            seconds=round(time.perf_counter() - start, 3),
        )
        if self.alg.global_model_note or self.cfg.model.norm == "fedbn":
            notes = [self.alg.global_model_note or "the aggregated model"]
            if self.cfg.model.norm == "fedbn":
                notes.append("normalization layers at their initial values (FedBN: personal)")
            rec.global_model = "; ".join(notes)
        if got.rejected:
            rec.refusals = {c: r.code for c, r in sorted(got.rejected.items())}
        if refused is not None:
            rec.quorum_failed, rec.received = refused, sorted(got.reported)
        if self.cfg.privacy.enabled:
            rec.epsilon = self._epsilon(t + 1)
            if self.cfg.privacy.adaptive:
                rec.clip_norm = plan.clip
        return rec

    def _plan(self, t: int) -> tuple[ClientPlan, list[str]]:
        """Round t's plan (in the uplink's codec) and the blocks a client must hold to run it:
        the whole base (every forward pass runs it, frozen blocks too) and the heads the plan
        reads, less its personal blocks, and what the algorithm broadcasts."""
        plan = self.alg.plan(t)
        if self.up.name != "none":
            plan = dataclasses.replace(plan, codec=self.up.spec)
        if plan.clip is not None and plan.clip != self.clip:  # adaptive clipping's current C
            plan = dataclasses.replace(plan, clip=self.clip)
        needed = [b for b in ordered_union((self.model.spec.base, plan.uses))
                  if b not in plan.personal] + list(dict.fromkeys(map(block_of, self.extra)))
        return plan, needed

    def _client_bytes_down(self, client: int, plan: ClientPlan, needed: list[str]) -> int:
        """What `client` is sent for `plan`: the `needed` blocks it lacks and, on its first
        round, the initial version of its personal blocks (a device starts a client's personal
        blocks from the published version 0)."""
        return self._bytes_down(client, needed + [b for b in plan.personal
                                                  if self.client_version[client][b] < 0])

    def _timing(self, key: int, clients: list[int], plan: ClientPlan, down: dict[int, int]
                ) -> dict[int, ClientTiming]:
        """When each of a round's clients would start, train and arrive on the simulated fleet."""
        assert self.fleet is not None
        flops = {c: plan_flops(self.model, plan, self.data, self.data.clients[c], self.flop_cache)
                 for c in clients}
        return sync_round(self.fleet, clients, flops, down, self._upload_size(plan), key)

    def _upload_size(self, plan: ClientPlan) -> int:
        """The frame bytes of an update to `plan` in the uplink's codec (simulated time)."""
        if plan.upload not in self._upload_sizes:
            reference = {k: v for k, v in self.offered().items() if block_of(k) in plan.upload
                         and k not in self.model.personal_keys()}
            coded = {k: torch.empty(shape, dtype=dtype)  # sized, never filled
                     for k, (dtype, shape) in expected(reference, self.up).items()}
            self._upload_sizes[plan.upload] = frame_size(coded)
        return self._upload_sizes[plan.upload]

    def _advance_clock(self, rec: RoundRecord, timing: dict[int, ClientTiming],
                       counted: list[int]) -> None:
        """A synchronous round on the simulated fleet lasts until its last counted update has
        arrived (with none: until every client's has); a cancelled client trained until then."""
        assert self.fleet is not None
        end = max(timing[c].arrival for c in counted or timing)
        trained = {c: min(x.train_s, max(0.0, end - x.start)) for c, x in timing.items()}
        rec.set_virtual(end, self.clock + end, energy_j(self.fleet, end, trained))
        self.clock += end

    def _train(self, t: int, selected: list[int], plan: ClientPlan, needed: list[str],
               enough: int | None = None) -> RoundUpdates:
        """Dispatch the round and fold every valid update into a fresh aggregate as it arrives
        (in client order: the same sums in simulation and deployment); `enough`: the pool stops
        waiting once that many valid updates came (over-selection on a real fleet)."""
        contract = self._contract(t, selected, plan, self.offered(), self._delta_bound())
        got = RoundUpdates(self._aggregator(t))
        if not selected:  # Poisson sampling ([privacy]) drew nobody: nothing to dispatch
            return got

        def check(update: ClientUpdate) -> Rejection | None:
            reason = contract.check(update)
            if reason is not None:
                log.warning("round %d: rejected update of client %d: %s", t, update.client, reason)
                got.rejected[update.client] = reason
            return reason

        # The pool yields only updates that passed `check`, at most one per client, in client
        # order; `rejected` keeps every refusal, also of a client whose valid update came later.
        with torch_threads(self.collect_threads):
            dispatch = self.pool.train(t, selected, plan,
                                       self._sent(in_blocks(self.offered(), needed)), check,
                                       enough)
            for update in dispatch:
                self._fold(got, update, plan)
                got.costs[update.client] = (update.device, update.cost)
        got.outcome = dispatch.outcome
        got.outliers, median = outliers(got.norms, self.cfg.aggregation.outlier_factor)
        for c in got.outliers:
            log.warning("round %d: update of client %d has norm %.4g, > %g x the round's median %.4g",
                        t, c, got.norms[c], self.cfg.aggregation.outlier_factor, median)
        return got

    def _contract(self, t: int, clients: list[int], plan: ClientPlan, offered: Weights,
                  bound: float) -> RoundContract:
        """What a valid update of round t (or model version t) looks like, for `clients` under
        `plan`, given what they were `offered` and the bound on their deltas."""
        return round_contract(t, clients, plan.upload, offered, self.data,
                              plan.rebalance_threshold, bound, self.model.personal_keys(),
                              self.alg.upload_bound, self.up, plan.clip)

    def _fold(self, got: RoundUpdates, update: ClientUpdate, plan: ClientPlan,
              scale: float = 1.0) -> None:
        """Fold one valid update trained under `plan` into the aggregate, its deltas scaled by
        `scale` (an asynchronous step's staleness discount), with what the row reports of it:
        its (unscaled) norm, local score, FLOPs, steps and bytes."""
        deltas = update.deltas if scale == 1.0 else {k: v * scale for k, v in
                                                      update.deltas.items()}
        got.aggregate.add(deltas, self.alg.aggregation_weights(update), update.client,
                          update.device)
        got.norms[update.client] = update_norm(update.deltas)
        got.reported.append(update.client)
        got.within += bool(update.under_clip)
        if update.local_score is not None:
            got.local_scores[update.client] = update.local_score
        shard = self.data.clients[update.client]
        flops = plan_flops(self.model, plan, self.data, shard, self.flop_cache)
        got.flops += flops
        got.paces[update.client] = (update.train_seconds, flops)
        got.steps += plan_steps(plan, self.data, shard)
        got.bytes_up += (update.upload_bytes if update.upload_bytes is not None
                         else self._update_bytes(update.deltas))

    def _delta_bound(self) -> float:
        """aggregation.max_abs_delta for this round (auto: from the scale of the global model's
        parameters; running statistics, which a device's updates move, have bounds of their own,
        validation.statistic_problem)."""
        return self.cfg.aggregation.delta_bound(parameter_scale(self.global_weights))

    def _apply(self, t: int, got: RoundUpdates) -> str | None:
        """Apply the round's aggregate if the round counts; else say why it does not (too few
        valid updates, or a non-finite aggregate): then the global model stays as it was, and
        what was folded in is discarded (the FLOPs were spent all the same)."""
        need = self.cfg.deploy.min_updates
        refused = (f"{len(got.reported)} valid updates < deploy.min_updates={need}"
                   if len(got.reported) < need else None)
        if refused is None:
            try:
                new = self.alg.server_update(self.global_weights, got.aggregate)
            except AggregationError as exc:
                refused = str(exc)
        if refused is not None:
            log.warning("round %d failed: %s", t, refused)
            return refused
        for b in {block_of(k) for k, v in new.items() if v is not self.global_weights[k]}:
            self.version[b] += 1
        self.global_weights = new
        self._broadcast()
        self.local_scores.update(got.local_scores)
        if self.cfg.privacy.enabled and self.cfg.privacy.adaptive:
            self.clip = next_clip(self.cfg, self.clip, got.within, t)
        return None

    def offered(self) -> Weights:
        """What clients may be sent: the global model and the algorithm's broadcast."""
        return {**self.global_weights, **self.extra} if self.extra else self.global_weights

    def _broadcast(self, new_versions: bool = True) -> None:
        """Take the algorithm's broadcast for the global model's shared tensors (FedBN's
        normalization layers and the personal blocks left out); a block of it whose tensors
        changed gets a new version (the first one: 0) unless `new_versions` is False (a resumed
        run: its versions are the checkpoint's)."""
        personal = self.model.personal_keys() | {k for k in self.global_weights
                                                 if block_of(k) in self.alg.personal_blocks()}
        extra = self.alg.broadcast({k: v for k, v in self.global_weights.items()
                                    if k not in personal})
        changed = {block_of(k) for k, v in extra.items() if self.extra.get(k) is not v}
        for b in changed if new_versions else ():
            self.version[b] = self.version.get(b, -1) + 1
        self.extra = dict(extra)

    def _sent(self, weights: Weights, personal: tuple[str, ...] = ()) -> Weights:
        """`weights` as the clients receive them: each block (but those named `personal`: a
        client's own, sent once as they are) in the downlink codec, encoded once per version."""
        if self.down.name == "none":
            return weights
        out: Weights = {}
        for b in dict.fromkeys(map(block_of, weights)):
            tensors = in_blocks(weights, b)
            if b in personal:
                out.update(tensors)
                continue
            version = self.version.get(b, 0)
            cached = self._down_cache.get(b)
            if cached is None or cached[0] != version:
                cached = self._down_cache[b] = (version, encode(tensors, self.down)[0])
            out.update(cached[1])
        return out

    def _bytes_down(self, client: int, blocks: list[str]) -> int:
        """Frame bytes of the blocks `client` needs and does not hold at their current version
        (it then holds them), the initial version included. The same definition in simulation
        and deployment."""
        total = 0
        held = self.client_version[client]
        for b in blocks:
            if held.get(b, -1) != self.version[b]:
                key = (b, self.version[b])
                if key not in self._frame_sizes:
                    self._frame_sizes[key] = frame_size(self._sent(
                        in_blocks(self.offered(), b), self.alg.personal_blocks()))
                total += self._frame_sizes[key]
                held[b] = self.version[b]
        return total

    def _no_device_can_train(self, selected: list[int], reported: list[int],
                             outcome: RoundOutcome) -> None:
        """A run that cannot make progress stops with the devices' own reasons: nothing came, the
        selected clients' devices said why, and no other device of the fleet could train (one
        failing device holding a whole round's selection is that round's loss, not the run's)."""
        if (not reported and outcome.device_failures and set(selected) <= outcome.blocked
                and not outcome.able_devices):
            raise TransportError("no device can train: " + "; ".join(
                f"{d}: {r}" for d, r in sorted(outcome.device_failures.items())) + " (fix it on "
                "the devices, check with fedseq-client doctor, then start the run again)")

    def _update_bytes(self, deltas: Weights) -> int:
        """The frame bytes of an update: a function of its tensors' names, dtypes and shapes
        alone, so one round's updates (all alike) are serialized to count them only once."""
        key = tuple((k, v.dtype, tuple(v.shape)) for k, v in deltas.items())
        if key not in self._update_sizes:
            self._update_sizes[key] = frame_size(deltas)
        return self._update_sizes[key]

    def _check_score(self, client: int, correct: int, total: int) -> str | None:
        return score_problem(self.data, client, correct, total)

    def _evaluate(self) -> tuple[EvalReport, tuple[int, int] | None]:
        """Every client's personalized model (by the pool), and the global model on the union of
        the clients' test rows (by the pool where it has them, else here); with the step's wire
        bytes."""
        got = self.pool.evaluate(self._sent(self.global_weights, self.alg.personal_blocks()),
                                 self.alg.eval_heads(), self._check_score)
        report = got.report
        if report.global_total is None or self.down.name != "none":  # the master's score
            glob = evaluate(self.model, self.data, self.global_weights, {}, (self.model.spec.head,),
                            batch=self.cfg.train.eval_batch_size,
                            side=self.alg.client_side(self.alg.client_params()))
            report = EvalReport(glob.global_correct, glob.global_total, report.per_client)
        return report, got.wire

    def _local_acc(self, report: EvalReport) -> float | None:
        """FedReG's testbed personalized accuracy: every client's most recent locally trained
        model on its own test rows; a client that has not trained yet holds what it was sent."""
        return pooled_accuracy(self.local_scores.get(c, r) for c, r in report.per_client.items())

    # -- the run ---------------------------------------------------------------------------
    def run(self, resume: Checkpoint | None = None) -> RunResult:
        """All rounds (after the checkpoint's last complete one when resuming), a checkpoint
        after each, then the algorithm's fine-tuning; writes the run directory's outputs."""
        records = []
        first = self._restore(resume) if resume is not None else 0
        if resume is None:
            self._broadcast()  # its first version; a resumed run's is in the checkpoint
        if resume is not None and self.run_dir is not None:
            # the pool's step numbers and block versions now start past the checkpoint's: record
            # that before anything is published, so that a crash before this run's first round
            # ends cannot make a second resume re-use numbers the devices have already seen
            save_checkpoint(self.run_dir.path, self._checkpoint(first, resume.loop.last_row))
        self.pool.open(self._sent(self.offered(), self.alg.personal_blocks()),
                       self.alg.personal_blocks())
        for t in range(first, self.cfg.rounds):
            rec = self.run_round(t)
            records.append(rec)
            # checkpoint first, then the row: a row in metrics.jsonl always has its checkpoint,
            # and a stop in between is healed on resume (the checkpoint holds the row)
            if self.run_dir is not None:
                save_checkpoint(self.run_dir.path, self._checkpoint(t + 1, rec))
            self._emit(rec)
            if self.pause_after is not None and t + 1 >= self.pause_after and t + 1 < self.cfg.rounds:
                raise RunPaused(f"paused after round {t} (resume to continue)")
        self._rounds_done()
        final = self._last_report
        assert final is not None
        plan = self.alg.finetune_plan()
        if plan is not None:
            final, rec = self._finetune(plan, final)
            records.append(rec)
            self._emit(rec)
        if self.run_dir is not None:
            self.run_dir.write_outputs(self.data, final.per_client, self.global_weights, self.cfg)
        return RunResult(self.global_weights, final, records)

    def _finetune(self, plan: ClientPlan, last: EvalReport) -> tuple[EvalReport, RoundRecord]:
        """The algorithm's final fine-tuning on every client: the final evaluation (the last
        global score, the fine-tuned personalized ones) and its row."""
        start = time.perf_counter()
        ft = self.pool.finetune(plan, self._sent(self.global_weights, self.alg.personal_blocks()),
                                (self.model.spec.head,),
                                self._check_score, self.on_progress)
        final = EvalReport(last.global_correct, last.global_total, ft.scores)
        tuned = sorted(ft.scores)
        rec = RoundRecord(
            round=self.cfg.rounds, phase="finetune",
            global_acc=final.global_acc, personal_acc=final.personal_acc,
            local_acc=final.personal_acc,  # the fine-tuned models are the local ones
            clients=tuned,
            finetune_epochs=self.cfg.algorithm.finetune_epochs,
            trainable_params=count_params(self.model, plan.trainable),
            # the fine-tuning's measured training compute (as a round's train_flops)
            train_flops=sum(plan_flops(self.model, plan, self.data, self.data.clients[c],
                                       self.flop_cache) for c in tuned),
            client_steps=sum(plan_steps(plan, self.data, self.data.clients[c]) for c in tuned),
            seconds=round(time.perf_counter() - start, 3),
            # clients whose fine-tuning hit a NaN or Inf loss -> the batch where it stopped;
            # their scores (in P) are their diverged models'
            diverged=dict(sorted(ft.diverged.items())),
        )
        if self.cfg.privacy.enabled:  # fine-tuning sends nothing back: the rounds' budget
            rec.epsilon = self._epsilon(self.cfg.rounds)
        if rec.diverged:
            log.warning("fine-tuning diverged (NaN or Inf loss) for clients %s: their scores "
                        "are their diverged models' (lower train.lr to avoid it)",
                        ", ".join(map(str, rec.diverged)))
        if ft.energy is not None:  # a fleet: the fine-tuning's joules as the devices measured
            rec.set_energy(ClientEnergy(clients=dict(sorted(ft.energy.items())),
                                        unmeasured=sorted(set(tuned) - set(ft.energy))))
        return final, rec

    def _checkpoint(self, next_round: int, row: RoundRecord | None) -> Checkpoint:
        return Checkpoint(next_round, self.global_weights,
                          LoopState(self.version, self.client_version, self.local_scores,
                                    self._last_report, row, self.clock,
                                    self._driver_state(),
                                    self.clip if self.cfg.privacy.adaptive else None),
                          self.pool.snapshot(), self.alg.server_state())

    def _rounds_done(self) -> None:
        """After the last round, before the fine-tuning: what a driver settles (nothing here)."""

    def _driver_state(self) -> dict[str, Any] | None:
        """What a driver other than this round loop checkpoints besides it (None: nothing)."""
        return None

    def _restore(self, ckpt: Checkpoint) -> int:
        """Continue after the checkpoint's last complete round; returns the next round."""
        if ckpt.loop.driver is not None and self._driver_state() is None:
            raise ConfigError("--resume: the checkpoint is an asynchronous run's; resume it with "
                              "train.mode = \"async\"")
        self.global_weights = {k: ckpt.global_weights[k].to(v.dtype) for k, v in
                               self.global_weights.items()}
        loop = ckpt.loop
        self.version, self.client_version = loop.version, loop.client_version
        self.local_scores, self._last_report = loop.local_scores, loop.last_report
        self.clock = loop.clock
        if loop.clip is not None:  # adaptive clipping's clip norm as it was
            self.clip = loop.clip
        self.pool.restore(ckpt.pool)
        self.alg.load_server_state(ckpt.server)
        self._broadcast(new_versions=False)  # as checkpointed, versions included
        row = loop.last_row
        if row is not None and self.run_dir is not None and \
                row.round not in self.run_dir.logged_rounds:
            self._emit(row)  # stopped after the checkpoint, before its row was written
        return ckpt.next_round

    def _emit(self, row: RoundRecord) -> None:
        if self.run_dir is not None:
            self.run_dir.log_round(row)
        self.on_round(row)


def add_wire(a: tuple[int, int] | None, b: tuple[int, int] | None) -> tuple[int, int] | None:
    """Two steps' (sent, received) bytes together; None where neither was measured."""
    if a is None or b is None:
        return a or b
    return a[0] + b[0], a[1] + b[1]
