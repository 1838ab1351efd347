"""GPFL (Zhang et al., ICCV 2023) against its client's update written out as GPFL's code writes
it (separate optimizers, weight decay on CoV and GCE, the per-row embedding loop), its
evaluation through the valve, and its wire and config checks (whole runs and deployment parity:
tests/server/test_deployment.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import synthetic_data
from fedseq.common.algorithms import make_algorithm, model_layout
from fedseq.common.algorithms.hooks import client_side_of
from fedseq.common.algorithms.plan import plan_from_dict, plan_to_dict
from fedseq.common.config import load_config
from fedseq.common.errors import ConfigError
from fedseq.common.evaluation import evaluate
from fedseq.common.models import build_model, get_blocks
from fedseq.common.seeding import torch_rng
from fedseq.common.training import run_client_round

LR, LAM, MU = 0.05, 0.3, 0.02


def _setup(*over):
    cfg = load_config(None, ["algorithm.name=gpfl", "train.local_epochs=2", "train.batch_size=8",
                             "data.num_clients=4", "train.momentum=0", f"train.lr={LR}",
                             f"algorithm.gpfl.lam={LAM}", f"algorithm.gpfl.mu={MU}", *over])
    model = build_model("cnn", (1, 28, 28), 4, generator_seed=1, **model_layout("gpfl"))
    return cfg, model, make_algorithm(cfg, model.spec), synthetic_data()


def _gpfl_code_round(model, data, shard, epochs, batch):
    """One client's round as GPFL's code runs it (PFLlib clientgpfl.train), conditional inputs
    made from the GCE received; returns the model after."""
    ref = copy.deepcopy(model)
    ref.train()
    ref.requires_grad_(True)
    classes = ref.gce.num_embeddings
    counts = torch.zeros(classes)
    for yy in data.y[shard.train]:
        counts[int(yy)] += 1
    share = counts / counts.sum()
    frozen = copy.deepcopy(ref.gce)
    embeddings = ref.gce(torch.arange(classes)).detach()
    generic = torch.zeros(embeddings.shape[1])
    personal = torch.zeros(embeddings.shape[1])
    for c in range(classes):
        generic += embeddings[c] / classes
        personal += embeddings[c] * share[c]
    main = torch.optim.SGD([p for n, p in ref.named_parameters()
                            if not n.startswith(("cov.", "gce."))], lr=LR)
    gce_opt = torch.optim.SGD(ref.gce.parameters(), lr=LR, weight_decay=MU)
    cov_opt = torch.optim.SGD(ref.cov.parameters(), lr=LR, weight_decay=MU)
    g = torch_rng(0, "batches", 0, shard.client)
    for _ in range(epochs):
        perm = torch.randperm(len(shard.train), generator=g)
        for i in range(0, len(perm), batch):
            rows = shard.train[perm[i:i + batch]]
            x, y = data.images(rows), data.y[rows]
            feat = ref.features(x)
            output = ref.fc2(ref.cov(feat, personal))
            feat_g = ref.cov(feat, generic)
            table = ref.gce(torch.arange(classes))
            cosine = F.linear(F.normalize(feat_g), F.normalize(table))
            one_hot = torch.zeros(cosine.size()).scatter_(1, y.view(-1, 1), 1)
            softmax_loss = -torch.mean(torch.sum(one_hot * F.log_softmax(cosine, dim=1), dim=1))
            loss = F.cross_entropy(output, y) + softmax_loss
            emb = torch.zeros_like(feat)
            for j, yy in enumerate(y):
                emb[j, :] = frozen(yy).detach()
            loss = loss + torch.norm(feat_g - emb, 2) * LAM
            for opt in (main, gce_opt, cov_opt):
                opt.zero_grad()
            loss.backward()
            for opt in (main, gce_opt, cov_opt):
                opt.step()
    return ref


def test_a_gpfl_client_trains_gpfls_loss_and_keeps_its_head():
    cfg, model, alg, data = _setup()
    shard = data.clients[2]
    plan = alg.plan(0)
    assert plan.upload == ("conv1", "conv2", "fc1", "cov", "gce") and plan.personal == ("fc2",)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    update, kept = run_client_round(model, get_blocks(model, model.spec.blocks), plan, data, shard,
                                    0, 0)
    model.load_state_dict(start)
    ref = _gpfl_code_round(model, data, shard, epochs=2, batch=8).state_dict()
    for k, v in update.deltas.items():
        assert torch.allclose(v, ref[k] - start[k], atol=2e-5), k
    assert set(update.deltas) == {k for k in start if not k.startswith("fc2.")}
    assert set(kept) == {"fc2.weight", "fc2.bias"}
    for k in kept:
        assert torch.allclose(kept[k], ref[k], atol=2e-5), k
        assert not torch.equal(kept[k], start[k])


def test_gpfls_evaluation_goes_through_the_valve():
    """A client's model is its head on CoV(f, p); the global model predicts the GCE row nearest
    in angle to CoV(f, g)."""
    cfg, model, alg, data = _setup()
    gen = torch.Generator().manual_seed(3)
    weights = {k: v + 0.1 * torch.randn(v.shape, generator=gen)
               for k, v in get_blocks(model, model.spec.blocks).items()}
    head = {"fc2.weight": torch.randn(4, 512, generator=gen), "fc2.bias": torch.zeros(4)}
    rep = evaluate(model, data, weights, {1: head}, ("fc2",), side=client_side_of("gpfl"))
    model.load_state_dict(weights)
    model.eval()
    table = weights["gce.weight"]
    rows = torch.cat([c.test for c in data.clients])
    with torch.no_grad():
        feats = model.features(data.images(rows))
        cos = F.linear(F.normalize(model.cov(feats, table.mean(0))), F.normalize(table))
        assert rep.global_correct == int((cos.argmax(1) == data.y[rows]).sum())
        c = data.clients[1]
        counts = torch.bincount(data.y[c.train], minlength=4).float()
        personal = (counts / counts.sum()) @ table
        out = F.linear(model.cov(model.features(data.images(c.test)), personal),
                       head["fc2.weight"], head["fc2.bias"])
        assert rep.per_client[1] == (int((out.argmax(1) == data.y[c.test]).sum()), len(c.test))


def test_gpfls_modules_are_blocks_of_their_own_on_any_model():
    """CoV (two Linear + LayerNorm of the head's input width) and GCE (a row per class), after
    the base and before the head; the rest of the model is drawn as without them."""
    plain = build_model("convnet", (1, 28, 28), 10, generator_seed=4)
    gpfl = build_model("convnet", (1, 28, 28), 10, generator_seed=4, **model_layout("gpfl"))
    assert gpfl.spec.blocks == ("conv1", "conv2", "fc1", "fc2", "cov", "gce", "fc3")
    assert sum(p.numel() for p in gpfl.parameters()) == 573_578 + 76_800  # docs/models.md
    assert all(torch.equal(v, gpfl.state_dict()[k]) for k, v in plain.state_dict().items())


def test_gpfls_plan_crosses_the_wire_and_its_settings_are_checked():
    cfg, model, alg, _ = _setup()
    plan = alg.plan(0)
    assert plan_from_dict(plan_to_dict(plan)) == plan
    assert plan.algorithm == "gpfl" and plan.params == {"lambda": LAM, "mu": MU}
    assert plan.class_counts_needed
    fedavg = make_algorithm(load_config(None, ["algorithm.name=fedavg"]), model.spec).plan(0)
    assert plan_to_dict(fedavg)["params"] == {}  # another algorithm's plan carries none of them
    with pytest.raises(ConfigError, match="conditional valve"):
        make_algorithm(load_config(None, ["algorithm.name=gpfl", "algorithm.final_finetune=true"]),
                       model.spec)
    with pytest.raises(ConfigError, match="gpfl.lam = -1"):
        load_config(None, ["algorithm.name=gpfl", "algorithm.gpfl.lam=-1"])
