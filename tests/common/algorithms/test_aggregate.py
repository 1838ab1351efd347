import pytest
import torch

from fedseq.common.algorithms.aggregate import WeightedDeltaSum, aggregate_weighted
from fedseq.common.errors import AggregationError


def test_weighted_mean_by_hand():
    g = {"a.w": torch.tensor([1.0, 1.0]), "b.w": torch.tensor([0.0])}
    updates = [
        ({"a.w": torch.tensor([3.0, 0.0]), "b.w": torch.tensor([2.0])}, {"a": 1, "b": 1}),
        ({"a.w": torch.tensor([0.0, 6.0])}, {"a": 2}),
    ]
    new = aggregate_weighted(g, updates)
    # a: 1 + (1*[3,0] + 2*[0,6]) / 3 = [2, 5]; b: only client 0 sent it -> 0 + 2 = 2
    assert torch.allclose(new["a.w"], torch.tensor([2.0, 5.0]))
    assert torch.allclose(new["b.w"], torch.tensor([2.0]))
    assert new["a.w"].dtype == torch.float32


def test_untouched_tensors_stay_identical():
    g = {"a.w": torch.tensor([1.0]), "c.w": torch.tensor([9.0])}
    new = aggregate_weighted(g, [({"a.w": torch.tensor([1.0])}, {"a": 5})])
    assert new["c.w"] is g["c.w"]


def test_per_block_weights_differ():
    g = {"base.w": torch.zeros(1), "head.w": torch.zeros(1)}
    ups = [
        ({"base.w": torch.ones(1), "head.w": torch.ones(1)}, {"base": 3, "head": 1}),
        ({"base.w": torch.zeros(1), "head.w": torch.zeros(1)}, {"base": 1, "head": 3}),
    ]
    new = aggregate_weighted(g, ups)
    assert new["base.w"].item() == pytest.approx(0.75) and new["head.w"].item() == pytest.approx(0.25)


def test_streaming_equals_order_independent():
    torch.manual_seed(0)
    g = {"x.w": torch.randn(5)}
    ups = [({"x.w": torch.randn(5)}, {"x": float(i + 1)}) for i in range(6)]
    a = aggregate_weighted(g, ups)
    b = aggregate_weighted(g, list(reversed(ups)))
    assert torch.allclose(a["x.w"], b["x.w"], atol=1e-6)


def test_nan_that_slipped_past_validation_refuses_the_round():
    """The round contract rejects non-finite updates; should one reach the sum anyway, apply()
    refuses the round instead of writing NaN into the model."""
    g = {"x.w": torch.tensor([1.0, 2.0])}
    acc = WeightedDeltaSum()
    acc.add({"x.w": torch.tensor([0.5, 0.5])}, {"x": 1}, client=1)
    acc.add({"x.w": torch.tensor([float("nan"), 0.0])}, {"x": 1}, client=3)
    with pytest.raises(AggregationError, match="NaN or Inf"):
        acc.apply(g)
    assert torch.equal(g["x.w"], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("bad", [[float("inf"), 0.0], [float("-inf"), 0.0],
                                 [float("inf"), float("-inf")]])
def test_inf_that_slipped_past_validation_refuses_the_round(bad):
    g = {"x.w": torch.tensor([1.0, 2.0])}
    acc = WeightedDeltaSum()
    acc.add({"x.w": torch.tensor(bad)}, {"x": 1}, client=1)
    with pytest.raises(AggregationError, match="NaN or Inf"):
        acc.apply(g)
