"""Executes a client plan on a torch model: the only training loop in fedseq.

It knows blocks, objectives and losses, nothing of algorithms or transports: what an algorithm
does on the client beyond the plan (extra loss terms, gradient corrections, state kept between
rounds, what it uploads beside the deltas) comes from the plan's hooks
(common/algorithms/hooks.py). Frozen blocks have
requires_grad=False, so no gradient is computed for them and nothing is applied to them.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from fedseq.common.algorithms.aggregate import ClientUpdate, update_norm
from fedseq.common.algorithms.hooks import ClientSide, Job, UnknownAlgorithm, client_side
from fedseq.common.algorithms.plan import ClientPlan, Objective, Phase
from fedseq.common.augment import augment_batch
from fedseq.common.codecs import Codec, encode
from fedseq.common.data.federated import ClientShard, FederatedData
from fedseq.common.data.rebalance import simple_augment
from fedseq.common.models import (
    BlockModel,
    Weights,
    is_state_block,
    personal_tensors,
    set_weights,
    shared_tensors,
    split_state,
    state_key,
)
from fedseq.common.seeding import torch_rng

if TYPE_CHECKING:
    from fedseq.common.dpsgd import DpSgd

# Overconfident heads on skewed clients drive gradients into denormal floats, which made CPU
# backward passes up to 4x slower (measured in bench/sim_round.py). Flush-to-zero is a per-thread
# CPU flag that new threads inherit, so it is set when the trainer is imported, before torch
# starts its worker threads; values below 1e-38 are all it changes. numpy 2.3 then warns, at
# its first float limits, that the smallest subnormal is zero: true, and what was asked for.
torch.set_flush_denormal(True)
warnings.filterwarnings("ignore", message="The value of the smallest subnormal for",
                        category=UserWarning)


@dataclass
class TrainStats:
    """What a plan's execution reports besides the weights: samples seen, loss, seconds."""

    num_samples: int
    effective_samples: int | None
    seconds: float
    batches: int
    mean_loss: float
    # the batch (counted from 1) whose loss was NaN or Inf, where training stopped; None: finite
    diverged_at: int | None = None
    # the sum over every step of each corrected parameter's raw gradient (train_plan's
    # `correction`), on the host; empty without corrections
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)


class _Diverged(Exception):
    """A non-finite loss: training stops there, as every later step would be NaN too."""


class Sgd:
    """SGD with momentum, step for step and bit for bit what torch.optim.SGD(foreach=True) does
    (no dampening, weight decay or Nesterov; tests/common/test_training.py compares them).
    Constructing a torch.optim optimizer imports torch._dynamo and sympy: 830 modules, ~55 MB
    resident on a device that has 4 GB for everything; this imports nothing."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, momentum: float):
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self) -> None:
        """Drop the gradients of the optimized parameters."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One SGD step (with momentum when set)."""
        idx = [i for i, p in enumerate(self.params) if p.grad is not None]
        params: list[torch.Tensor] = [self.params[i] for i in idx]
        grads = [p.grad for p in params if p.grad is not None]
        if self.momentum != 0:
            if all(self.buffers[i] is not None for i in idx):
                bufs = [b for i in idx if (b := self.buffers[i]) is not None]
                torch._foreach_mul_(bufs, self.momentum)
                torch._foreach_add_(bufs, grads, alpha=1)
            else:
                bufs = []
                for i, g in zip(idx, grads):
                    buf = self.buffers[i]
                    if buf is None:
                        buf = self.buffers[i] = torch.clone(g).detach()
                    else:
                        buf.mul_(self.momentum).add_(g, alpha=1)
                    bufs.append(buf)
            grads = bufs
        if params:
            torch._foreach_add_(params, grads, alpha=-self.lr)


def set_trainable(model: BlockModel, trainable: tuple[str, ...]) -> list[torch.nn.Parameter]:
    """Freeze every block but `trainable` (requires_grad); returns the parameters to optimize.
    A trainable block is in training mode, a frozen one in evaluation mode: under running
    statistics (model.norm) a frozen block normalizes by them and leaves them as they are, so it
    is exactly unchanged (with batch statistics the mode changes nothing). Shared with the FLOP
    counter (common/flops.py), which measures exactly these steps."""
    params = []
    for name, module in model.named_children():
        flag = name in trainable
        module.train(flag)
        for p in module.parameters():
            p.requires_grad_(flag)
            if flag:
                params.append(p)
    return params


def _loss(logits: torch.Tensor, y: torch.Tensor, kind: str, log_prior: torch.Tensor | None):
    if kind == "balanced_ce":
        assert log_prior is not None
        logits = logits + log_prior
    return F.cross_entropy(logits, y)


