"""The round contract: every class of invalid update is rejected with a reason."""

import pytest
import torch

from conftest import synthetic_data
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.server.rounds.contract import (
    STAT_CAP,
    STAT_GROWTH,
    largest_magnitude,
    parameter_scale,
    round_contract,
)

W = {"conv1.weight": torch.zeros(2, 1, 3, 3), "conv1.bias": torch.zeros(2), "fc2.weight": torch.zeros(4, 2)}


def _contract(threshold=None):
    """The contract of round 3; with `threshold`, FedReG's effective count (its rebalanced
    set's original rows at that C) is checked."""
    from fedseq.common.data.rebalance import rebalanced_size

    data = synthetic_data()
    effective = None if threshold is None else (lambda counts: rebalanced_size(counts, threshold)[1])
    return data, round_contract(3, [0, 2], ("conv1",), W, data, effective, max_abs_delta=100.0)


def _good(data, client=0):
    return ClientUpdate(client, 3, {"conv1.weight": torch.full((2, 1, 3, 3), 0.01),
                                    "conv1.bias": torch.zeros(2)}, len(data.clients[client].train))


def test_valid_update_passes():
    data, c = _contract()
    assert c.admit(_good(data)) is None
    u = _good(data)
    u.local_score = (1, len(data.clients[0].test))
    assert c.admit(u) is None


@pytest.mark.parametrize("mutate, words, code", [
    (lambda u: setattr(u, "num_samples", 10**12), "num_samples=1000000000000", "wrong-samples"),
    (lambda u: setattr(u, "num_samples", 0), "training rows", "wrong-samples"),
    (lambda u: setattr(u, "client", 1), "not selected", "not-selected"),
    (lambda u: setattr(u, "round", 2), "round 2", "wrong-round"),
    (lambda u: u.deltas.update({"conv1.bias": torch.zeros(2, dtype=torch.float64)}),
     "float64", "wrong-shape"),
    (lambda u: u.deltas.update({"conv1.bias": torch.zeros(2, dtype=torch.int64)}), "int64", "wrong-shape"),
    (lambda u: u.deltas.update({"conv1.bias": torch.zeros(3)}), "expected float32[2]", "wrong-shape"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([1e30, 0.0])}), "max_abs_delta", "too-large"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([float("inf"), 0.0])}),
     "NaN or Inf", "non-finite"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([0.0, float("-inf")])}),
     "NaN or Inf", "non-finite"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([float("nan"), 0.0])}),
     "NaN or Inf", "non-finite"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([0.0, -1e30])}), "max_abs_delta", "too-large"),
    (lambda u: u.deltas.update({"fc2.weight": torch.zeros(4, 2)}), "not uploadable", "wrong-tensors"),
    (lambda u: u.deltas.pop("conv1.bias"), "missing", "wrong-tensors"),
    (lambda u: setattr(u, "local_score", (5, 10**6)), "local score", "wrong-score"),
    (lambda u: setattr(u, "local_score", (-1, 0)), "local score", "wrong-score"),
])
def test_invalid_updates_are_rejected(mutate, words, code):
    """Each refusal: its code (the closed set, records.Refusal) and its particulars in words."""
    data, c = _contract()
    u = _good(data)
    mutate(u)
    reason = c.admit(u)
    assert reason is not None and words in reason.text and reason.code == code, reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_largest_magnitude_is_max_abs(dtype):
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 33, 10_000):
        t = (torch.randn(n, generator=g) * 7).to(dtype)
        assert largest_magnitude(t) == float(t.abs().max())
    assert str(largest_magnitude(torch.zeros(3, dtype=dtype))) == "0.0"  # not -0.0
    assert largest_magnitude(torch.zeros(0, dtype=dtype)) == 0.0
    assert largest_magnitude(torch.tensor([1.0, float("-inf")], dtype=dtype)) == float("inf")
    assert largest_magnitude(torch.tensor([float("nan"), 2.0], dtype=dtype)) != 0.0  # NaN


