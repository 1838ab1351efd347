"""What a valid contribution to one round looks like, checked before anything counts: the one
admission point of a fold (`RoundContract.admit`).

A contribution is a client's update (a synchronous round's, an asynchronous step's, a replayed
one) or a site's partial aggregate ([hierarchy]). The coordinator knows each client's
training-set size from the partition (and, for FedReG, the exact number of original rows in its
rebalanced set), which tensors the round's plan uploads, and their dtypes and shapes; a
contribution that disagrees with any of it, or whose weight is not what those sizes give, is
rejected with a typed reason and never touches the model or displaces a valid one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.robust import update_norm
from fedseq.common.codecs import Codec, decode, expected, wire_problem
from fedseq.common.data.federated import FederatedData
from fedseq.common.models import Weights, block_of, is_statistic
from fedseq.common.protocol.tensors import frame_size
from fedseq.common.text import printable
from fedseq.server.privacy.secure_sum import SecureSum
from fedseq.server.rounds.records import Rejection

#: running statistics (BatchNorm buffers, model.norm = "running" or "fedbn") are bounded by rules
#: of their own, not by aggregation.max_abs_delta (which reads the parameters): an update's
#: running variance may be at most STAT_GROWTH times the global one (or STAT_GROWTH where that is
#: below 1) and never above STAT_CAP, and its running mean at most sqrt(STAT_CAP) in magnitude.
#: Honest training moves them far less (4convnet, Fashion-MNIST, 5 local epochs: variances 1 ->
#: at most 3.4 in round 1 and 10.6 by round 3); a device inflating them is refused, and what a
#: device can reach within the bounds stays finite in float32 (docs/security.md).
STAT_GROWTH = 100.0
STAT_CAP = 1e6


def statistic_problem(key: str, ref: torch.Tensor, delta: torch.Tensor) -> Rejection | None:
    """Why `ref + delta` cannot be a running statistic this round (`key` names which), or None."""
    new = ref.to(torch.float64) + delta.to(torch.float64)
    if not bool(torch.isfinite(new).all()):
        return Rejection("non-finite", f"tensor {key} contains NaN or Inf")
    if key.endswith(".running_var"):
        low = float(new.min())
        if low < 0:  # every later normalization would be NaN
            return Rejection("bad-statistic",
                             f"tensor {key} would make a running variance negative ({low:.3g})")
        over = new - torch.clamp(ref.to(torch.float64), min=1.0) * STAT_GROWTH
        if float(over.max()) > 0 or float(new.max()) > STAT_CAP:
            return Rejection("bad-statistic", (
                f"tensor {key} would make a running variance {float(new.max()):.3g}: more than "
                f"{STAT_GROWTH:g} x the global one (at least 1) or {STAT_CAP:g}"))
    elif float(new.abs().max()) > math.sqrt(STAT_CAP):
        return Rejection("bad-statistic", f"tensor {key} would make a running mean of magnitude "
                                          f"{float(new.abs().max()):.3g} > {math.sqrt(STAT_CAP):g}")
    return None


def _masked_problem(update: ClientUpdate, length: int, ring_bits: int) -> Rejection | None:
    """A secure round's update: exactly one vector of `length` ring elements, as the signed
    integers of the ring's width."""
    from fedseq.common.secagg import MASKED, RINGS

    want = getattr(torch, np.dtype(RINGS[ring_bits][1]).name)  # the ring's signed type

    if set(update.deltas) != {MASKED}:
        return Rejection("wrong-tensors", f"a secure round's update is one tensor {MASKED}, not "
                                          f"{_names(set(update.deltas))}")
    d = update.deltas[MASKED]
    if d.dtype != want or d.shape != (length,):
        return Rejection("wrong-shape", f"tensor {MASKED} is "
                         f"{str(d.dtype).removeprefix('torch.')}{list(d.shape)}, expected "
                         f"{str(want).removeprefix('torch.')}[{length}]")
    return None