def train_plan(
    model: BlockModel,
    data: FederatedData,
    shard: ClientShard,
    plan: ClientPlan,
    seed: int,
    round: int,
    purpose: str = "batches",
    correction: dict[str, torch.Tensor] | None = None,
    anchor_weights: Weights | None = None,
    side: ClientSide | None = None,
) -> TrainStats:
    """Run every phase of `plan` on the client's training rows; updates `model` in place.
    `correction`: parameter name -> what is added to its gradient before every step
    (SCAFFOLD's c - c_i, FedDyn's -g_k); the raw gradients of those parameters are then summed
    over the steps (`TrainStats.gradients`). `anchor_weights`: what a proximal term pulls
    towards (default: the model as it starts; Ditto's personal model: the global model).
    `side`: the plan's hooks (default: built from the plan).

    Batch order (and FedReG's rebalancing and augmentation) come from generators derived from
    (seed, purpose, round, client), so the result does not depend on who runs it.
    """
    start = time.perf_counter()
    torch.set_flush_denormal(True)  # the calling thread may not be the one that imported us
    g_batch = torch_rng(seed, purpose, round, shard.client)
    transform = _augmentation(plan, data, seed, purpose, round, shard.client)
    side = client_side(plan) if side is None else side
    dev = next(model.parameters()).device
    counts = shard.train_class_counts(data.y, data.num_classes).float() \
        if plan.class_counts_needed else None
    log_prior = None if counts is None else counts.clamp_min(1e-12).log()[None, :].to(dev)
    side.begin(model, None if counts is None else counts.to(dev), anchor_weights)
    correction = correction or {}
    corrected = [(n, p) for n, p in model.named_parameters() if n in correction]
    fixes = [(p, correction[n], torch.zeros_like(p)) for n, p in corrected]
    dp = None
    if plan.record_dp is not None:  # DP-SGD: each step's per-example gradients clipped, noised
        from fedseq.common.dpsgd import DpSgd

        dp = DpSgd(model, *plan.record_dp, plan.batch_size,
                   torch_rng(seed, f"{purpose}-dp-sgd", round, shard.client))
    tally = _Tally()
    try:
        _run_phases(model, data, shard, plan, side, seed, round, g_batch, transform, log_prior,
                    fixes, dp, tally)
    except _Diverged:
        tally.diverged_at = tally.batches + 1
    finally:
        if dp is not None:
            dp.close()
    set_trainable(model, ())
    return TrainStats(
        num_samples=len(shard.train),
        effective_samples=tally.effective,
        seconds=time.perf_counter() - start,
        batches=tally.batches,
        mean_loss=tally.loss_sum / max(1, tally.batches),
        diverged_at=tally.diverged_at,
        gradients={n: total.cpu() for (n, _), (_, _, total) in zip(corrected, fixes)},
    )


def _augmentation(plan: ClientPlan, data: FederatedData, seed: int, purpose: str, round: int,
                  client: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The plan's augmentation of a batch, on its own random stream (a run without augmentation
    draws exactly as before), or None."""
    if not plan.augment:
        return None
    g_train = torch_rng(seed, f"{purpose}-augment", round, client)
    stats = data.pixel_stats()

    def transform(x: torch.Tensor) -> torch.Tensor:
        return augment_batch(x, plan.augment, plan.crop_padding, stats, g_train)
    return transform


@dataclass
class _Tally:
    """What train_plan's phases have done so far."""

    batches: int = 0
    loss_sum: float = 0.0
    effective: int | None = None
    diverged_at: int | None = None


def _run_phases(model: BlockModel, data: FederatedData, shard: ClientShard, plan: ClientPlan,
                side: ClientSide, seed: int, round: int, g_batch: torch.Generator,
                transform: Callable[[torch.Tensor], torch.Tensor] | None,
                log_prior: torch.Tensor | None,
                fixes: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                dp: DpSgd | None, tally: _Tally) -> None:
    """Every phase of the plan, batch by batch, each objective with its own optimizer (train_step
    with `log_prior`, `fixes` and `dp`); `tally` counts as they go. _Diverged at a non-finite
    loss."""
    dev = next(model.parameters()).device
    for phase in plan.phases:
        rows = phase_rows(phase, side, data, shard, seed, round)
        tally.effective = rows.effective if rows.effective is not None else tally.effective
        optimizers = []
        for obj in phase.objectives:
            params = set_trainable(model, obj.trainable)
            optimizers.append(Sgd(params, lr=plan.lr, momentum=plan.momentum)
                              if params else None)
        for x, y in rows.batches(phase.epochs, plan.batch_size, g_batch, dev):
            if transform is not None:
                x = transform(x)
            cache: dict[str, torch.Tensor] = {}
            for obj, opt in zip(phase.objectives, optimizers):
                if opt is None:
                    continue
                if len(phase.objectives) > 1:
                    set_trainable(model, obj.trainable)
                loss = train_step(model, obj, opt, x, y, cache, log_prior, side, fixes, dp)
                if not math.isfinite(loss):
                    raise _Diverged
                tally.loss_sum += loss
            tally.batches += 1


