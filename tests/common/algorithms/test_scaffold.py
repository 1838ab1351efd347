"""SCAFFOLD's two halves against Karimireddy et al.'s Algorithm 1 (option II) written out: the
client's corrected steps and control variates, the server's update of x and c, and the round
contract's view of the control variates (whole runs: tests/server/test_server_optimizers.py;
--workers and deployment parity: test_distributed.py, test_deployment.py)."""

import pytest
import torch

from conftest import plain_sgd, synthetic_data
from fedseq.common.algorithms import make_algorithm
from fedseq.common.algorithms.aggregate import ClientUpdate, WeightedDeltaSum
from fedseq.common.algorithms.scaffold import control_key
from fedseq.common.config import load_config
from fedseq.common.errors import AggregationError
from fedseq.common.models import build_model, get_blocks, split_state
from fedseq.common.training import run_client_round


def _setup(*over):
    cfg = load_config(None, ["algorithm.name=scaffold", "train.local_epochs=1",
                             "train.batch_size=8", "data.num_clients=3", *over])
    model = build_model("cnn", (1, 28, 28), 4, False, generator_seed=1)
    return cfg, model, make_algorithm(cfg, model.spec), synthetic_data()


def _noise(weights, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def _params(model):
    return {k: v for k, v in get_blocks(model, model.spec.blocks).items()
            if k in dict(model.named_parameters())}


def _reference_round(model, x, c, ci, data, shard, lr, batch, seed):
    """Algorithm 1's client, option II, with plain SGD written out: y <- y - lr (g - c_i + c)
    over the same batches as the trainer; returns (y, c_i+)."""
    y, steps = plain_sgd(model, x, data, shard, seed, "batches", 1, lr, batch,
                         lambda k, p: c[k] - ci[k])
    return y, {k: ci[k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in c}


def test_a_client_round_is_algorithm_1_option_ii_under_plain_sgd():
    cfg, model, alg, data = _setup("train.momentum=0", "train.lr=0.05")
    shard = data.clients[1]
    x = _params(model)
    c, ci = _noise(x, 0.05, 1), _noise(x, 0.05, 2)
    sent = {**get_blocks(model, model.spec.blocks), **{control_key(k): v for k, v in c.items()}}
    held = {control_key(k, "ci"): v for k, v in ci.items()}
    update, kept = run_client_round(model, {**sent, **held}, alg.plan(0), data, shard, 0, 0)
    y, ci_new = _reference_round(model, x, c, ci, data, shard, 0.05, 8, 0)
    for k in x:
        assert torch.allclose(update.deltas[k], y[k] - x[k], atol=1e-6), k
        got = kept[control_key(k, "ci")]
        assert torch.allclose(got, ci_new[k], rtol=1e-3, atol=1e-4), k
        assert torch.allclose(update.deltas[control_key(k)], got - ci[k], rtol=1e-3, atol=1e-4)
    # running statistics would have no control variate; this model has none, and nothing else
    assert set(update.deltas) == set(x) | {control_key(k) for k in x}
    assert set(kept) == {control_key(k, "ci") for k in x}


def test_with_zero_control_variates_the_model_moves_as_fedavgs():
    """Round 0 of a run: c = c_i = 0, so the corrected steps are FedAvg's, bitwise."""
    cfg, model, alg, data = _setup()
    start = get_blocks(model, model.spec.blocks)
    zeros = {control_key(k): torch.zeros_like(v) for k, v in _params(model).items()}
    scaffold, kept = run_client_round(model, {**start, **zeros}, alg.plan(0), data,
                                      data.clients[0], 0, 0)
    fedavg_alg = make_algorithm(cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(
        update={"name": "fedavg"})}), model.spec)
    fedavg, _ = run_client_round(model, start, fedavg_alg.plan(0), data, data.clients[0], 0, 0)
    assert set(fedavg.deltas) < set(scaffold.deltas)
    assert all(torch.equal(scaffold.deltas[k], v) for k, v in fedavg.deltas.items())
    assert set(kept) == {control_key(k, "ci") for k in _params(model)}


def test_the_server_steps_x_by_the_weighted_mean_and_c_by_s_over_n_of_the_mean():
    cfg, model, alg, _ = _setup("algorithm.server_lr=0.5")
    x = {"conv1.weight": torch.zeros(2), "conv1.running_var": torch.ones(2)}
    c = alg.broadcast(x)
    assert set(c) == {"conv1~c.weight"}  # a running statistic has none
    acc = WeightedDeltaSum()
    ups = [({"conv1.weight": torch.tensor([1.0, 2.0]), "conv1.running_var": torch.tensor([1.0, 1.0]),
             "conv1~c.weight": torch.tensor([3.0, 0.0])}, 1.0),
           ({"conv1.weight": torch.tensor([4.0, 2.0]), "conv1.running_var": torch.tensor([4.0, 1.0]),
             "conv1~c.weight": torch.tensor([0.0, 6.0])}, 3.0)]
    for i, (d, n) in enumerate(ups):
        acc.add(d, alg.aggregation_weights(ClientUpdate(i, 0, d, num_samples=int(n))), i)
    step = alg.server_update(x, acc)
    new = step.weights
    # the model's moved tensors and c's get new versions
    assert step.changed == {"conv1.weight", "conv1.running_var", "conv1~c.weight"}
    # x: server_lr x the sample-weighted mean (1*[1,2] + 3*[4,2]) / 4 = [3.25, 2]
    assert torch.allclose(new["conv1.weight"], torch.tensor([1.625, 1.0]))
    # a running statistic takes the weighted mean as FedAvg's: 1 + [3.25, 1]
    assert torch.allclose(new["conv1.running_var"], torch.tensor([4.25, 2.0]))
    # c: |S| / N = 2 / 3 of the unweighted mean of dc = [1.5, 3]
    assert torch.allclose(alg.server_state()["conv1~c.weight"], torch.tensor([1.0, 2.0]))


def test_a_refused_round_leaves_c_as_it_was():
    cfg, model, alg, _ = _setup()
    x = {"conv1.weight": torch.zeros(2)}
    before = dict(alg.broadcast(x))
    acc = WeightedDeltaSum()
    acc.add({"conv1.weight": torch.ones(2), "conv1~c.weight": torch.tensor([1.0, float("nan")])},
            {"conv1": 1.0, "conv1~c": 1.0}, 0)
    with pytest.raises(AggregationError):
        alg.server_update(x, acc)
    assert alg.server_state().keys() == before.keys()
    assert all(torch.equal(alg.server_state()[k], v) for k, v in before.items())


def test_control_variates_are_kept_apart_from_the_model():
    w = {"conv1.weight": torch.ones(1), "conv1~c.weight": 2 * torch.ones(1),
         "fc~ci.bias": 3 * torch.ones(1)}
    model, state = split_state(w)
    assert list(model) == ["conv1.weight"] and list(state["c"]) == ["conv1.weight"]
    assert list(state["ci"]) == ["fc.bias"]


def test_the_contract_bounds_control_variates_by_the_models_bound_over_lr():
    cfg, model, alg, _ = _setup("train.lr=0.1")
    alg.broadcast({"conv1.weight": torch.zeros(2)})
    assert alg.upload_bound("conv1.weight", 2.0) == 2.0
    assert alg.upload_bound("conv1~c.weight", 2.0) == pytest.approx(20.0)
    alg.c["conv1~c.weight"] = torch.tensor([-3.0, 1.0])
    assert alg.upload_bound("conv1~c.weight", 2.0) == pytest.approx(23.0)
