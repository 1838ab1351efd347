import pytest

from fedseq.common.algorithms import make_algorithm
from fedseq.common.algorithms.fedseq import trainable_blocks, unfreeze_schedule
from fedseq.common.config import load_config
from fedseq.common.errors import ConfigError
from fedseq.common.models import build_model

BASE = ("conv1", "conv2", "fc1")


def _alg(name, *over):
    cfg = load_config(None, [f"algorithm.name={name}", *over])
    return make_algorithm(cfg, build_model("cnn", (1, 28, 28), 10).spec)


def test_vanilla_forward_and_anti_reverse_every_round():
    alg_v = _alg("fedseq-vanilla", "rounds=6", "algorithm.unfreeze_rounds=[0,2,4]")
    alg_a = _alg("fedseq-anti", "rounds=6", "algorithm.unfreeze_rounds=[0,2,4]")
    expect_v = [("conv1",)] * 2 + [("conv1", "conv2")] * 2 + [BASE] * 2
    expect_a = [("fc1",)] * 2 + [("conv2", "fc1")] * 2 + [BASE] * 2
    for t in range(6):
        pv, pa = alg_v.plan(t), alg_a.plan(t)
        assert pv.trainable == expect_v[t] and pv.upload == expect_v[t]
        assert pa.trainable == expect_a[t] and pa.upload == expect_a[t]
        assert "fc2" not in pv.trainable + pa.trainable  # head frozen during federation
        assert pv.uses[-1] == "fc2" or "fc2" in pv.uses  # but used in the forward pass


def test_t1_later_than_zero_trains_nothing_before_it():
    assert trainable_blocks(BASE, [2, 3, 4], 1, anti=False) == ()
    assert trainable_blocks(BASE, [2, 3, 4], 2, anti=True) == ("fc1",)


def test_blocks_scheduled_after_the_last_round_stay_frozen():
    alg = _alg("fedseq-vanilla", "rounds=100", "algorithm.unfreeze_rounds=[0,100,200]")
    assert all(alg.plan(t).trainable == ("conv1",) for t in (0, 50, 99))


def test_default_schedule_is_evenly_spaced():
    assert unfreeze_schedule(100, 3, []) == [0, 33, 66]
    assert unfreeze_schedule(300, 3, []) == [0, 100, 200]


def test_schedule_length_must_match_blocks():
    with pytest.raises(ConfigError, match="3 base blocks"):
        _alg("fedseq-anti", "rounds=10", "algorithm.unfreeze_rounds=[0,5]")


def test_finetune_trains_everything():
    ft = _alg("fedseq-anti").finetune_plan()
    assert ft is not None and set(ft.trainable) == set(BASE + ("fc2",))
    assert ft.upload == ()