def phase_rows(phase: Phase, side: ClientSide, data: FederatedData, shard: ClientShard,
               seed: int, round: int) -> PhaseRows:
    """What `phase` trains on: the client's own rows, or the rows of a data source of the plan's
    algorithm (`ClientSide.phase_rows`: FedReG's rebalanced set)."""
    if phase.data == "local":
        return PhaseRows(shard.train, data.images, data.y)
    rows = side.phase_rows(phase, data, shard, seed, round)
    if rows is None:
        raise UnknownAlgorithm(f"the plan's phase trains on {phase.data!r}, a data source its "
                               f"algorithm's client side ({type(side).__name__}) does not make")
    return rows


@dataclass
class PhaseRows:
    """The rows one phase trains on (indices into `images` and `ys`): the client's own, or a
    set an algorithm's client side makes (FedReG's rebalanced set: its rows, which of them to
    augment with `g_aug`, and its effective size: `ClientSide.phase_rows`)."""

    rows: torch.Tensor
    images: Callable[[torch.Tensor], torch.Tensor]
    ys: torch.Tensor
    augment: torch.Tensor | None = None
    effective: int | None = None
    stats: tuple[torch.Tensor, torch.Tensor] | None = None  # the pixels' (mean, std)
    g_aug: torch.Generator | None = None  # draws the augmentations of the `augment` rows

    def batches(self, epochs: int, size: int, g_batch: torch.Generator, dev: torch.device
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, labels) of every batch of every epoch, in the generator's order, on `dev`."""
        n = len(self.rows)
        for _ in range(epochs):
            perm = torch.randperm(n, generator=g_batch)
            for i in range(0, n, size):
                pick = perm[i : i + size]
                idx = self.rows[pick]
                x = self.images(idx)
                if self.augment is not None:
                    aug = self.augment[pick]
                    if aug.any():
                        assert self.g_aug is not None
                        x[aug] = simple_augment(x[aug], self.g_aug, self.stats)
                y = self.ys[idx]
                if dev.type != "cpu":
                    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                yield x, y


def train_step(model, obj: Objective, opt, x, y, cache, log_prior, side: ClientSide,
               fixes: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
               dp: DpSgd | None = None) -> float:
    """One optimizer step of one objective on one batch; returns its loss. `side`: the plan's
    hooks (`begin` already called): a loss of the algorithm's own kind, a penalty term;
    `fixes`: (parameter, what is added to its gradient before the step, where its raw
    gradients are summed); `dp`: DP-SGD's clipping and noise of the gradients (record-level
    privacy)."""
    if dp is not None:
        dp.follow()
    if obj.reuse_features and "features" in cache:
        feats = cache["features"].detach()
    else:
        feats = model.features(x)
        cache["features"] = feats
    loss = side.loss(model, obj, feats, y)
    if loss is None:
        logits = None
        for h in obj.heads:
            if obj.reuse_features and h not in obj.trainable and h in cache:
                part = cache[h].detach()
            else:
                part = getattr(model, h)(feats)
                cache[h] = part
            logits = part if logits is None else logits + part
        assert logits is not None
        loss = _loss(logits, y, obj.loss, log_prior)
    extra = side.penalty(model, x, feats)
    if extra is not None:
        loss = loss + extra
    opt.zero_grad()
    loss.backward()
    if dp is not None:
        dp.privatize(opt.params)
    for p, fix, total in fixes:
        if p.grad is not None:
            total.add_(p.grad)
            p.grad.add_(fix)
    opt.step()
    return float(loss.detach())


