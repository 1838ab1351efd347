"""MOON (Li, He, Song, CVPR 2021) and FedNova (Wang et al., NeurIPS 2020) against their update
rules written out; whole runs, --workers and deployment parity in tests/server."""

import copy
import math

import torch
import torch.nn.functional as F

from conftest import synthetic_data
from fedseq.common.algorithms import make_algorithm
from fedseq.common.algorithms.aggregate import ClientUpdate, WeightedDeltaSum
from fedseq.common.algorithms.fednova import normalizer
from fedseq.common.algorithms.moon import PREVIOUS
from fedseq.common.config import load_config
from fedseq.common.models import block_of, build_model, get_blocks, state_key
from fedseq.common.seeding import torch_rng
from fedseq.common.training import run_client_round

LR, BATCH = 0.05, 8


def _setup(name, *over):
    cfg = load_config(None, [f"algorithm.name={name}", "train.local_epochs=1",
                             f"train.batch_size={BATCH}", "data.num_clients=4", "train.momentum=0",
                             f"train.lr={LR}", *over])
    model = build_model("cnn", (1, 28, 28), 4, False, generator_seed=1)
    return cfg, model, make_algorithm(cfg, model.spec), synthetic_data()


def _fedavg(model, momentum=0.0):
    """FedAvg under the same training settings, to compare a client's deltas with."""
    return make_algorithm(load_config(None, [
        "algorithm.name=fedavg", f"train.momentum={momentum}", f"train.lr={LR}",
        f"train.batch_size={BATCH}", "train.local_epochs=1"]), model.spec)


def _moon_by_hand(model, start, previous, data, shard, mu, tau):
    """MOON's local training as PFLlib's clientmoon writes it (exp and log spelled out), by
    plain SGD over the trainer's batches."""
    model.load_state_dict({**model.state_dict(), **start})
    glob = copy.deepcopy(model).eval()
    prev = copy.deepcopy(model)
    prev.load_state_dict({**prev.state_dict(), **previous})
    prev.eval()
    model.train()
    model.requires_grad_(True)
    g = torch_rng(0, "batches", 0, shard.client)
    perm = torch.randperm(len(shard.train), generator=g)
    for i in range(0, len(perm), BATCH):
        rows = shard.train[perm[i:i + BATCH]]
        x = data.images(rows)
        model.zero_grad()
        z = model.features(x)
        loss = F.cross_entropy(model.logits(z, (model.spec.head,)), data.y[rows])
        with torch.no_grad():
            zg, zp = glob.features(x), prev.features(x)
        pos = torch.exp(F.cosine_similarity(z, zg) / tau)
        neg = torch.exp(F.cosine_similarity(z, zp) / tau)
        loss = loss + mu * torch.mean(-torch.log(pos / (pos + neg)))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_moon_client_trains_on_the_contrastive_loss_and_keeps_its_base():
    mu, tau = 2.0, 0.5
    cfg, model, alg, data = _setup("moon", f"algorithm.moon.mu={mu}", f"algorithm.moon.tau={tau}")
    shard = data.clients[1]
    start = get_blocks(model, model.spec.blocks)
    gen = torch.Generator().manual_seed(5)
    previous = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in start.items()
                if block_of(k) in model.spec.base}
    plan = alg.plan(0)
    assert plan.algorithm == "moon" and plan.params == {"mu": mu, "tau": tau}
    held = {state_key(k, PREVIOUS): v for k, v in previous.items()}
    update, kept = run_client_round(model, {**start, **held}, plan, data, shard, 0, 0)
    want = _moon_by_hand(copy.deepcopy(model), start, previous, data, shard, mu, tau)
    for k in update.deltas:
        assert torch.allclose(update.deltas[k], want[k] - start[k], atol=1e-6), k
    # the trained base is kept for the next round's negative pair, nothing else
    assert set(kept) == {state_key(k, PREVIOUS) for k in previous}
    for k in previous:
        assert torch.allclose(kept[state_key(k, PREVIOUS)], want[k], atol=1e-6), k