def test_fedreg_effective_count_must_be_exact():
    data, c = _contract(threshold=30.0)
    u = _good(data)
    u.effective_samples = c.effective_samples[0]
    assert c.admit(u) is None
    u.effective_samples += 1
    assert "effective_samples" in str(c.admit(u))


def test_the_reason_names_the_same_tensor_whatever_the_frame_order():
    """A deployment's frames come in sorted key order, a simulation's in the model's: the
    first offending tensor is the model's first, either way."""
    data, c = _contract()
    bad = {"conv1.weight": torch.full((2, 1, 3, 3), float("nan")), "conv1.bias": torch.full((2,), 1e30)}
    reasons = {str(c.admit(ClientUpdate(0, 3, dict(order), len(data.clients[0].train))))
               for order in (bad.items(), sorted(bad.items()))}
    assert reasons == {"tensor conv1.weight contains NaN or Inf"}


def test_a_refusal_stays_short_whatever_the_frame_carried():
    """Hardening III, finding 11: 100,000 extra tensors with long names (a 2.3 MB frame's worth)
    give a reason of a few hundred characters, each name one line of plain text."""
    data, c = _contract()
    u = _good(data)
    u.deltas.update({f"x{i:06d}\n" + "y" * 200: torch.zeros(0) for i in range(100_000)})
    reason = str(c.admit(u))
    assert "not uploadable" in reason and "(+99995 more)" in reason
    assert len(reason) < 600 and "\n" not in reason, len(reason)


def test_normalization_state_in_the_contract():
    """Running statistics travel with their block, but a running variance may not go below zero
    (a NaN in every later normalization); under FedBN the normalization layers are personal, so
    no update may carry them."""
    data = synthetic_data()
    w = {"conv1.0.weight": torch.zeros(2, 1, 3, 3), "conv1.1.weight": torch.ones(2),
         "conv1.1.running_mean": torch.zeros(2), "conv1.1.running_var": torch.ones(2)}
    running = round_contract(3, [0], ("conv1",), w, data, None, max_abs_delta=100.0)
    n = len(data.clients[0].train)
    ok = {k: torch.full_like(v, -0.5) for k, v in w.items()}
    assert running.admit(ClientUpdate(0, 3, ok, n)) is None
    bad = {**ok, "conv1.1.running_var": torch.tensor([-0.5, -1.5])}
    reason = running.admit(ClientUpdate(0, 3, bad, n))
    assert reason is not None and reason.code == "bad-statistic"
    assert reason.text == "tensor conv1.1.running_var would make a running variance negative (-0.5)"
    fedbn = round_contract(3, [0], ("conv1",), w, data, None, max_abs_delta=100.0,
                           personal_keys=frozenset(k for k in w if k.startswith("conv1.1.")))
    assert "not uploadable" in str(fedbn.admit(ClientUpdate(0, 3, ok, n)))
    assert fedbn.admit(ClientUpdate(0, 3, {"conv1.0.weight": ok["conv1.0.weight"]}, n)) is None