def run_client_round(
    model: BlockModel,
    weights: Weights,
    plan: ClientPlan,
    data: FederatedData,
    shard: ClientShard,
    seed: int,
    round: int,
    purpose: str = "batches",
) -> tuple[ClientUpdate, Weights]:
    """Load the client's weights (global blocks + its personal blocks), train under the plan and
    return (update with deltas of the uploaded blocks, the client's new personal blocks; both as
    `shared_tensors` and `personal_tensors` split them: FedBN's normalization layers are
    personal in every block). The plan's hooks (its algorithm's client side) correct gradients,
    add to the upload and keep state (SCAFFOLD's control variates, FedDyn's g_k, Ditto's own
    model: common/algorithms/hooks.py). The update goes out in the plan's wire codec
    (common/codecs.py); top-k's residual ("ef" state in `weights`, of the client's personal
    state) is added to the deltas first and what is not sent is kept. Where training diverged
    (`update.diverged_at`), the update is refused by the round's contract and the caller keeps
    the client's previous personal blocks."""
    weights, state = split_state(weights)
    side = client_side(plan)
    set_weights(model, weights)
    upload = [b for b in plan.upload if not is_state_block(b)]  # model blocks; state below
    before = shared_tensors(model, upload)
    job = Job(model, weights, state, {k: p for k, p in model.named_parameters() if k in before},
              plan, data, shard, seed, round)
    correction = side.start(job)
    stats = train_plan(model, data, shard, plan, seed, round, purpose, correction, side=side)
    scoring = time.perf_counter()
    score = (score_local(model, data, shard, plan.score_heads, side) if plan.score_heads
             else None)
    compute = stats.seconds + time.perf_counter() - scoring
    after = shared_tensors(model, upload)
    deltas = {k: after[k] - before[k] for k in after}
    personal = personal_tensors(model, plan.personal)
    compute += side.finish(job, stats, deltas, personal)
    codec = Codec.parse(plan.codec)
    under = None
    if plan.clip is not None:
        deltas, under = clip_update(deltas, plan.clip, codec)
    if codec.name != "none":
        g = torch_rng(seed, "int8", round, shard.client) if codec.stochastic else None
        deltas, left = encode(deltas, codec, state.get("ef"), g)
        personal.update({state_key(k, "ef"): v for k, v in left.items()})
    update = ClientUpdate(
        client=shard.client,
        round=round,
        deltas=deltas,
        num_samples=stats.num_samples,
        effective_samples=stats.effective_samples,
        train_seconds=compute,
        local_score=score,
        diverged_at=stats.diverged_at,
        under_clip=under,
    )
    return update, personal


def clip_update(deltas: Weights, clip: float, codec: Codec) -> tuple[Weights, bool]:
    """[privacy]'s clipping: every tensor of the upload scaled by min(1, C' / its whole L2
    norm), C' = `clip` less the codec's rounding (and float32's), so that what the coordinator
    decodes has a norm of at most `clip` (the round contract's check). A codec that does not
    keep the norm (int8, top-k) is clipped to `clip` before it codes; the coordinator scales
    what it decodes back to `clip` (server/privacy/dp.py NoisedSum). Integer tensors are left as
    they are (none are uploaded but counters). Returns the clipped upload and whether its norm
    was within `clip` (adaptive clipping's bit)."""
    norm = update_norm({k: d for k, d in deltas.items() if d.is_floating_point()})
    target = clip / (1.0 + (codec.norm_rounding or 0.0)) * (1.0 - 1e-6)
    if norm <= target:
        return deltas, norm <= clip
    scale = target / norm
    return {k: d * scale if d.is_floating_point() else d for k, d in deltas.items()}, norm <= clip


@torch.no_grad()
def score_local(model: BlockModel, data: FederatedData, shard: ClientShard, heads: tuple[str, ...],
                side: ClientSide | None = None, batch: int = 128) -> tuple[int, int]:
    """(correct, total) of the model as it is on the client's own test rows, `heads` summed on
    what the algorithm's heads read (`side.head_features`: GPFL's personalized valve)."""
    model.eval()
    side = ClientSide() if side is None else side
    dev = next(model.parameters()).device
    correct = 0
    counts = shard.train_class_counts(data.y, data.num_classes) if side.needs_counts else None
    for i in range(0, len(shard.test), batch):
        rows = shard.test[i : i + batch]
        feats = model.features(data.images(rows).to(dev))
        if counts is not None:
            feats = side.head_features(model, feats, counts)
        logits = model.logits(feats, heads)
        correct += int((logits.argmax(1).cpu() == data.y[rows]).sum())
    return correct, len(shard.test)


def finetune_and_score(
    model: BlockModel,
    weights: Weights,
    plan: ClientPlan,
    data: FederatedData,
    shard: ClientShard,
    seed: int,
    eval_heads: tuple[str, ...],
    eval_batch: int = 128,
) -> tuple[tuple[int, int], int | None]:
    """Fine-tune one client from `weights` (FedBABU/FedSeq's last step) and return its
    (correct, total) on its own test rows, and the batch where the fine-tuning diverged (a NaN
    or Inf loss; None: it did not). A diverged client's score is its diverged model's, as the
    algorithm produced it; the caller reports which clients diverged."""
    from fedseq.common.evaluation import evaluate

    plan = replace(plan, score_heads=())  # scored below, with the evaluation's code
    update, tuned = run_client_round(model, weights, plan, data, shard, seed, round=0,
                                     purpose="finetune")
    rep = evaluate(model, data, tuned, {}, eval_heads, clients=[shard.client], batch=eval_batch,
                   with_global=False)
    return rep.per_client[shard.client], update.diverged_at
