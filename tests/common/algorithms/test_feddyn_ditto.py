"""FedDyn (Acar et al., Algorithm 1) and Ditto (Li et al., Algorithm 1) against their update rules
written out: the client's regularized steps and state, and FedDyn's server update (whole runs and
deployment parity: tests/server/test_deployment.py)."""

import torch

from conftest import plain_sgd, synthetic_data
from fedseq.common.algorithms import make_algorithm
from fedseq.common.algorithms.aggregate import ClientUpdate, WeightedDeltaSum
from fedseq.common.algorithms.ditto import PERSONAL_MODEL, DittoClient
from fedseq.common.algorithms.feddyn import DYN
from fedseq.common.config import load_config
from fedseq.common.models import build_model, get_blocks, state_key
from fedseq.common.training import run_client_round


def _setup(name, *over):
    cfg = load_config(None, [f"algorithm.name={name}", "train.local_epochs=1", "train.batch_size=8",
                             "data.num_clients=4", "train.momentum=0", "train.lr=0.05", *over])
    model = build_model("cnn", (1, 28, 28), 4, False, generator_seed=1)
    return cfg, model, make_algorithm(cfg, model.spec), synthetic_data()


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_a_feddyn_client_minimizes_the_dynamic_objective_and_updates_g():
    alpha = 0.3
    cfg, model, alg, data = _setup("feddyn", f"algorithm.feddyn.alpha={alpha}")
    shard = data.clients[2]
    theta = _params(model)
    gen = torch.Generator().manual_seed(4)
    g = {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in theta.items()}
    held = {state_key(k, DYN): v for k, v in g.items()}
    plan = alg.plan(0)
    assert plan.algorithm == "feddyn" and plan.params == {"alpha": alpha}
    update, kept = run_client_round(model, {**get_blocks(model, model.spec.blocks), **held}, plan,
                                    data, shard, 0, 0)
    # grad of L_k(w) - <g, w> + alpha/2 ||w - theta||^2 = grad L_k - g + alpha (w - theta)
    w, _ = plain_sgd(model, theta, data, shard, 0, "batches", 1, 0.05, 8,
                     lambda k, p: -g[k] + alpha * (p - theta[k]))
    for k in theta:
        assert torch.allclose(update.deltas[k], w[k] - theta[k], atol=1e-6), k
        assert torch.allclose(kept[state_key(k, DYN)], g[k] - alpha * (w[k] - theta[k]),
                              atol=1e-6), k
    assert set(kept) == {state_key(k, DYN) for k in theta}


def test_feddyn_server_update_steps_by_the_mean_and_h():
    """h = -alpha |P|/m mean(delta); theta' = theta + mean(delta) - h / alpha, the mean over the
    round's clients unweighted; a second round carries h on."""
    alpha = 0.5
    cfg, model, alg, _ = _setup("feddyn", f"algorithm.feddyn.alpha={alpha}")
    theta = {"conv1.weight": torch.zeros(2), "conv1.running_var": torch.ones(2)}
    ups = [{"conv1.weight": torch.tensor([1.0, 2.0]), "conv1.running_var": torch.tensor([1.0, 1.0])},
           {"conv1.weight": torch.tensor([3.0, 0.0]), "conv1.running_var": torch.tensor([3.0, 1.0])}]

    def step(x):
        acc = WeightedDeltaSum()
        for i, d in enumerate(ups):  # sample counts 1 and 9: unweighted all the same
            acc.add(d, alg.aggregation_weights(ClientUpdate(i, 0, d, num_samples=1 + 8 * i)), i)
        return alg.server_update(x, acc).weights

    new = step(theta)
    mean = torch.tensor([2.0, 1.0])
    h = -alpha * (2 / 4) * mean
    assert torch.allclose(alg.server_state()["conv1.weight"], h)
    assert torch.allclose(new["conv1.weight"], mean - h / alpha)  # = 1.5 x mean
    assert torch.allclose(new["conv1.running_var"], torch.tensor([3.0, 2.0]))  # FedAvg's, no h
    again = step(new)
    h2 = h - alpha * (2 / 4) * mean
    assert torch.allclose(again["conv1.weight"], new["conv1.weight"] + mean - h2 / alpha)


def test_a_ditto_client_uploads_fedavgs_delta_and_keeps_its_regularized_own_model():
    lam = 0.7
    cfg, model, alg, data = _setup("ditto", f"algorithm.ditto.lam={lam}",
                                   "algorithm.ditto.epochs=2")
    shard = data.clients[1]
    w = _params(model)
    gen = torch.Generator().manual_seed(9)
    v = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in w.items()}
    held = {state_key(k, PERSONAL_MODEL): t for k, t in v.items()}
    fedavg = make_algorithm(cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(
        update={"name": "fedavg"})}), model.spec)
    plain, _ = run_client_round(model, get_blocks(model, model.spec.blocks), fedavg.plan(0), data,
                                shard, 0, 0)
    model.load_state_dict({**model.state_dict(), **w})
    update, kept = run_client_round(model, {**get_blocks(model, model.spec.blocks), **held},
                                    alg.plan(0), data, shard, 0, 0)
    for k in w:  # the global part is FedAvg's, bitwise
        assert torch.equal(update.deltas[k], plain.deltas[k]), k
    own, _ = plain_sgd(model, v, data, shard, 0, "personal", 2, 0.05, 8,
                       lambda k, p: lam * (p - w[k]))
    for k in w:
        assert torch.allclose(kept[state_key(k, PERSONAL_MODEL)], own[k], atol=1e-6), k
    # evaluation reads the client's own model in place of the shared blocks
    view = DittoClient().view(kept)
    assert all(torch.equal(view[k], kept[state_key(k, PERSONAL_MODEL)]) for k in w)
