"""Robust aggregation: one Byzantine update among honest ones moves the model by at most the rule's
bound (hand-checkable tensors)."""

import math

import pytest
import torch

from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.algorithms.robust import ClippedMean, CoordinateWise, build_rule, update_norm
from fedseq.common.config import AggregationConfig

G = {"a.w": torch.zeros(4), "b.w": torch.zeros(2, 2)}
HONEST = [
    {"a.w": torch.tensor([0.1, 0.2, 0.0, -0.1]), "b.w": torch.full((2, 2), 0.05)},
    {"a.w": torch.tensor([0.2, 0.1, 0.1, -0.2]), "b.w": torch.full((2, 2), 0.02)},
    {"a.w": torch.tensor([0.0, 0.3, 0.1, 0.0]), "b.w": torch.full((2, 2), -0.01)},
    {"a.w": torch.tensor([0.1, 0.1, -0.1, -0.1]), "b.w": torch.full((2, 2), 0.00)},
]
EVIL = {"a.w": torch.full((4,), -1e3), "b.w": torch.full((2, 2), 1e3)}


def _run(agg, updates, weight=1.0):
    for i, d in enumerate(updates):
        agg.add(d, {"a": weight, "b": weight}, i)
    return agg.apply(G)


def _distance(x, y):
    return update_norm({k: x[k] - y[k] for k in x})


def test_update_norm_is_l2_over_all_tensors():
    assert update_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}) == pytest.approx(5.0)


def test_update_norm_is_bitwise_the_float64_sum_of_squares():
    """Its value decides clipping (results): squaring in place must give exactly what
    d.double().pow(2).sum() gives, for every dtype a delta may have."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for n in (1, 17, 4099, 300_000):
            deltas = {"a": (torch.randn(n, generator=g) * 1e-3).to(dtype),
                      "b": (torch.randn(3, 5, generator=g) * 50).to(dtype)}
            before = {k: v.clone() for k, v in deltas.items()}
            want = math.sqrt(sum(float(d.double().pow(2).sum()) for d in deltas.values()))
            assert update_norm(deltas) == want
            assert all(torch.equal(deltas[k], before[k]) for k in deltas)  # left as it was


def test_mean_is_moved_arbitrarily_by_one_byzantine_update():
    clean = _run(WeightedDeltaSum(), HONEST)
    dirty = _run(WeightedDeltaSum(), HONEST + [EVIL])
    assert _distance(clean, dirty) > 100


@pytest.mark.parametrize("clip_norm", [0.5, None])
def test_clipped_mean_bounds_one_byzantine_update(clip_norm):
    agg = ClippedMean(clip_norm=clip_norm, clip_factor=2.0)
    dirty = _run(agg, HONEST + [EVIL])
    honest_clipped = _run(ClippedMean(clip_norm=agg.bound), HONEST)
    # with five equal weights, the evil update contributes at most bound / 5 ...
    n = len(HONEST) + 1
    evil_share = _distance(dirty, _run(ClippedMean(clip_norm=agg.bound), HONEST + [
        {k: torch.zeros_like(v) for k, v in EVIL.items()}]))
    assert evil_share <= agg.bound / n * (1 + 1e-6)
    # ... and the honest ones are only re-weighted (4/5 of their clipped mean)
    four_fifths = {k: v * (len(HONEST) / n) for k, v in honest_clipped.items()}
    assert _distance(dirty, four_fifths) <= agg.bound / n * (1 + 1e-6)
    if clip_norm is None:  # 2 x the median of the five norms
        norms = sorted(update_norm(d) for d in HONEST + [EVIL])
        assert agg.bound == pytest.approx(2.0 * norms[2])


def test_clipping_leaves_small_updates_exact():
    plain = _run(WeightedDeltaSum(), HONEST)
    clipped = _run(ClippedMean(clip_norm=10.0), HONEST)
    assert all(torch.allclose(plain[k], clipped[k]) for k in plain)


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_coordinate_wise_rules_stay_in_the_honest_range(rule):
    agg = build_rule(AggregationConfig(rule=rule, trim_ratio=0.2)).round()
    dirty = _run(agg, HONEST + [EVIL])
    for k in G:
        stack = torch.stack([d[k] for d in HONEST])
        lo, hi = stack.min(0).values, stack.max(0).values
        assert (dirty[k] >= lo - 1e-7).all() and (dirty[k] <= hi + 1e-7).all(), (rule, k)


def test_median_and_trimmed_mean_by_hand():
    ups = [{"a.w": torch.tensor([v])} for v in (1.0, 2.0, 3.0, 10.0)]
    g = {"a.w": torch.zeros(1)}
    med = CoordinateWise(None)
    trim = CoordinateWise(0.25)  # ceil(0.25 * 4) = 1 per end -> mean(2, 3)
    for i, u in enumerate(ups):
        med.add(u, {"a": 1.0}, i)
        trim.add(u, {"a": 1.0}, i)
    assert float(med.apply(g)["a.w"]) == pytest.approx(2.5)
    assert float(trim.apply(g)["a.w"]) == pytest.approx(2.5)
    assert trim.trimmed(4) == 1


def test_mean_rule_is_the_exact_weighted_sum():
    assert isinstance(build_rule(AggregationConfig()).round(), WeightedDeltaSum)


def _by_device(agg, updates):
    """updates: (device, deltas) pairs, weight 1 each."""
    for i, (dev, d) in enumerate(updates):
        agg.add(d, {"a": 1.0, "b": 1.0}, i, dev)
    return agg.apply(G)


def _in_honest_range(result, honest):
    for k in G:
        stack = torch.stack([d[k] for d in honest])
        lo, hi = stack.min(0).values, stack.max(0).values
        if not ((result[k] >= lo - 1e-7).all() and (result[k] <= hi + 1e-7).all()):
            return False
    return True


def test_one_login_with_two_clients_breaks_per_client_trimming_but_not_per_device_votes():
    """The issue's case: trimmed-mean at its default ratio, six updates, two of them from the
    attacker's device. Counted per client, one evil update survives the trim; one vote per device
    keeps every coordinate within the honest devices' range."""
    honest = [("d1", HONEST[0]), ("d2", HONEST[1]), ("d3", HONEST[2]), ("d4", HONEST[3])]
    evil = [("d5", EVIL), ("d5", EVIL)]
    per_client = _by_device(CoordinateWise(0.1, byzantine=0),
                            [(None, d) for _, d in honest + evil])
    assert not _in_honest_range(per_client, HONEST)
    per_device = _by_device(CoordinateWise(0.1, byzantine=1), honest + evil)
    assert _in_honest_range(per_device, HONEST)


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_f_byzantine_devices_stay_bounded(rule):
    """f = 2 bad devices among 5 (2f+1), each holding several clients."""
    agg = build_rule(AggregationConfig(rule=rule, byzantine_devices=2)).round()
    ups = [("h1", HONEST[0]), ("h2", HONEST[1]), ("h3", HONEST[2])]
    ups += [("x", EVIL)] * 3 + [("y", {k: -v for k, v in EVIL.items()})] * 2
    assert _in_honest_range(_by_device(agg, ups), HONEST[:3])


