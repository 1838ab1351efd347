"""The server optimizers (FedAvgM, FedAdam, FedYogi): Reddi et al.'s Algorithm 2 step by step,
their state across rounds and refused rounds (their runs: tests/server/test_server_optimizers.py)."""

import math

import pytest
import torch

from fedseq.common.algorithms import make_algorithm
from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.config import ExperimentConfig, load_config
from fedseq.common.errors import AggregationError
from fedseq.common.models import ModelSpec

SPEC = ModelSpec(("conv1",), "fc", None)


def _alg(name, *over):
    return make_algorithm(load_config(None, [f"algorithm.name={name}", *over]), SPEC)


def _round(alg, weights, *deltas):
    """One round: the updates' (equal-weight) mean folded in, then the algorithm's step."""
    acc = WeightedDeltaSum()
    for i, d in enumerate(deltas):
        acc.add(d, {"conv1": 1.0, "fc": 1.0}, i)
    return alg.server_update(weights, acc).weights


def _reference(name, lr, b1, b2, tau, deltas):
    """Algorithm 2 of Reddi et al. written out in float64 for one scalar parameter at 0."""
    x, m, v = 0.0, 0.0, tau * tau
    for d in deltas:
        if name == "fedavgm":
            m = b1 * m + d
            x += lr * m
            continue
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d if name == "fedadam" else \
            v - (1 - b2) * d * d * math.copysign(1.0, v - d * d) * (v != d * d)
        x += lr * m / (math.sqrt(v) + tau)
    return x


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi"])
def test_three_rounds_follow_algorithm_2(name):
    """Growing then shrinking mean deltas, so that Yogi's sign term takes both signs."""
    alg = _alg(name, "algorithm.server_lr=0.5", "algorithm.beta1=0.8", "algorithm.beta2=0.9",
               "algorithm.tau=0.01")
    w = {"conv1.weight": torch.zeros(1, dtype=torch.float64), "fc.weight": torch.zeros(1)}
    means = [0.3, 0.9, 0.05]
    for i in range(3):
        # two clients whose mean is means[i]
        step = [{"conv1.weight": torch.tensor([means[i] + s], dtype=torch.float64)} for s in (-.1, .1)]
        w = _round(alg, w, *step)
        want = _reference(name, 0.5, 0.8, 0.9, 0.01, means[: i + 1])
        assert w["conv1.weight"].item() == pytest.approx(want, rel=1e-9, abs=1e-12), (i, name)
        assert w["fc.weight"].item() == 0.0  # nobody sent it: no step, no state
    assert set(alg.server_state()) == ({"m/conv1.weight"} if name == "fedavgm"
                                       else {"m/conv1.weight", "v/conv1.weight"})


def test_adam_and_yogi_part_where_the_update_shrinks():
    """About the same first step (v starts at tau^2: Adam keeps beta2 tau^2 of it, Yogi all);
    after a large delta, a small one: Adam's v decays multiplicatively, Yogi's only additively,
    so Yogi keeps the larger v and takes the smaller step."""
    got = {}
    for name in ("fedadam", "fedyogi"):
        alg = _alg(name, "algorithm.server_lr=1")
        w = {"conv1.weight": torch.zeros(1, dtype=torch.float64)}
        steps = []
        for d in (1.0, 0.01):
            before = w["conv1.weight"].item()
            w = _round(alg, w, {"conv1.weight": torch.tensor([d], dtype=torch.float64)})
            steps.append(w["conv1.weight"].item() - before)
        got[name] = (steps, alg.server_state()["v/conv1.weight"].item())
    assert got["fedadam"][0][0] == pytest.approx(got["fedyogi"][0][0], rel=1e-5)
    assert got["fedyogi"][1] > got["fedadam"][1]
    assert got["fedyogi"][0][1] < got["fedadam"][0][1]


def test_running_statistics_take_the_mean_and_no_state():
    alg = _alg("fedadam")
    w = {"conv1.weight": torch.zeros(2), "conv1.running_mean": torch.zeros(2),
         "conv1.num_batches_tracked": torch.tensor(3)}
    new = _round(alg, w, {"conv1.weight": torch.ones(2), "conv1.running_mean": torch.ones(2)},
                 {"conv1.weight": torch.ones(2), "conv1.running_mean": 3 * torch.ones(2)})
    assert torch.equal(new["conv1.running_mean"], 2 * torch.ones(2))  # FedAvg's mean
    assert new["conv1.num_batches_tracked"] is w["conv1.num_batches_tracked"]
    assert set(alg.server_state()) == {"m/conv1.weight", "v/conv1.weight"}


def test_a_refused_step_leaves_the_state_as_it_was():
    """A step that overflows the model's dtype refuses the round (AggregationError) without
    touching the optimizer's moments: the next round starts from the last applied one."""
    alg = _alg("fedavgm", "algorithm.server_lr=1e30")
    w = {"conv1.weight": torch.zeros(1), "fc.weight": torch.zeros(1)}
    w = _round(alg, w, {"conv1.weight": torch.tensor([1e-6]), "fc.weight": torch.tensor([1e-6])})
    before = {k: v.clone() for k, v in alg.server_state().items()}
    with pytest.raises(AggregationError, match="overflow"):
        _round(alg, w, {"conv1.weight": torch.tensor([1e-6]), "fc.weight": torch.tensor([1e20])})
    after = alg.server_state()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_devices_are_never_sent_the_server_optimizers_settings():
    cfg = load_config(None, ["algorithm.name=fedyogi", "algorithm.server_lr=0.03",
                             "algorithm.tau=0.1"])
    sent = cfg.for_devices()
    assert not {"server_lr", "fedyogi", "tau"} & set(sent["algorithm"])
    assert ExperimentConfig.model_validate(sent).algorithm.name == "fedyogi"