def test_running_statistics_have_bounds_of_their_own():
    """Hardening IV, finding 3: a running variance may grow at most STAT_GROWTH-fold a round
    (from at least 1) and never past STAT_CAP, a running mean stays within sqrt(STAT_CAP); within
    them a statistic may move further than max_abs_delta (which reads the parameters), and the
    automatic bound does not grow with the statistics."""
    data = synthetic_data()
    w = {"conv1.0.weight": torch.full((2, 1, 3, 3), 0.1), "conv1.1.weight": torch.ones(2),
         "conv1.1.running_mean": torch.zeros(2), "conv1.1.running_var": torch.ones(2)}
    c = round_contract(3, [0], ("conv1",), w, data, None, max_abs_delta=5.0)
    n = len(data.clients[0].train)
    zero = {k: torch.zeros_like(v) for k, v in w.items()}

    def check(**stats):
        return str(c.admit(ClientUpdate(0, 3, {**zero, **{f"conv1.1.{k}": torch.tensor(v)
                                                          for k, v in stats.items()}}, n)))

    assert check(running_var=[48.0, 0.0], running_mean=[30.0, -30.0]) == "None"  # > 5: allowed
    assert "more than 100 x the global one" in check(running_var=[STAT_GROWTH, 0.0])
    assert "running mean of magnitude" in check(running_mean=[2e3, 0.0])
    assert "NaN or Inf" in check(running_var=[float("inf"), 0.0])
    inflated = {**w, "conv1.1.running_var": torch.full((2,), 1e30)}
    assert parameter_scale(inflated) == parameter_scale(w) == 1.0
    big = round_contract(3, [0], ("conv1",), inflated, data, None, max_abs_delta=5.0)
    var = torch.full((2,), 1e30 * (STAT_GROWTH - 1))  # within the growth, past the cap
    assert "or 1e+06" in str(big.admit(ClientUpdate(0, 3, {**zero, "conv1.1.running_var": var}, n)))


@pytest.mark.parametrize("factor", [1e3, STAT_GROWTH * 0.999])
def test_a_device_inflating_its_statistics_for_100_rounds(factor):
    """Hardening IV, finding 3: one device of three inflates its running variances every round
    for 100 rounds, by far (x1000) or just within the growth bound, under the mean (which any
    one device moves). The run ends with finite weights; the far one is refused every round,
    with the reason, and the one within the bound is refused once its variances would pass
    STAT_CAP."""
    from fedseq.common.algorithms.robust import build_rule
    from fedseq.common.config import AggregationConfig

    data = synthetic_data()
    g = {"conv1.0.weight": torch.full((4, 1, 3, 3), 0.1), "conv1.1.running_var": torch.ones(4)}
    n = {c: len(data.clients[c].train) for c in range(3)}
    refused = []
    for t in range(100):
        contract = round_contract(t, [0, 1, 2], ("conv1",), g, data, None,
                                  AggregationConfig().delta_bound(parameter_scale(g)))
        agg = build_rule(AggregationConfig()).round()
        var = g["conv1.1.running_var"]
        for client in range(3):
            honest = 0.5 * (4.0 - var)  # the variance its data has is 4
            d = {"conv1.0.weight": torch.full_like(g["conv1.0.weight"], 0.01),
                 "conv1.1.running_var": honest if client else var * factor - var}
            u = ClientUpdate(client, t, d, n[client], device=f"d{client}")
            reason = contract.admit(u)
            if reason is not None:
                assert client == 0 and "running variance" in reason.text, reason
                refused.append(t)
                continue
            agg.add(d, {"conv1": float(n[client])}, client, f"d{client}")
        g = agg.apply(g)
        assert all(bool(torch.isfinite(v).all()) for v in g.values()), t
    assert float(g["conv1.1.running_var"].max()) <= STAT_CAP
    if factor > STAT_GROWTH:
        assert refused == list(range(100))
    else:
        assert refused and refused[0] > 0  # within the bound at first, refused at the cap


@pytest.mark.parametrize("rule", ["mean", "median"])
def test_every_rule_checks_finiteness_in_the_models_dtype(rule):
    """A float64 aggregate can be finite and overflow float32: every rule refuses the round."""
    from fedseq.common.algorithms.robust import build_rule
    from fedseq.common.config import AggregationConfig
    from fedseq.common.errors import AggregationError

    g = {"w": torch.full((3,), 3e38)}
    agg = build_rule(AggregationConfig(rule=rule, byzantine_devices=0 if rule == "mean" else 1)).round()
    for c in range(3):
        agg.add({"w": torch.full((3,), 3e38)}, {"w": 1.0}, c, f"d{c}")
    with pytest.raises(AggregationError, match="NaN or Inf in torch.float32"):
        agg.apply(g)
