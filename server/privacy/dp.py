"""Client-level differential privacy on the coordinator: DP-FedAvg's noised sum, Poisson sampling
of the clients, and the privacy accounting (McMahan, Ramage, Talwar, Zhang, "Learning
Differentially Private Recurrent Language Models", ICLR 2018).

Each round every client joins independently with probability q (train.join_ratio); a selected
client clips its whole upload to an L2 norm C on its device (common/training.py; the round
contract refuses an update above C, so a device that skips the clipping is not counted). The
coordinator sums the clipped updates, every weight 1, adds Gaussian noise of standard deviation
z C to every coordinate of the sum, and divides by the expected number of clients q N (the
fixed-denominator estimator): one client changes the sum by at most C, whatever it sends. The
algorithm's server step then runs on this noised mean (FedAvg's, a server optimizer's, ...).

The noise is drawn from the `noise` random stream ([seeds] noise, else `seed`), so a simulation,
`--workers` and a deployment give bitwise the same run: whoever knows that seed can subtract the
noise, so a run whose guarantee matters keeps it secret (docs/how-to/privacy.md).

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021; privacy.adaptive): each client also reports one bit, whether
its update's norm was within the round's C; the coordinator counts the bits with Gaussian noise
of standard deviation sigma_b and moves C geometrically towards the target quantile gamma,

    C <- C exp(-eta (b~ - gamma)),   b~ = (sum of the bits + N(0, sigma_b^2)) / (q N).

The two noised sums together are one Gaussian mechanism of noise multiplier z (the configured
one) when the updates' noise multiplier is z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2 (the paper's
Theorem 1), so the accounting is unchanged.

The accountant is dp-accounting's (Google) Renyi-DP accountant for the Poisson-subsampled
Gaussian mechanism composed over the rounds, add-or-remove-one-client adjacency: epsilon at
privacy.delta after every round, a pure function of (q, z, rounds), so a resumed run's is the
same as an uninterrupted one's.

A buffered-asynchronous run (train.mode = "async") noises every server step's sum over its
buffer, folds each client at most once a step (server/rounds/buffered.py), and is accounted at
q = 1: its steps' clients are not Poisson-sampled, so no amplification by sampling is claimed
(`sampling_rate`, `expected_clients`).
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedseq.common.algorithms.aggregate import WeightedDeltaSum, in_dtype, update_norm
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData
from fedseq.common.errors import AggregationError, ConfigError
from fedseq.common.flops import plan_steps
from fedseq.common.models import Weights
from fedseq.common.seeding import numpy_rng, torch_rng


def sampling_rate(cfg: ExperimentConfig) -> float:
    """The q the accountant composes over the rounds: train.join_ratio under Poisson sampling
    (train.mode = "sync"); 1 for a buffered-asynchronous run's server steps, whose clients are
    not Poisson-sampled: every step is accounted as if every client took part (no amplification
    by sampling), each client folded at most once a step."""
    return 1.0 if cfg.train.mode == "async" else cfg.train.join_ratio


def expected_clients(cfg: ExperimentConfig) -> float:
    """The fixed denominator of the noised mean: the clients expected a round (q N), or a
    buffered-asynchronous step's buffer."""
    if cfg.train.mode == "async":
        return float(cfg.async_shape()[1])
    return cfg.train.join_ratio * cfg.data.num_clients


def count_noise(cfg: ExperimentConfig) -> float:
    """sigma_b of adaptive clipping's count (0 without noise)."""
    p = cfg.privacy
    if p.noise_multiplier <= 0:
        return 0.0
    return p.count_noise or expected_clients(cfg) / 20


def update_noise(cfg: ExperimentConfig) -> float:
    """The noise multiplier of the updates' sum: privacy.noise_multiplier, less what adaptive
    clipping's count takes of it."""
    z = cfg.privacy.noise_multiplier
    if not cfg.privacy.adaptive or z <= 0:
        return z
    return (z ** -2 - (2 * count_noise(cfg)) ** -2) ** -0.5


def next_clip(cfg: ExperimentConfig, clip: float, within: int, round: int, seed: int) -> float:
    """Adaptive clipping's clip norm after `round`, whose counted updates were `within` times
    at most `clip` before clipping: C exp(-eta (noised share - target quantile)); the count's
    noise from the run's noise seed `seed` (Ledger.noise_seed)."""
    p = cfg.privacy
    expected = expected_clients(cfg)
    g = torch_rng(seed, "dp-count-noise", round)
    noise = float(torch.randn(1, generator=g, dtype=torch.float64)) * count_noise(cfg)
    return clip * math.exp(-p.clip_lr * ((within + noise) / expected - p.target_quantile))


