"""Record-level DP-SGD (common/dpsgd.py): each example's gradient clipped, the sum noised, the
device floor refusing it in one line."""

from __future__ import annotations

import pytest
import torch

from fedseq.common.algorithms.hooks import UnknownAlgorithm, client_side
from fedseq.common.algorithms.plan import ClientPlan, Objective, Phase, plan_from_dict, plan_to_dict
from fedseq.common.models import BlockModel, ModelSpec


class Tiny(BlockModel):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3)
        self.spec = ModelSpec(("body",), "head", None)

    def features(self, x):
        return torch.relu(self.body(x))


def _plan(record_dp=None):
    return ClientPlan(phases=(Phase(1, (Objective(("head",), ("body", "head")),)),),
                      upload=("body", "head"), record_dp=record_dp)


def test_a_plan_carries_dp_sgd_only_where_asked():
    assert "record_dp" not in plan_to_dict(_plan())  # a plain plan reads as it did before
    plan = _plan((1.5, 0.8))
    assert plan_from_dict(plan_to_dict(plan)).record_dp == (1.5, 0.8)


def test_the_device_floor_refuses_dp_sgd_in_one_line(monkeypatch):
    from fedseq.common import dpsgd

    monkeypatch.setattr(dpsgd.torch, "__version__", "1.12.1")
    with pytest.raises(UnknownAlgorithm) as err:
        client_side(_plan((1.0, 1.0)))
    assert "torch >= 2.0" in str(err.value) and "1.12.1" in str(err.value)
    assert "\n" not in str(err.value)
    client_side(_plan())  # without DP-SGD: as before


def _step(model, x, y, clip, noise, seed=0):
    from fedseq.common.dpsgd import DpSgd

    params = list(model.parameters())
    dp = DpSgd(model, clip, noise, len(x), torch.Generator().manual_seed(seed))
    try:
        for p in params:
            p.grad = None
        dp.follow()  # hooks on the layers that train (before every forward pass)
        loss = torch.nn.functional.cross_entropy(model.head(model.features(x)), y)
        loss.backward()
        dp.privatize(params)
        return [p.grad.clone() for p in params]
    finally:
        dp.close()


def test_each_examples_gradient_is_clipped_before_the_mean():
    """Without noise the step's gradient is the mean of the per-example gradients, each scaled
    to an L2 norm of at most C (over all the step's parameters as one vector), computed here one
    example at a time."""
    pytest.importorskip("opacus")
    torch.manual_seed(0)
    model = Tiny()
    x, y = torch.randn(8, 6) * 5, torch.randint(0, 3, (8,))
    got = _step(model, x, y, clip=0.3, noise=0.0)
    want = [torch.zeros_like(p) for p in model.parameters()]
    clipped = 0
    for i in range(len(x)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model.head(model.features(x[i:i + 1])), y[i:i + 1]
                                          ).backward()
        g = [p.grad.clone() for p in model.parameters()]
        norm = torch.sqrt(sum((t ** 2).sum() for t in g))
        scale = min(1.0, 0.3 / (float(norm) + 1e-6))
        clipped += scale < 1
        for w, t in zip(want, g):
            w += t * scale / len(x)
    assert clipped > 0  # the bound did bite
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_noise_has_the_configured_standard_deviation():
    """The noise on the averaged gradient is N(0, (z C / B)^2) per coordinate, from the
    client's seeded stream (the same seed, the same noise)."""
    pytest.importorskip("opacus")
    torch.manual_seed(1)
    model = Tiny()
    model.body = torch.nn.Linear(6, 4000)
    model.head = torch.nn.Linear(4000, 3)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    quiet = _step(model, x, y, clip=1.0, noise=0.0)
    loud = _step(model, x, y, clip=1.0, noise=2.0)
    noise = torch.cat([(a - b).flatten() for a, b in zip(loud, quiet)])
    want = 2.0 * 1.0 / 4  # z C / B
    assert abs(float(noise.std()) / want - 1) < 0.02 and abs(float(noise.mean())) < 0.01
    again = _step(model, x, y, clip=1.0, noise=2.0)
    assert all(torch.equal(a, b) for a, b in zip(loud, again))