@dataclass
class SitePartial:
    """What a site hands the coordinator after its k site rounds: its model's change since the
    global model (float32) and its total weight per tensor, for the clients it folded."""

    deltas: Weights
    weights: dict[str, float]
    clients: list[int]
    site: str = ""  # the site that sent it


@dataclass(frozen=True)
class RoundContract:
    """What a valid update of one round looks like (built by round_contract from what the
    coordinator knows); `admit` says why an update or a site's partial is rejected."""

    round: int
    selected: frozenset[int]
    reference: Weights  # the global tensors of the uploadable blocks: names, dtypes, shapes
    num_samples: dict[int, int]  # client -> training rows
    effective_samples: dict[int, int] | None  # FedReG: client -> original rows when rebalanced
    max_abs_delta: float
    test_samples: dict[int, int] | None = None  # client -> test rows (its local score's total)
    bounds: dict[str, float] = field(default_factory=dict)  # tensor -> its own max_abs_delta
    codec: Codec = field(default_factory=Codec)  # the updates' wire codec (wire.up)
    clip: float | None = None  # [privacy]: the largest L2 norm of a decoded update
    #: the wire form's tensors an update must have: name -> (dtype, shape)
    form: dict[str, tuple[torch.dtype, torch.Size]] = field(default_factory=dict)
    #: [secagg] on devices: the update is a masked input of this many ring elements (its
    #: values are the secure sum's to check, once unmasked), in a ring of `ring_bits`
    masked: int | None = None
    ring_bits: int = 32
    #: a client's update's weight per block (the algorithm's `aggregation_weights`); None: one
    #: per client (DP-FedAvg's sum)
    weigh: Callable[[ClientUpdate], dict[str, float]] | None = None

    def __post_init__(self) -> None:
        if not self.form:
            object.__setattr__(self, "form", expected(self.reference, self.codec))

    def _update_problem(self, update: ClientUpdate) -> Rejection | None:
        """Why `update` must be rejected (a code and its particulars), or None: whose it is, then
        its tensors' names and shapes, its encoding (decoded here, once: what the round folds
        in), its values, its norm."""
        problem = self._identity_problem(update)
        if problem is None and self.masked is not None:
            return _masked_problem(update, self.masked, self.ring_bits)
        return (problem or self._form_problem(update) or self._decoded_problem(update)
                or self._value_problem(update) or self._clip_problem(update))

    def admit(self, item: ClientUpdate | SitePartial, site: frozenset[int] = frozenset(),
              counts: dict[int, tuple[int, int | None]] | None = None, k: int = 1
              ) -> Rejection | None:
        """Why `item` cannot count in this round's fold, or None: a client's update (its
        identity, form, encoding, values and clip), or a site's partial after its `k` site
        rounds, held to the clients of `site` and the (num_samples, effective_samples) it
        `counts` for each client it claims."""
        if isinstance(item, ClientUpdate):
            return self._update_problem(item)
        return self._partial_problem(item, site, counts or {}, k)

    def _partial_problem(self, p: SitePartial, site: frozenset[int],
                         counts: dict[int, tuple[int, int | None]], k: int) -> Rejection | None:
        """A site's claimed clients must be the round's and the site's, once each, with the
        sample counts the coordinator knows; each tensor's weight the one their counts give, so
        that a site cannot weigh itself up; its tensors the round's uploaded ones in float32,
        each within k x the round's bound (k site rounds), a statistic within its own rules.
        DP-FedAvg's clip is applied when it is folded (NoisedSum.add_partial)."""
        claimed = p.clients
        if len(set(claimed)) != len(claimed) or set(claimed) != set(counts):
            return Rejection("not-selected", "it names a client more than once, or its clients "
                                             "and their counts differ")
        foreign = sorted(set(claimed) - (self.selected & site))
        if foreign:
            return Rejection("not-selected", f"it claims client(s) "
                             f"{', '.join(map(str, foreign[:10]))} that are not this round's "
                             f"clients at site {p.site}")
        expected: dict[str, float] = {}
        for c in claimed:
            n, eff = counts[c]
            wrong = self.samples_problem(c, n, eff)
            if wrong is None and self.effective_samples is None and eff is not None:
                wrong = Rejection("wrong-samples",
                                  f"effective_samples={eff}, but this round has no rebalanced sets")
            if wrong is not None:
                return Rejection(wrong.code, f"its sample counts are not the coordinator's: {wrong}")
            per_block = None if self.weigh is None else self.weigh(
                ClientUpdate(c, self.round, p.deltas, n, eff))
            for key in p.deltas:
                expected[key] = expected.get(key, 0.0) + (
                    1.0 if per_block is None else per_block[block_of(key)])
        extra = sorted(set(p.deltas) - set(self.reference))
        if extra or set(p.deltas) != set(p.weights):
            return Rejection("wrong-tensors", "its tensors are not the round's uploaded ones "
                             f"({', '.join(extra[:5]) or 'weights and deltas differ'})")
        for key, d in p.deltas.items():
            w, ref = expected[key], self.reference[key]
            if not abs(p.weights[key] - w) <= 1e-9 * max(1.0, w):  # (NaN is never within)
                return Rejection("wrong-samples",
                                 f"tensor {key}'s weight {p.weights[key]:g} is not its clients' {w:g}")
            if d.dtype != torch.float32 or d.shape != ref.shape:
                return Rejection("wrong-shape", f"tensor {key} is "
                                 f"{str(d.dtype).removeprefix('torch.')}{list(d.shape)}, "
                                 f"expected float32{list(ref.shape)}")
            problem = self._tensor_problem(key, d, k)
            if problem is not None:
                return problem
        return None

    def _identity_problem(self, update: ClientUpdate) -> Rejection | None:
        """The round, the client, its sample counts, its training, its local score."""
        c = update.client
        if update.round != self.round:
            return Rejection("wrong-round",
                             f"update is for round {update.round}, this is round {self.round}")
        if c not in self.selected:
            return Rejection("not-selected", f"client {c} is not selected in round {self.round}")
        problem = self.samples_problem(c, update.num_samples, update.effective_samples)
        if problem is not None:
            return problem
        if update.diverged_at is not None:
            return Rejection("diverged", (
                f"training diverged: the loss was NaN or Inf at batch {update.diverged_at} "
                "(lower train.lr, or check the client's data)"))
        return self.score_problem(c, update.local_score)

    def samples_problem(self, c: int, num_samples: int, effective: int | None
                        ) -> Rejection | None:
        """Client c's claimed sample counts against its own: its training rows and (FedReG)
        its rebalanced set's original rows. Also a site's claim of its clients (sites.py)."""
        if num_samples != self.num_samples.get(c):
            return Rejection("wrong-samples", f"num_samples={num_samples}, but client {c} "
                                              f"has {self.num_samples.get(c)} training rows")
        if self.effective_samples is not None and effective != self.effective_samples.get(c):
            return Rejection("wrong-samples", (
                f"effective_samples={effective}, but client {c}'s rebalanced set "
                f"holds {self.effective_samples.get(c)} original rows"))
        return None

    def score_problem(self, c: int, score: tuple[int, int] | None) -> Rejection | None:
        """Client c's local score (correct, total) against its test rows (None: no score, or
        no test rows known here). Also what a site says of its clients (sites.py)."""
        if score is not None and self.test_samples is not None:
            correct, total = score
            if total != self.test_samples.get(c) or not 0 <= correct <= total:
                return Rejection("wrong-score", f"local score {correct}/{total}, but client {c} "
                                                f"has {self.test_samples.get(c)} test rows")
        return None

    def _form_problem(self, update: ClientUpdate) -> Rejection | None:
        """The wire form's tensors: their names, then each one's dtype and shape."""
        got, want = set(update.deltas), set(self.form)
        if got != want:
            extra, missing = _names(got - want), _names(want - got)
            return Rejection("wrong-tensors", (
                f"tensors {extra or ''}{' are not uploadable this round' if extra else ''}"
                f"{'; ' if extra and missing else ''}{f'missing {missing}' if missing else ''}"))
        # in the model's order, not the frame's (a deployment's frames come in safetensors'
        # sorted order): the reason names the same tensor in a simulation and a deployment
        for k, (dtype, shape) in self.form.items():
            d = update.deltas[k]
            if d.dtype != dtype or d.shape != shape:
                return Rejection("wrong-shape", (
                    f"tensor {k} is {str(d.dtype).removeprefix('torch.')}{list(d.shape)}, "
                    f"expected {str(dtype).removeprefix('torch.')}{list(shape)}"))
        return None

    def _decoded_problem(self, update: ClientUpdate) -> Rejection | None:
        """A coded update (wire.up): whether it decodes safely; if so it is decoded in place,
        once, and checked after this as any update."""
        if self.codec.name == "none":
            return None
        problem = wire_problem(update.deltas, self.reference, self.codec,
                               lambda k: self.bounds.get(k, self.max_abs_delta))
        if problem is not None:
            return Rejection("bad-encoding", problem)
        update.upload_bytes = frame_size(update.deltas)
        update.deltas = decode(update.deltas, {k: v.shape for k, v in self.reference.items()},
                               sparse=True)  # top-k: folded entry by entry
        return None

    def _value_problem(self, update: ClientUpdate) -> Rejection | None:
        """Every element within its tensor's bound, finite; statistics within theirs."""
        for k in self.reference:
            problem = self._tensor_problem(k, update.deltas[k])
            if problem is not None:
                return problem
        return None

    def _tensor_problem(self, k: str, d: torch.Tensor, scale: int = 1) -> Rejection | None:
        """Tensor k of a contribution (a change of `scale` rounds' worth): finite, every element
        within scale x its bound; a running statistic within its own rules."""
        if is_statistic(k):
            # (a mean of statistics within these bounds stays within them: the rules hold
            # elementwise on convex sets)
            return statistic_problem(k, self.reference[k], d) if d.numel() else None
        if d.is_sparse:  # a top-k update's entries sent (its other entries are zeros)
            d = d.coalesce().values()
        biggest = largest_magnitude(d)
        bound = self.bounds.get(k, self.max_abs_delta)
        if not biggest <= scale * bound:
            if not torch.isfinite(d).all():
                return Rejection("non-finite", f"tensor {k} contains NaN or Inf")
            return Rejection("too-large", (
                f"tensor {k} has an element of magnitude {biggest:.3g} > "
                f"{f'{scale} x ' if scale != 1 else ''}the round's bound {bound:.3g} "
                "(aggregation.max_abs_delta; auto = 10 x the model's largest parameter)"))
        return None

    def _clip_problem(self, update: ClientUpdate) -> Rejection | None:
        """[privacy]: the norm the client clipped, within privacy.clip_norm: its floating-point
        tensors (a counter is not clipped); a codec that does not keep the norm (int8, top-k) is
        scaled back by the noised sum instead."""
        if self.clip is None or self.codec.norm_rounding is None:
            return None
        norm = update_norm({k: d for k, d in update.deltas.items() if d.is_floating_point()})
        if not norm <= self.clip:
            return Rejection("over-clip", (
                f"the update's L2 norm {norm:.6g} > privacy.clip_norm {self.clip:g}: the "
                "device did not clip it (differential privacy needs every update clipped)"))
        return None


