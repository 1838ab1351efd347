"""The round contract: every class of invalid update is rejected with a reason."""

import pytest
import torch

from conftest import synthetic_data
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.server.validation import largest_magnitude, round_contract

W = {"conv1.weight": torch.zeros(2, 1, 3, 3), "conv1.bias": torch.zeros(2), "fc2.weight": torch.zeros(4, 2)}


def _contract(threshold=None):
    data = synthetic_data()
    return data, round_contract(3, [0, 2], ("conv1",), W, data, threshold, max_abs_delta=100.0)


def _good(data, client=0):
    return ClientUpdate(client, 3, {"conv1.weight": torch.full((2, 1, 3, 3), 0.01),
                                    "conv1.bias": torch.zeros(2)}, len(data.clients[client].train))


def test_valid_update_passes():
    data, c = _contract()
    assert c.check(_good(data)) is None
    u = _good(data)
    u.local_score = (1, len(data.clients[0].test))
    assert c.check(u) is None


@pytest.mark.parametrize("mutate, words", [
    (lambda u: setattr(u, "num_samples", 10**12), "num_samples=1000000000000"),
    (lambda u: setattr(u, "num_samples", 0), "training rows"),
    (lambda u: setattr(u, "client", 1), "not selected"),
    (lambda u: setattr(u, "round", 2), "round 2"),
    (lambda u: u.deltas.update({"conv1.bias": torch.zeros(2, dtype=torch.float64)}), "float64"),
    (lambda u: u.deltas.update({"conv1.bias": torch.zeros(2, dtype=torch.int64)}), "int64"),
    (lambda u: u.deltas.update({"conv1.bias": torch.zeros(3)}), "expected float32[2]"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([1e30, 0.0])}), "max_abs_delta"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([float("inf"), 0.0])}), "NaN or Inf"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([0.0, float("-inf")])}), "NaN or Inf"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([float("nan"), 0.0])}), "NaN or Inf"),
    (lambda u: u.deltas.update({"conv1.bias": torch.tensor([0.0, -1e30])}), "max_abs_delta"),
    (lambda u: u.deltas.update({"fc2.weight": torch.zeros(4, 2)}), "not uploadable"),
    (lambda u: u.deltas.pop("conv1.bias"), "missing"),
    (lambda u: setattr(u, "local_score", (5, 10**6)), "local score"),
    (lambda u: setattr(u, "local_score", (-1, 0)), "local score"),
])
def test_invalid_updates_are_rejected(mutate, words):
    data, c = _contract()
    u = _good(data)
    mutate(u)
    reason = c.check(u)
    assert reason is not None and words in reason, reason


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
    assert c.check(u) is None
    u.effective_samples += 1
    assert "effective_samples" in c.check(u)


def test_the_reason_names_the_same_tensor_whatever_the_frame_order():
    """A deployment's frames come in sorted key order, a simulation's in the model's: the
    first offending tensor is the model's first, either way."""
    data, c = _contract()
    bad = {"conv1.weight": torch.full((2, 1, 3, 3), float("nan")), "conv1.bias": torch.full((2,), 1e30)}
    reasons = {c.check(ClientUpdate(0, 3, dict(order), len(data.clients[0].train)))
               for order in (bad.items(), sorted(bad.items()))}
    assert reasons == {"tensor conv1.weight contains NaN or Inf"}


def test_a_refusal_stays_short_whatever_the_frame_carried():
    """Hardening III, finding 11: 100,000 extra tensors with long names (a 2.3 MB frame's worth)
    give a reason of a few hundred characters, each name one line of plain text."""
    data, c = _contract()
    u = _good(data)
    u.deltas.update({f"x{i:06d}\n" + "y" * 200: torch.zeros(0) for i in range(100_000)})
    reason = c.check(u)
    assert reason is not None and "not uploadable" in reason and "(+99995 more)" in reason
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
    assert running.check(ClientUpdate(0, 3, ok, n)) is None
    bad = {**ok, "conv1.1.running_var": torch.tensor([-0.5, -1.5])}
    reason = running.check(ClientUpdate(0, 3, bad, n))
    assert reason == "tensor conv1.1.running_var would make a running variance negative (-0.5)"
    fedbn = round_contract(3, [0], ("conv1",), w, data, None, max_abs_delta=100.0,
                           personal_keys=frozenset(k for k in w if k.startswith("conv1.1.")))
    assert "not uploadable" in fedbn.check(ClientUpdate(0, 3, ok, n))
    assert fedbn.check(ClientUpdate(0, 3, {"conv1.0.weight": ok["conv1.0.weight"]}, n)) is None