def poisson_clients(seed: int, round: int, num_clients: int, rate: float) -> list[int]:
    """Round `round`'s clients under Poisson sampling: each joins with probability `rate`,
    independently, from the selection stream (a pure function of its arguments)."""
    u = numpy_rng(seed, "poisson-selection", round).random(num_clients)
    return [int(c) for c in np.flatnonzero(u < rate)]


@functools.lru_cache(maxsize=4096)
def epsilon(rate: float, noise: float, rounds: int, delta: float) -> float:
    """The (epsilon, delta) epsilon of `rounds` rounds of the Poisson-subsampled Gaussian
    mechanism (sampling rate, noise multiplier z), from dp-accounting's RDP accountant; inf
    without noise."""
    if rounds <= 0:
        return 0.0
    if noise <= 0:
        return math.inf
    try:
        import dp_accounting
        from dp_accounting import rdp
    except ImportError:  # pragma: no cover - the server extra installs it
        raise ConfigError("[privacy] needs dp-accounting: pip install 'fedseq[server]'") from None
    logging.getLogger("absl").setLevel(logging.ERROR)  # its RDP orders' convergence chatter
    accountant = rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return float(accountant.get_epsilon(delta))


def record_epsilon(cfg: ExperimentConfig, steps: dict[int, int], sizes: dict[int, int]
                   ) -> float:
    """[privacy] level = "record": the largest epsilon of any client's training examples at
    privacy.delta, client i's being `steps[i]` DP-SGD steps of the Poisson-subsampled Gaussian
    mechanism at rate batch size / its training rows (`sizes[i]`). The client's batches are a
    shuffle's, not Poisson samples: the usual approximation (Abadi et al. and Opacus account
    shuffled batches so), stated in docs/how-to/privacy.md. 0 before any client trained."""
    p, b = cfg.privacy, cfg.train.batch_size
    return max((epsilon(min(1.0, b / max(1, sizes[c])), p.noise_multiplier, n, p.delta)
                for c, n in steps.items()), default=0.0)