def parameter_scale(weights: Weights) -> float:
    """The largest |element| of the model's parameters (running statistics left out: a device
    moves them, and `aggregation.max_abs_delta = "auto"` must not grow with what it sends)."""
    return max((largest_magnitude(v) for k, v in weights.items()
                if not is_statistic(k) and v.is_floating_point() and v.numel()), default=0.0)


def largest_magnitude(t: torch.Tensor) -> float:
    """max |t| in one pass without an |t| copy (torch.aminmax); NaN exactly when an element is
    NaN, inf when one is infinite; 0 for an empty tensor."""
    if not t.numel():
        return 0.0
    low, high = (float(v) for v in torch.aminmax(t))
    if math.isnan(low) or math.isnan(high):
        return math.nan
    return abs(max(-low, high))  # abs: all zeros give 0.0, not -0.0


def round_contract(round: int, selected: list[int], upload: tuple[str, ...], global_weights: Weights,
                   data: FederatedData, effective_of: Callable[[torch.Tensor], int | None] | None,
                   max_abs_delta: float, personal_keys: frozenset[str] = frozenset(),
                   bound_of: Callable[[str, float], float] | None = None,
                   codec: Codec | None = None, clip: float | None = None,
                   weigh: Callable[[ClientUpdate], dict[str, float]] | None = None
                   ) -> RoundContract:
    """The contract of one round, from the plan and what the coordinator knows of the clients.
    `global_weights`: what the clients were offered (the algorithm's broadcast included);
    `personal_keys`: tensors of the uploaded blocks that stay with the clients (FedBN's
    normalization layers, `BlockModel.personal_keys`), so no update may carry them;
    `bound_of(tensor, max_abs_delta)`: a tensor's own bound where the algorithm gives one
    (Algorithm.upload_bound); `codec`: the updates' wire codec (None: as they are); `clip`:
    [privacy]'s bound on a decoded update's L2 norm (None: none); `weigh`: an update's weight
    per block (None: one per client); `effective_of(counts)`: the
    effective_samples a client with these class counts must report (Algorithm.effective_samples:
    FedReG's; None for every client, or no function: none is checked)."""
    reference = {k: v for k, v in global_weights.items()
                 if block_of(k) in upload and k not in personal_keys}
    samples = {c: data.clients[c].num_train for c in selected}
    effective = None
    if effective_of is not None:  # the algorithm's own count (FedReG's rebalanced originals)
        counted = {c: effective_of(data.clients[c].train_class_counts(data.y, data.num_classes))
                   for c in selected}
        if all(n is not None for n in counted.values()):
            effective = {c: int(n) for c, n in counted.items() if n is not None}
    tests = {c: data.clients[c].num_test for c in selected}
    bounds = {} if bound_of is None else {
        k: b for k in reference if (b := bound_of(k, max_abs_delta)) != max_abs_delta}
    return RoundContract(round, frozenset(selected), reference, samples, effective, max_abs_delta,
                         tests, bounds, codec or Codec(), clip, weigh=weigh)