@pytest.mark.parametrize("rule", ["median", "trimmed-mean", "clipped-mean"])
def test_a_round_below_the_rules_quorum_is_refused(rule):
    """Only the attacker (or too few devices) reported: the round fails, nothing is applied."""
    from fedseq.common.errors import AggregationError

    agg = build_rule(AggregationConfig(rule=rule)).round()  # f = 1: three devices needed
    with pytest.raises(AggregationError, match="2 devices reported.*needs at least 3"):
        _by_device(agg, [("evil", EVIL), ("evil", EVIL), ("h1", HONEST[0])])


def test_a_devices_vote_is_its_clients_weighted_mean():
    agg = CoordinateWise(None, byzantine=0)
    agg.add({"a.w": torch.tensor([1.0])}, {"a": 1.0}, 0, "d")
    agg.add({"a.w": torch.tensor([4.0])}, {"a": 3.0}, 1, "d")
    assert float(agg.apply({"a.w": torch.zeros(1)})["a.w"]) == pytest.approx(3.25)


def test_clipped_mean_bounds_a_device_by_its_weight_share():
    """A device with three clients, each at the bound in the same direction: clipped as one vote,
    it moves the model by at most (its weight / all the weight) x bound."""
    bound = 0.3
    evil = {k: torch.full_like(v, 7.0) for k, v in G.items()}
    zero = {k: torch.zeros_like(v) for k, v in G.items()}
    ups = [("h1", zero), ("h2", zero), ("h3", zero)] + [("x", evil)] * 3
    moved = _distance(_by_device(ClippedMean(clip_norm=bound), ups), G)
    assert moved == pytest.approx(3 / 6 * bound)  # its three clients' weight over six


def test_byzantine_devices_needs_a_robust_rule():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs a robust rule"):
        AggregationConfig(rule="mean", byzantine_devices=1)
    assert AggregationConfig(rule="median").byzantine() == 1
    assert AggregationConfig().byzantine() == 0


def test_krum_applies_an_honest_vote_whole_and_ignores_the_attacker():
    """Krum (Blanchard et al. 2017): with n = 5 >= 2f + 3 votes, the one whose n - f - 2 nearest
    are closest is applied unchanged; the attacker's far-away vote is never it."""
    agg = build_rule(AggregationConfig(rule="krum")).round()
    out = _run(agg, HONEST + [EVIL])
    assert agg.chosen in range(len(HONEST))
    assert all(torch.equal(out[k], G[k] + HONEST[agg.chosen][k]) for k in G)
    # by hand: scores are the sums of squared distances to the n - f - 2 = 3 nearest other votes
    votes = HONEST + [EVIL]
    flat = [torch.cat([v[k].double().flatten() for k in G]) for v in votes]
    scores = [sorted(float((flat[i] - flat[j]).pow(2).sum()) for j in range(5) if j != i)[:3]
              for i in range(5)]
    assert agg.chosen == min(range(5), key=lambda i: sum(scores[i]))


def test_krum_needs_2f_plus_3_devices():
    from fedseq.common.errors import AggregationError

    agg = build_rule(AggregationConfig(rule="krum")).round()  # f = 1: five devices
    with pytest.raises(AggregationError, match="4 devices reported; the krum rule .* at least 5"):
        _run(agg, HONEST)
