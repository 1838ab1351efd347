"""A run's bookkeeping, shared by every driver of its rounds (coordinator.py `Rounds`,
buffered.py `BufferedAsync`): the global model and its block versions, what each client
holds, the plan a round sends, the round contract an update must pass, the fold of a valid update
into the round's aggregate, the server step, the bytes and the virtual clock, evaluation and the
round's row.

A driver decides who trains when and in which order updates count; it asks the ledger for
everything else, so a synchronous round, a buffered-asynchronous server step and a replayed one
count, check, fold and record alike.
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
from fedseq.common.algorithms.aggregate import ClientUpdate, DeviceCost, WeightedDeltaSum
from fedseq.common.algorithms.plan import ClientPlan, ordered_union
from fedseq.common.algorithms.robust import Aggregator, build_rule, update_norm
from fedseq.common.codecs import Codec, encode, expected
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData
from fedseq.common.errors import AggregationError
from fedseq.common.evaluation import EvalReport, evaluate, pooled_accuracy, score_global
from fedseq.common.flops import FlopCache, plan_flops, plan_steps
from fedseq.common.models import BlockModel, Weights, block_of, count_params, get_blocks, in_blocks
from fedseq.common.protocol.tensors import frame_size
from fedseq.common.seeding import numpy_rng
from fedseq.server.privacy.dp import (
    NoisedSum,
    PrivacyAccount,
    expected_clients,
    poisson_clients,
    update_noise,
)
from fedseq.server.privacy.secure_sum import SecureSum, layout_of, round_setup
from fedseq.server.rounds.checkpoint import Checkpoint, LoopState
from fedseq.server.rounds.contract import (
    RoundContract,
    parameter_scale,
    round_contract,
    score_problem,
)
from fedseq.server.rounds.pool_api import ClientPool, RoundOutcome, UpdateCheck
from fedseq.server.rounds.records import Rejection, RoundRecord
from fedseq.server.rounds.virtual_fleet import VirtualFleet

log = logging.getLogger(__name__)


def select_clients(seed: int, round: int, num_clients: int, per_round: int) -> list[int]:
    """The round's participants: a pure function of (seed, round)."""
    rng = numpy_rng(seed, "select", round)
    return sorted(int(c) for c in rng.choice(num_clients, per_round, replace=False))


#: the fewest updates a round needs before one of them is called an outlier: a median of fewer
#: is one or two clients' own norm, which honest non-IID clients differ from by several times
#: (a lab's three-device fleet logged an outlier in 12 of 30 honest rounds)
OUTLIER_MIN_UPDATES = 5


def outliers(norms: dict[int, float], factor: float) -> tuple[list[int], float]:
    """Clients whose update norm exceeds factor x the median of the round's other updates'
    norms, in a round of at least OUTLIER_MIN_UPDATES updates, and the round's median."""
    if len(norms) < OUTLIER_MIN_UPDATES:
        return [], 0.0
    median = float(np.median(list(norms.values())))
    return sorted(c for c, n in norms.items()
                  if n > factor * float(np.median([m for d, m in norms.items() if d != c]))), median


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