def rounds_within(rate: float, noise: float, delta: float, budget: float, most: int) -> int:
    """The most rounds (up to `most`) whose epsilon stays within `budget` (epsilon grows with
    the rounds: a bisection)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if epsilon(rate, noise, mid, delta) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def statement(cfg: ExperimentConfig, shared_params: int) -> str | None:
    """[privacy]'s plain account of a run before it starts (None without it): epsilon after its
    last round, and how large the noise is against the signal: a round's mean update has a norm
    of at most C, its noise about z C sqrt(d) / (q N) (d shared parameters, q N clients expected
    a round). A small federation (the FedReG testbed's 30 clients) gets a large epsilon or a
    noise that drowns the updates, and the run says which."""
    p = cfg.privacy
    if p.record_level:
        return (f"privacy: record-level DP-SGD in every client's training (per-example clip "
                f"{p.clip_norm:g}, z = {p.noise_multiplier:g} a step); each client's epsilon at "
                f"delta {p.delta:g} grows with its own steps, and every row reports the largest")
    if not p.enabled:
        return None
    q, n = sampling_rate(cfg), expected_clients(cfg)
    final = epsilon(q, p.noise_multiplier, cfg.rounds, p.delta)
    ratio = p.noise_multiplier * math.sqrt(max(shared_params, 1)) / n
    text = (f"privacy: epsilon {final:.3g} at delta {p.delta:g} after {cfg.rounds} rounds "
            f"(q = {q:g}, z = {p.noise_multiplier:g}); the noise on a round's mean update is "
            f"~{ratio:.3g} x its largest norm C ({shared_params:,} shared parameters, "
            f"{n:g} clients expected a round)")
    weak = []
    if final > 10:
        weak.append("epsilon above 10 protects little")
    if ratio > 10:  # docs/results.md, 1,000 clients: ~8x 81.9 %, ~11x 75.6 %, ~18x 42.7 %, ~33x 10 %
        weak.append("noise above ~10 x C cost accuracy in the measured runs")
    if weak:
        text += ("; " + " and ".join(weak) + ": DP-FedAvg needs many clients a round "
                 "(docs/how-to/privacy.md, \"How many clients\")")
    return text


def check_record_level(cfg: ExperimentConfig, algorithm: Any, model: torch.nn.Module) -> None:
    """Refuse, in one line, a record-level (DP-SGD) run whose per-example gradients or whose
    accounting would not hold: an algorithm whose client adds loss terms or corrections of its
    own (not per example), a model with batch normalization (it mixes a batch's examples), a
    plan that trains on other rows than the client's own (FedReG's rebalanced set)."""
    if not cfg.privacy.record_level:
        return
    from fedseq.common.algorithms.hooks import ClientSide
    from fedseq.common.dpsgd import batch_norm_in

    why = "privacy.level = \"record\" (DP-SGD)"
    if any(phase.data != "local" for phase in algorithm.plan(0).phases):
        raise ConfigError(f"{why} accounts each client's own training rows; "
                          f"{algorithm.name} trains on a rebalanced set too: use privacy.level = "
                          "\"client\"")
    if algorithm.client_class is not ClientSide:
        raise ConfigError(f"{why} clips each example's gradient; {algorithm.name}'s clients add "
                          f"terms of their own ({algorithm.client_class.__name__}): use "
                          "privacy.level = \"client\", or an algorithm without them (fedavg, "
                          "fedper, fedrep, fedbabu, fedseq, ...)")
    layer = batch_norm_in(model)
    if layer is not None:
        raise ConfigError(f"{why}: the model's layer {layer} is batch normalization, which mixes "
                          "a batch's examples; use a model without it (cnn, convnet)")


def check_budget(cfg: ExperimentConfig) -> None:
    """Refuse, in one line saying how many rounds fit, a run whose epsilon after its last round
    would exceed privacy.target_epsilon."""
    p = cfg.privacy
    if not p.client_level or p.target_epsilon is None:
        return
    rate = sampling_rate(cfg)
    final = epsilon(rate, p.noise_multiplier, cfg.rounds, p.delta)
    if final <= p.target_epsilon:
        return
    fit = rounds_within(rate, p.noise_multiplier, p.delta, p.target_epsilon, cfg.rounds)
    raise ConfigError(
        f"privacy.target_epsilon = {p.target_epsilon:g}: {cfg.rounds} rounds at q = {rate:g}, "
        f"z = {p.noise_multiplier:g} reach epsilon {final:.3g} at delta {p.delta:g}; {fit} rounds "
        "fit the budget: set rounds <= that, raise privacy.noise_multiplier or lower "
        "train.join_ratio")


class NoisedSum(WeightedDeltaSum):
    """DP-FedAvg's aggregate: the sum of the round's clipped updates, each of weight 1 (the
    algorithm's weights are not used: a sample-weighted mean would scale one client's influence
    by its rows), plus N(0, (z C)^2) in every coordinate of every tensor any client sent, over
    the expected number of clients q N. The noise of round t comes from (noise seed, t) and the
    tensors' names, so it is the same whoever computes it."""

    def __init__(self, clip: float, noise: float, expected: float, seed: int, round: int):
        super().__init__()
        self.clip, self.noise, self.expected = clip, noise, expected
        self.seed, self.round = seed, round

    def _within_clip(self, deltas: Weights) -> Weights:
        """`deltas` scaled to an L2 norm (of their floating-point tensors) of at most C."""
        floats = {k: d for k, d in deltas.items() if d.is_floating_point()}
        norm = update_norm(floats)
        if norm <= self.clip:
            return deltas
        scale = self.clip / norm
        return {k: d * scale if k in floats else d for k, d in deltas.items()}

    def add(self, deltas: Weights, weight_of: dict[str, float], client: int,
            device: str | None = None) -> None:
        """Add one update, weight 1, scaled to an L2 norm of at most C first: an update the
        contract checked is within C already (a no-op); one decoded from int8 or top-k, whose
        codec does not keep the norm its device clipped, is brought back to C here, so no
        client moves the sum by more than C whatever it sends."""
        super().add(self._within_clip(deltas), {b: 1.0 for b in weight_of}, client, device)

    def add_partial(self, deltas: Weights, weights: dict[str, float], clients: list[int]) -> None:
        """A site's partial (server/rounds/sites.py): the mean of its clients' clipped updates,
        each of weight 1, so within C itself; one over C is brought back to C here, so no site
        moves the sum by more than its clients' count x C."""
        super().add_partial(self._within_clip(deltas), weights, clients)

    def apply(self, global_weights: Weights) -> Weights:
        out = dict(global_weights)
        std = self.noise * self.clip
        for k in sorted(self.sums):
            s = self.sums[k]
            if not math.isfinite(float(s.sum())):
                raise AggregationError(f"the aggregate of {k} has NaN or Inf; the round is refused")
            g = global_weights[k]
            if std > 0 and g.is_floating_point():
                gen = torch_rng(self.seed, "dp-noise", self.round, zlib.crc32(k.encode()))
                s = s + torch.randn(s.shape, generator=gen, dtype=torch.float64) * std
            out[k] = in_dtype(k, g.to(torch.float64) + s / self.expected, g.dtype)
        return out

    def moved(self) -> set[str]:
        """Every tensor some client sent: each gets noise, whatever its weights."""
        return set(self.sums)



class PrivacyAccount:
    """A run's privacy, one part of the round beside the aggregation: the clip norm of the next
    round (adaptive clipping moves it), the secret seed of the coordinator's noise, each client's
    DP-SGD steps (record level) and the epsilon they add up to; checkpointed with the round loop.
    Without [privacy] it holds nothing and says None."""

    def __init__(self, cfg: ExperimentConfig, data: FederatedData, site_rounds: int):
        self.cfg, self.data, self.site_rounds = cfg, data, site_rounds
        self.sizes = {c.client: c.num_train for c in data.clients}
        #: the clip norm of the next round
        self.clip = cfg.privacy.clip_norm
        #: the seed of the coordinator's noise (the updates' sum and adaptive clipping's count):
        #: a secret drawn from the OS for each run and kept in its checkpoint alone, never in a
        #: config a device gets, so that no device can regenerate the noise and subtract it from
        #: a released model; `[seeds] noise` pins it (reproducible noise for a simulation, known
        #: to whoever reads the config: docs/explanation/privacy.md)
        self.noise_seed = (cfg.seeds.noise if cfg.seeds.noise is not None
                           else secrets.randbits(63))
        #: level = "record": each client's DP-SGD steps so far
        self.record_steps: dict[int, int] = {}
        self._budget: dict[int, float | None] = {}  # over_budget's answer for one round

    def epsilon(self, rounds: int) -> float | None:
        """Epsilon after `rounds` rounds at privacy.delta (record level: the largest of the
        clients' so far); None without [privacy]."""
        p = self.cfg.privacy
        if p.record_level:
            return record_epsilon(self.cfg, self.record_steps, self.sizes)
        return epsilon(sampling_rate(self.cfg), p.noise_multiplier, rounds, p.delta) \
            if p.enabled else None

    def over_budget(self, t: int, steps_of: Callable[[], dict[int, int]]) -> float | None:
        """Level = "record" with privacy.target_epsilon: the epsilon round t would take a client
        to where that passes the budget (the round must not run), None where it may run (and
        past the last round). `steps_of()`: the DP-SGD steps round t gives each of its selected
        clients (only theirs move, so only theirs are computed)."""
        p = self.cfg.privacy
        if not p.record_level or p.target_epsilon is None or t >= self.cfg.rounds:
            return None
        if t not in self._budget:
            steps = {c: self.record_steps.get(c, 0) + self.site_rounds * n
                     for c, n in steps_of().items()}
            reached = record_epsilon(self.cfg, steps, {c: self.sizes[c] for c in steps})
            self._budget = {t: reached if reached > p.target_epsilon else None}
        return self._budget[t]

    def spent(self, client: int, plan: ClientPlan) -> None:
        """Level = "record": `client` trained `plan` in each of the round's site rounds (its
        epsilon counts its steps whether or not its update counts: the coordinator saw it)."""
        if plan.record_dp is not None:
            steps = self.site_rounds * plan_steps(plan, self.data, self.data.clients[client])
            self.record_steps[client] = self.record_steps.get(client, 0) + steps

    def stepped(self, within: int, t: int) -> None:
        """After round t counted: adaptive clipping moves the clip norm by the noised count of
        the updates that were `within` it."""
        if self.cfg.privacy.client_level and self.cfg.privacy.adaptive:
            self.clip = next_clip(self.cfg, self.clip, within, t, self.noise_seed)