def test_a_moon_clients_first_round_steps_as_fedavgs():
    """Without a previous model the negative pair is the positive one: l_con is log 2 and its
    gradient 0 (up to the last bits of the softmax's 1/2), so the deltas are FedAvg's."""
    cfg, model, alg, data = _setup("moon", "algorithm.moon.mu=3")
    fedavg = _fedavg(model)
    shard = data.clients[0]
    start = get_blocks(model, model.spec.blocks)
    moon, _ = run_client_round(model, dict(start), alg.plan(0), data, shard, 0, 0)
    plain, _ = run_client_round(model, dict(start), fedavg.plan(0), data, shard, 0, 0)
    assert all(torch.allclose(moon.deltas[k], plain.deltas[k], rtol=0, atol=1e-6)
               for k in plain.deltas)


def test_fednovas_normalizer_is_the_papers_closed_form():
    for tau in (1, 7, 40):
        assert normalizer(tau, 0.0) == tau
        for rho in (0.5, 0.9):
            closed = (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)
            assert math.isclose(normalizer(tau, rho), closed, rel_tol=1e-12)


def test_a_fednova_client_uploads_its_update_over_its_normalizer():
    cfg, model, alg, data = _setup("fednova", "train.momentum=0.9")
    fedavg = _fedavg(model, 0.9)
    shard = data.clients[2]
    start = get_blocks(model, model.spec.blocks)
    nova, _ = run_client_round(model, dict(start), alg.plan(0), data, shard, 0, 0)
    plain, _ = run_client_round(model, dict(start), fedavg.plan(0), data, shard, 0, 0)
    a = normalizer(-(-len(shard.train) // BATCH), 0.9)
    assert a > len(shard.train) // BATCH  # momentum counts each gradient more than once
    for k in plain.deltas:
        assert torch.equal(nova.deltas[k], plain.deltas[k] / a), k


def test_fednovas_server_steps_the_mean_normalized_update_by_tau_eff():
    """x + tau_eff sum p_i d_i, p_i by samples over the round's counted clients; with equal local
    steps it is FedAvg's step."""
    cfg, _, alg, _ = _setup("fednova", "train.batch_size=10", "train.local_epochs=2")
    sizes = [10, 35, 20, 20]  # tau_i = 2, 8, 4, 4
    alg.prepare(sizes)
    x = {"fc1.weight": torch.zeros(3), "fc1.running_mean": torch.zeros(3)}
    d = {1: torch.tensor([1.0, -2.0, 0.5]), 2: torch.tensor([0.0, 4.0, 1.0])}
    acc = WeightedDeltaSum()
    for c, v in d.items():
        deltas = {"fc1.weight": v, "fc1.running_mean": v}
        acc.add(deltas, alg.aggregation_weights(ClientUpdate(c, 0, deltas, sizes[c])), c)
    new = alg.server_update(x, acc).weights
    p = {1: 35 / 55, 2: 20 / 55}
    tau_eff = p[1] * 8 + p[2] * 4
    want = tau_eff * (p[1] * d[1] + p[2] * d[2])
    assert torch.allclose(new["fc1.weight"], want)
    assert torch.allclose(new["fc1.running_mean"], p[1] * d[1] + p[2] * d[2])  # FedAvg's mean
    same = WeightedDeltaSum()
    for c in (2, 3):  # equal steps: d_i = delta_i / 4, tau_eff = 4
        deltas = {"fc1.weight": d[2] / 4 * (c - 1), "fc1.running_mean": torch.zeros(3)}
        same.add(deltas, alg.aggregation_weights(ClientUpdate(c, 0, deltas, sizes[c])), c)
    assert torch.allclose(alg.server_update(x, same).weights["fc1.weight"], d[2] * 1.5)