def add_wire(a: tuple[int, int] | None, b: tuple[int, int] | None) -> tuple[int, int] | None:
    """Two steps' (sent, received) bytes together; None where neither was measured."""
    if a is None or b is None:
        return a or b
    return a[0] + b[0], a[1] + b[1]


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
    #: client -> (its training seconds where it trained, the FLOPs counted for it), summed over
    #: the round's site rounds ([hierarchy]: a client trained k times counts both k times)
    paces: dict[int, tuple[float, int]] = field(default_factory=dict)
    costs: dict[int, tuple[str | None, DeviceCost | None]] = field(default_factory=dict)
    outcome: RoundOutcome = field(default_factory=RoundOutcome)
    within: int = 0  # [privacy] adaptive clipping: counted updates within the clip norm
    #: client -> the (num_samples, effective_samples) its folded update said (sites.py: what a
    #: site's partial claims), and how often it was folded this round (its site rounds)
    samples: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    folds: dict[int, int] = field(default_factory=dict)
    #: client -> its updates' bytes as they came, this round (where they are counted)
    uploads: dict[int, int] = field(default_factory=dict)
    #: [privacy] adaptive clipping: client -> whether its last update was within the clip norm
    under_clip: dict[int, bool] = field(default_factory=dict)

    def checker(self, t: int) -> Callable[[RoundContract], UpdateCheck]:
        """For a contract of round t (or a site round of it), the check a pool applies to each
        update: the contract's verdict, every refusal logged and kept in `rejected`."""
        def check_with(contract: RoundContract) -> UpdateCheck:
            def check(update: ClientUpdate) -> Rejection | None:
                reason = contract.admit(update)
                if reason is not None:
                    log.warning("round %d: rejected update of client %d: %s", t, update.client,
                                reason)
                    self.rejected[update.client] = reason
                return reason
            return check
        return check_with


