"""The local-only control (every client alone, nothing federated) and fine-tuning part of the
model (the head, or a list of blocks), in simulation and on a real broker with device processes
(pinned seed streams included)."""

import json

import pytest
import torch

from conftest import quick_config
from fedseq.common.algorithms import make_algorithm
from fedseq.common.errors import ConfigError
from fedseq.common.models import count_params
from fedseq.server.ops.deployment import run_deployment
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.rounds.experiment import load_experiment


def _rows(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow("a deployment with its devices driven by control messages: 9 s on 2 cores")
def test_local_only_never_federates(data_root, tmp_path):
    cfg = quick_config(data_root, "algorithm.name=local", "algorithm.finetune_epochs=0",
                       "train.threads=1")
    init = load_experiment(cfg).model.state_dict()
    res = run_simulation(cfg, tmp_path / "local")
    for k, v in res.global_weights.items():
        assert torch.equal(v, init[k]), k  # no update ever reaches the global model
    rows = _rows(tmp_path / "local")
    assert [r["phase"] for r in rows] == ["train"] * 3  # not fine-tuned: finetune_epochs = 0
    assert all(r["uploaded_blocks"] == [] and r["reported"] == r["clients"] for r in rows)
    # every client trained its own model alone: far above the untrained global model
    assert rows[-1]["personal_acc"] > rows[-1]["global_acc"] + 0.2
    assert rows[-1]["global_model"].startswith("the initial model")
    tuned = run_simulation(quick_config(data_root, "algorithm.name=local", "train.threads=1"), None)
    assert tuned.rows[-1]["phase"] == "finetune" and tuned.rows[-1]["train_flops"] > 0


@pytest.mark.slow("a deployment with its devices driven by control messages: 9 s on 2 cores")
def test_head_only_finetuning_trains_the_head_alone(data_root, tmp_path):
    cfg = quick_config(data_root, "algorithm.name=fedbabu", "algorithm.finetune_blocks=head",
                       "train.threads=1")
    exp = load_experiment(cfg)
    plan = make_algorithm(cfg, exp.model.spec).finetune_plan()
    assert plan is not None and plan.trainable == (exp.model.spec.head,)
    run_simulation(cfg, tmp_path / "head")
    whole = run_simulation(quick_config(data_root, "algorithm.name=fedbabu", "train.threads=1"), None)
    ft_head, ft_whole = _rows(tmp_path / "head")[-1], whole.rows[-1]
    assert ft_head["trainable_params"] == count_params(exp.model, (exp.model.spec.head,))
    assert ft_whole["trainable_params"] == count_params(exp.model, exp.model.spec.blocks)
    assert ft_head["train_flops"] < ft_whole["train_flops"]
    assert ft_head["personal_acc"] != ft_whole["personal_acc"]


@pytest.mark.slow("a deployment with its devices driven by control messages: 5 s on 2 cores")
def test_finetuning_a_list_of_blocks_trains_those_alone(data_root, tmp_path):
    cfg = quick_config(data_root, "algorithm.name=fedseq-anti", "model.name=convnet",
                       'algorithm.finetune_blocks=["head", "conv1"]', "train.threads=1")
    exp = load_experiment(cfg)
    spec = exp.model.spec
    plan = exp.algorithm.finetune_plan()
    assert plan is not None and plan.trainable == ("conv1", spec.head)  # the model's order
    run_simulation(cfg, tmp_path / "conv1-head")
    row = _rows(tmp_path / "conv1-head")[-1]
    assert row["phase"] == "finetune"
    assert row["trainable_params"] == count_params(exp.model, ("conv1", spec.head))
    one = quick_config(data_root, "algorithm.name=fedbabu", "algorithm.finetune_blocks=conv2")
    assert make_algorithm(one, exp.model.spec).finetune_plan().trainable == ("conv2",)


def test_a_block_the_model_lacks_fails_before_any_data_loads(tmp_path):
    cfg = quick_config(tmp_path / "no-data-here", "algorithm.name=fedbabu",
                       'algorithm.finetune_blocks=["conv1", "fc3"]')  # cnn: its head is fc2
    with pytest.raises(ConfigError, match=r"names fc3, which the cnn model lacks; its blocks are "
                       r'conv1, conv2, fc1, fc2 \("head" = fc2\)'):
        load_experiment(cfg)
    with pytest.raises(ConfigError, match="list of distinct block names"):
        quick_config(tmp_path, 'algorithm.finetune_blocks=["head", "head"]')


@pytest.mark.slow("a deployment with its devices driven by control messages: 7 s on 2 cores")
def test_deployed_local_control_with_pinned_seeds_matches_simulation(data_root, tmp_path, one_thread):
    cfg = quick_config(data_root, "algorithm.name=local", "rounds=2", "train.join_ratio=0.6",
                       'algorithm.finetune_blocks=["conv1", "head"]', "algorithm.finetune_epochs=1",
                       "seed=3", "seeds.data=1", "seeds.init=2", "deploy.port=0")
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=lambda _msg: None)
    sim = run_simulation(cfg, out=None)
    assert [r["phase"] for r in dep.rows] == ["train", "train", "finetune"]
    for d, s in zip(dep.rows, sim.rows, strict=True):
        assert d["clients"] == s["clients"] and d["personal_acc"] == s["personal_acc"]
        assert d.get("round_local_acc") == s.get("round_local_acc")
    assert dep.final.per_client == sim.final.per_client