def score_problem(data: FederatedData, client: int, correct: int, total: int) -> str | None:
    """Why a client's reported test score cannot be true, or None: it must be a known client,
    and its total its exact test-set size."""
    if not 0 <= client < len(data.clients):
        return f"client {client} does not exist"
    expected = data.clients[client].num_test
    if total != expected or not 0 <= correct <= total:
        return f"client {client}: {correct}/{total} correct, its test set has {expected} rows"
    return None


def _names(names: set[str], shown: int = 5) -> str:
    """A few tensor names for a refusal, each one line of bounded length, and how many more: a
    reason is logged, recorded in metrics.jsonl and checkpointed every round, so it stays short
    whatever a frame carried."""
    first = sorted(names)[:shown]
    more = f" (+{len(names) - shown} more)" if len(names) > shown else ""
    return ("[" + ", ".join(repr(printable(n, 60)) for n in first) + "]" + more) if names else ""


def secure_stages(contract: RoundContract, aggregate: object
                  ) -> tuple[RoundContract, dict[str, SecureSum]]:
    """[secagg] on devices (a round's, or a site round's aggregate a SecureSum they mask for):
    they send masked inputs (the contract then wants one vector of the ring's elements) and the
    pool relays the secure sum's stages between them; else the contract as it was and nothing
    to relay."""
    if not isinstance(aggregate, SecureSum) or aggregate.local:
        return contract, {}
    return (dataclasses.replace(contract, masked=aggregate.setup.length,
                                ring_bits=aggregate.setup.ring_bits), {"secure": aggregate})