class Ledger:
    """The bookkeeping of one run over a ClientPool (module docstring).

    `collect_threads`: torch threads while updates are collected (a deployment uses 1: checking
    and folding in an update is memory-bound, and OpenMP threads would spin on the cores the
    broker and the network thread need); None leaves the count as it is (simulation).
    """

    def __init__(self, cfg: ExperimentConfig, algorithm: Algorithm, model: BlockModel,
                 data: FederatedData, pool: ClientPool, collect_threads: int | None = None):
        self.cfg = cfg
        self.alg = algorithm
        self.model = model
        self.data = data
        self.pool = pool
        self.collect_threads = collect_threads
        self.global_weights = get_blocks(model, model.spec.blocks)
        algorithm.prepare([c.num_train for c in data.clients])
        #: the aggregation rule, built once: its options read, its state kept across rounds
        self.rule = build_rule(cfg.aggregation)
        #: [privacy]: the clip norm, the noise's secret seed, the clients' steps, epsilon
        h = cfg.hierarchy  # a client trains once in each of a round's site rounds
        self.site_rounds = h.edge_rounds if h and h.edge_aggregation else 1
        self.privacy = PrivacyAccount(cfg, data, self.site_rounds)
        # Block versions: version 0 of every block is the seed-derived initial model. bytes_down
        # counts a block for a client when the client does not hold its current version; a client
        # holds nothing before its first round (-1): a deployment does send version 0.
        self.version = dict.fromkeys(model.spec.blocks, 0)
        self.client_version = {c.client: dict.fromkeys(model.spec.blocks, -1)
                               for c in data.clients}
        # what the algorithm sends besides the model (SCAFFOLD's control variate); its blocks
        # are versioned with the model's
        self.extra: Weights = {}
        # the wire codecs (common/codecs.py): the updates' and the global blocks' (the clients
        # get `sent`, the downlink's form of the current version; this master copy stays float32)
        self.up, self.down = cfg.wire.codec("up"), cfg.wire.codec("down")
        if cfg.secagg.enabled:  # the masked input's ring codes the upload (wire.up picks it)
            self.up = Codec()
        self._down_cache: dict[str, tuple[int, Weights]] = {}  # block -> (version, its wire form)
        self._frame_sizes: dict[tuple[str, int], int] = {}
        self._update_sizes: dict[tuple, int] = {}  # tensors' (name, dtype, shape) -> frame bytes
        self._upload_sizes: dict[tuple[str, ...], int] = {}
        #: the last evaluation, kept for the row of the round that made it (None: none due)
        self.last_report: EvalReport | None = None
        #: client -> (correct, total) of its most recent locally trained model (FedReG's testbed)
        self.local_scores: dict[int, tuple[int, int]] = {}
        self.flop_cache: FlopCache = {}
        #: simulated time ([fleet]): the devices' paces and links; None: no model of time
        self.fleet = VirtualFleet(cfg) if cfg.fleet else None
        #: the virtual clock: seconds since the run's start
        self.clock = 0.0
        #: [secagg]: clients left out of every later round, with why: a device of theirs sent
        #: shares proven bad (Ledger.exclude)
        self.excluded: dict[int, str] = {}

    # -- a round's plan and what it sends ---------------------------------------------------
    def select(self, t: int) -> list[int]:
        """Round t's clients: train.join_ratio x the clients, or under [privacy] each client
        with that probability (Poisson sampling, what the accountant assumes)."""
        n = self.cfg.data.num_clients
        if self.cfg.privacy.client_level:
            chosen = poisson_clients(self.cfg.seed_for("selection"), t, n,
                                     self.cfg.train.join_ratio)
        else:
            chosen = select_clients(self.cfg.seed_for("selection"), t, n,
                                    self.cfg.selected_per_round())
        return [c for c in chosen if c not in self.excluded]

    def exclude(self, blamed: dict[int, str], t: int) -> dict[int, str]:
        """Secure round t's clients proven bad (a share that failed its owner's check, shares
        that contradict their own checks, a junk answer: SecAggServer.blamed), and every other
        client of the device that sent them (the pool's `owner`, where it has devices), are
        left out of every later round. The newly excluded, with why."""
        owner: dict[int, str] = getattr(self.pool, "owner", {})
        new: dict[int, str] = {}
        for c, why in sorted(blamed.items()):
            device = owner.get(c)
            for x in sorted({c} | {o for o, d in owner.items() if device and d == device}):
                if x not in self.excluded and x not in new:
                    new[x] = f"round {t}: " + (why if x == c else
                                               f"client {c} of its device {device}: {why}")
        for x, why in new.items():
            log.warning("client %d is left out of the rest of the run (%s)", x, why)
        self.excluded.update(new)
        return new

    def plan(self, t: int) -> tuple[ClientPlan, list[str]]:
        """Round t's plan (in the uplink's codec) and the blocks a client must hold to run it:
        the whole base (every forward pass runs it, frozen blocks too) and the heads the plan
        reads, less its personal blocks, and what the algorithm broadcasts."""
        plan = self.alg.plan(t)
        if self.up.name != "none":
            plan = dataclasses.replace(plan, codec=self.up.spec)
        if plan.clip is not None and plan.clip != self.privacy.clip:  # adaptive clipping's C
            plan = dataclasses.replace(plan, clip=self.privacy.clip)
        needed = [b for b in ordered_union((self.model.spec.base, plan.uses))
                  if b not in plan.personal] + list(dict.fromkeys(map(block_of, self.extra)))
        return plan, needed

    def offered(self) -> Weights:
        """What clients may be sent: the global model and the algorithm's broadcast."""
        return {**self.global_weights, **self.extra} if self.extra else self.global_weights

    def sent(self, weights: Weights, personal: tuple[str, ...] = (), fresh: bool = False
             ) -> Weights:
        """`weights` as the clients receive them: each block (but those named `personal`: a
        client's own, sent once as they are) in the downlink codec, encoded once per version
        (`fresh`: encoded now, not the global version's: a site's model, sites.py)."""
        if self.down.name == "none":
            return weights
        out: Weights = {}
        for b in dict.fromkeys(map(block_of, weights)):
            tensors = in_blocks(weights, b)
            if b in personal:
                out.update(tensors)
                continue
            if fresh:
                out.update(encode(tensors, self.down)[0])
                continue
            version = self.version.get(b, 0)
            cached = self._down_cache.get(b)
            if cached is None or cached[0] != version:
                cached = self._down_cache[b] = (version, encode(tensors, self.down)[0])
            out.update(cached[1])
        return out

    def broadcast(self, initial: bool = False) -> None:
        """Take the algorithm's broadcast for the global model's shared tensors (FedBN's
        normalization layers and the personal blocks left out). `initial`: the run's first, its
        blocks' version 0 (a server step's changed tensors name the later ones)."""
        personal = self.model.personal_keys() | {k for k in self.global_weights
                                                 if block_of(k) in self.alg.personal_blocks()}
        self.extra = dict(self.alg.broadcast({k: v for k, v in self.global_weights.items()
                                              if k not in personal}))
        for b in dict.fromkeys(map(block_of, self.extra)) if initial else ():
            self.version[b] = 0

    # -- bytes and the virtual clock --------------------------------------------------------
    def client_bytes_down(self, client: int, plan: ClientPlan, needed: list[str]) -> int:
        """What `client` is sent for `plan`: the `needed` blocks it lacks and, on its first
        round, the initial version of its personal blocks (a device starts a client's personal
        blocks from the published version 0)."""
        return self.bytes_down(client, needed + [b for b in plan.personal
                                                 if self.client_version[client][b] < 0])

    def bytes_down(self, client: int, blocks: list[str]) -> int:
        """Frame bytes of the blocks `client` needs and does not hold at their current version
        (it then holds them), the initial version included. The same definition in simulation
        and deployment."""
        total = 0
        held = self.client_version[client]
        for b in blocks:
            if held.get(b, -1) != self.version[b]:
                total += self._block_bytes(b)
                held[b] = self.version[b]
        return total

    def blocks_bytes(self, blocks: list[str]) -> int:
        """Frame bytes of `blocks` at their current version, whoever holds what (a site's
        model after a site round: every needed block again, sites.py)."""
        return sum(self._block_bytes(b) for b in blocks)

    def _block_bytes(self, block: str) -> int:
        """The frame bytes of `block`'s current version as the clients receive it (cached)."""
        key = (block, self.version[block])
        if key not in self._frame_sizes:
            self._frame_sizes[key] = frame_size(self.sent(
                in_blocks(self.offered(), block), self.alg.personal_blocks()))
        return self._frame_sizes[key]

    def _uploaded(self, plan: ClientPlan) -> Weights:
        """The global tensors an update to `plan` carries: its uploaded blocks', less the
        tensors that stay with the clients."""
        return {k: v for k, v in self.offered().items() if block_of(k) in plan.upload
                and k not in self.model.personal_keys()}

    def partial_size(self, plan: ClientPlan) -> int:
        """The frame bytes of a site's partial for `plan`: its uploaded tensors in float32."""
        key = ("partial", *plan.upload)
        if key not in self._upload_sizes:
            self._upload_sizes[key] = frame_size(
                {k: v.to(torch.float32) for k, v in self._uploaded(plan).items()})
        return self._upload_sizes[key]

    def upload_size(self, plan: ClientPlan) -> int:
        """The frame bytes of an update to `plan` in the uplink's codec (simulated time)."""
        if plan.upload not in self._upload_sizes:
            coded = {k: torch.empty(shape, dtype=dtype)  # sized, never filled
                     for k, (dtype, shape) in expected(self._uploaded(plan), self.up).items()}
            self._upload_sizes[plan.upload] = frame_size(coded)
        return self._upload_sizes[plan.upload]

    def update_bytes(self, deltas: Weights) -> int:
        """The frame bytes of an update: a function of its tensors' names, dtypes and shapes
        alone, so one round's updates (all alike) are serialized to count them only once."""
        key = tuple((k, v.dtype, tuple(v.shape)) for k, v in deltas.items())
        if key not in self._update_sizes:
            self._update_sizes[key] = frame_size(deltas)
        return self._update_sizes[key]

    def flops(self, client: int, plan: ClientPlan) -> int:
        """The FLOPs `client` spends training `plan` (counted, not measured)."""
        return plan_flops(self.model, plan, self.data, self.data.clients[client], self.flop_cache)

    # -- checking and folding updates -------------------------------------------------------
    def delta_bound(self) -> float:
        """aggregation.max_abs_delta for this round (auto: from the scale of the global model's
        parameters; running statistics, which a device's updates move, have bounds of their own,
        validation.statistic_problem)."""
        return self.cfg.aggregation.delta_bound(parameter_scale(self.global_weights))

    def contract(self, t: int, clients: list[int], plan: ClientPlan, offered: Weights,
                 bound: float) -> RoundContract:
        """What a valid update of round t (or model version t) looks like, for `clients` under
        `plan`, given what they were `offered` and the bound on their deltas."""
        return round_contract(t, clients, plan.upload, offered, self.data,
                              self.alg.effective_samples, bound, self.model.personal_keys(),
                              self.alg.upload_bound, self.up, plan.clip,
                              None if self.cfg.privacy.client_level else self.alg.aggregation_weights)

    def updates(self, t: int, clients: list[int] | None = None,
                offered: Weights | None = None) -> RoundUpdates:
        """A fresh round (or server step) t: the configured aggregation rule, or under
        [privacy] DP-FedAvg's noised sum over the expected number of clients; under [secagg]
        that rule fed by a secure sum over `clients`, whose key stages run now (`offered`: the
        round contract's reference, the tensors a masked input carries)."""
        inner: Aggregator
        if self.cfg.privacy.client_level:
            inner = NoisedSum(self.privacy.clip, update_noise(self.cfg),
                              expected_clients(self.cfg), self.privacy.noise_seed, t)
        else:
            inner = self.rule.round()
        if self.cfg.secagg.enabled and clients:
            assert offered is not None and isinstance(inner, WeightedDeltaSum)
            layout = layout_of(offered)
            # DP-FedAvg's sum weighs every update 1 (NoisedSum); else the largest sample count
            heaviest = 1 if isinstance(inner, NoisedSum) else max(
                1, *(self.data.clients[c].num_train for c in clients))
            # a pool of devices (MQTT) masks there; others play the clients' side here
            local = not getattr(self.pool, "masks_on_devices", False)
            return RoundUpdates(SecureSum(inner, round_setup(self.cfg, t, clients, layout,
                                                             heaviest), layout, local))
        return RoundUpdates(inner)

    def site_aggregate(self, key: int, clients: list[int], reference: Weights
                       ) -> WeightedDeltaSum | SecureSum:
        """A site's aggregate in site round `key` over its `clients` ([hierarchy], sites.py): the
        round's rule (the mean, or DP-FedAvg's clipped sum, whose noise only the coordinator
        adds), under [secagg] fed by a secure sum over the site's clients alone."""
        aggregate = self.updates(key, clients, reference).aggregate
        assert isinstance(aggregate, (WeightedDeltaSum, SecureSum))
        return aggregate

    def fold(self, got: RoundUpdates, update: ClientUpdate, plan: ClientPlan,
             scale: float = 1.0, into: Aggregator | None = None) -> None:
        """Fold one valid update trained under `plan` into the aggregate (`into`: a site's,
        sites.py), its deltas scaled by `scale` (an asynchronous step's staleness discount),
        with what the row reports of it: its (unscaled) norm, local score, FLOPs, steps, bytes."""
        deltas = update.deltas if scale == 1.0 else {k: v * scale for k, v in
                                                      update.deltas.items()}
        target = got.aggregate if into is None else into
        target.add(deltas, self.alg.aggregation_weights(update), update.client, update.device)
        # (a secure round's coordinator never sees the norm; a secure sum's four stages' bytes
        # are counted at the row, or at the site's end)
        secure = isinstance(target, SecureSum)
        self.account(got, update, plan, None if self.cfg.secagg.enabled else
                     update_norm(update.deltas),
                     None if secure else update.upload_bytes if update.upload_bytes is not None
                     else self.update_bytes(update.deltas))

    def account(self, got: RoundUpdates, update: ClientUpdate, plan: ClientPlan,
                norm: float | None, upload_bytes: int | None) -> None:
        """What the row reports of one folded update: its norm (None: unseen), local score,
        FLOPs, steps and bytes (None: counted elsewhere); its deltas are not read (a site's
        partial says these of the updates it folded, sites.py)."""
        c = update.client
        if norm is not None:
            got.norms[c] = norm
        got.samples[c] = (update.num_samples, update.effective_samples)
        got.folds[c] = got.folds.get(c, 0) + 1
        got.reported.append(c)
        got.within += bool(update.under_clip)
        if update.under_clip is not None:
            got.under_clip[c] = update.under_clip
        if update.local_score is not None:
            got.local_scores[update.client] = update.local_score
        shard = self.data.clients[update.client]
        flops = self.flops(update.client, plan)
        got.flops += flops
        seconds, counted = got.paces.get(update.client, (0.0, 0))
        got.paces[update.client] = (seconds + update.train_seconds, counted + flops)
        got.steps += plan_steps(plan, self.data, shard)
        if upload_bytes is not None:
            got.bytes_up += upload_bytes
            got.uploads[c] = got.uploads.get(c, 0) + upload_bytes

    def apply(self, t: int, got: RoundUpdates) -> str | None:
        """Step the server with the round's aggregate if the round counts; else say why it does
        not (too few valid updates, or a non-finite aggregate): then the global model stays as
        it was, and what was folded in is discarded (the FLOPs were spent all the same). The
        blocks the step says it changed get a new version."""
        need = self.cfg.deploy.min_updates
        refused = (f"{len(got.reported)} valid updates < deploy.min_updates={need}"
                   if len(got.reported) < need else None)
        if refused is None:
            try:
                step = self.alg.server_update(self.global_weights, got.aggregate)
            except AggregationError as exc:
                refused = str(exc)
        if refused is not None:
            log.warning("round %d failed: %s", t, refused)
            return refused
        for b in dict.fromkeys(map(block_of, step.changed)):
            self.version[b] = self.version.get(b, -1) + 1
        self.global_weights = step.weights
        self.broadcast()
        self.local_scores.update(got.local_scores)
        self.privacy.stepped(got.within, t)
        return None

    # -- evaluation and the row -------------------------------------------------------------
    def check_score(self, client: int, correct: int, total: int) -> str | None:
        """Why a client's reported score cannot be its test rows' (None: it can)."""
        return score_problem(self.data, client, correct, total)

    def evaluate(self) -> tuple[EvalReport, tuple[int, int] | None]:
        """Every client's personalized model (by the pool), and the global model on the union of
        the clients' test rows (by the pool where it has them, else here); with the step's wire
        bytes."""
        got = self.pool.evaluate(self.sent(self.global_weights, self.alg.personal_blocks()),
                                 self.alg.eval_heads(), self.check_score)
        report = got.report
        if self.cfg.data.placement == "device":
            return self.placed_scores(report), got.wire
        if report.global_total is None or self.down.name != "none":  # the master's score
            glob = evaluate(self.model, self.data, self.global_weights, {}, (self.model.spec.head,),
                            batch=self.cfg.train.eval_batch_size,
                            side=self.alg.client_side(self.alg.client_params()))
            report = EvalReport(glob.global_correct, glob.global_total, report.per_client)
        return report, got.wire

    def placed_scores(self, report: EvalReport) -> EvalReport:
        """data.placement = "device": what the pool scored of the global model on the clients'
        test rows is the federated score; the global score is data.validation's, measured
        here (None without one)."""
        federated = None
        if report.global_total is not None:
            federated = (int(report.global_correct or 0), report.global_total)
        glob: tuple[int | None, int | None] = (None, None)
        if self.data.validation is not None:
            glob = score_global(self.model, self.data, self.global_weights, self.data.validation,
                                self.cfg.train.eval_batch_size,
                                self.alg.client_side(self.alg.client_params()))
        return EvalReport(*glob, report.per_client, federated)

    def evaluate_if_due(self, t: int) -> tuple[int, int] | None:
        """Evaluate after round t when it is due (train.eval_every, and the last round): the
        report is kept for the round's row; returns the step's wire bytes."""
        self.last_report, wire = None, None
        last = t == self.cfg.rounds - 1 or self.over_budget(t + 1) is not None
        if (t + 1) % self.cfg.train.eval_every == 0 or last:
            self.last_report, wire = self.evaluate()
        return wire

    def local_acc(self, report: EvalReport) -> float | None:
        """FedReG's testbed personalized accuracy: every client's most recent locally trained
        model on its own test rows; a client that has not trained yet holds what it was sent."""
        return pooled_accuracy(self.local_scores.get(c, r) for c, r in report.per_client.items())

    def over_budget(self, t: int) -> float | None:
        """[privacy] level = "record" with privacy.target_epsilon: the epsilon round t would take
        a client to where that passes the budget (PrivacyAccount.over_budget), else None."""
        def steps() -> dict[int, int]:
            plan, _ = self.plan(t)
            return {c: plan_steps(plan, self.data, self.data.clients[c]) for c in self.select(t)}
        return self.privacy.over_budget(t, steps)

    def row(self, t: int, plan: ClientPlan, got: RoundUpdates, refused: str | None,
            clients: list[int], trainers: list[int], bytes_down: int, start: float
            ) -> RoundRecord:
        """Round t's row from what it got (`refused`: why its aggregate did not count; None: it
        did), its clients, those of them that trained and its last evaluation."""
        report, counted = self.last_report, refused is None
        excluded: dict[int, str] = {}
        if isinstance(got.aggregate, SecureSum):
            got.bytes_up = got.aggregate.bytes_up()
            excluded = self.exclude(got.aggregate.server.blamed, t)
        rec = RoundRecord(
            round=t, phase="train",
            global_acc=report.global_acc if report else None,
            personal_acc=report.personal_acc if report else None,
            local_acc=self.local_acc(report) if report else None,
            round_local_acc=pooled_accuracy(got.local_scores.values()) if counted else None,
            **({"federated_acc": report.federated_acc} if report and report.federated else {}),
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
        if isinstance(got.aggregate, SecureSum) and counted:
            rec.secure_recovered = got.aggregate.recovered
        if excluded:
            rec.excluded = excluded
        if self.cfg.privacy.enabled:
            rec.epsilon = self.privacy.epsilon(t + 1)
            if self.cfg.privacy.adaptive:
                rec.clip_norm = plan.clip
        return rec

    # -- checkpoint -------------------------------------------------------------------------
    def loop_state(self, row: RoundRecord | None, driver: dict[str, Any] | None) -> LoopState:
        """What a checkpoint keeps of the ledger (`driver`: the driver's own state)."""
        return LoopState(self.version, self.client_version, self.local_scores, self.last_report,
                         row, self.clock, driver,
                         self.privacy.clip if self.cfg.privacy.adaptive else None,
                         dict(self.privacy.record_steps),
                         self.privacy.noise_seed if self.cfg.privacy.client_level else None,
                         dict(self.excluded))

    def restore(self, ckpt: Checkpoint) -> None:
        """The ledger as the checkpoint left it (versions included), the pool's and the
        algorithm's server state too."""
        self.global_weights = {k: ckpt.global_weights[k].to(v.dtype) for k, v in
                               self.global_weights.items()}
        loop = ckpt.loop
        self.version, self.client_version = loop.version, loop.client_version
        self.local_scores, self.last_report = loop.local_scores, loop.last_report
        self.clock = loop.clock
        if loop.clip is not None:  # adaptive clipping's clip norm as it was
            self.privacy.clip = loop.clip
        self.privacy.record_steps = dict(loop.record_steps)
        if loop.noise_seed is not None:  # the run's secret noise seed: a resume is bitwise
            self.privacy.noise_seed = loop.noise_seed
        self.excluded = dict(loop.excluded)
        self.pool.restore(ckpt.pool)
        self.alg.load_server_state(ckpt.server)
        self.rule.load_state(ckpt.rule)
        self.broadcast()  # as checkpointed: its versions are the checkpoint's
