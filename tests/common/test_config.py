import json
from pathlib import Path

import pytest

from conftest import server_only
from fedseq.common.config import ExperimentConfig, dump_config, load_config, parse_override
from fedseq.common.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_examples_validate(name):
    cfg = load_config(EXAMPLES / name)
    assert cfg.rounds > 0


def test_override_uses_toml_values_and_bare_strings():
    assert parse_override("algorithm.unfreeze_rounds=[0,2,4]") == (
        ["algorithm", "unfreeze_rounds"], [0, 2, 4])
    assert parse_override("algorithm.name=fedavg") == (["algorithm", "name"], "fedavg")
    assert parse_override("train.lr=0.5")[1] == 0.5
    cfg = load_config(None, ["rounds=7", "algorithm.unfreeze_rounds=[0,2,4]"])
    assert cfg.rounds == 7 and cfg.algorithm.unfreeze_rounds == [0, 2, 4]


@pytest.mark.parametrize(
    "override, needle",
    [
        (["train.lrr=1"], "train.lrr: unknown key"),
        (["train.lr=-1"], "train.lr: Input should be greater than 0"),
        (["algorithm.name=fedfoo"], "algorithm.name"),
        (["algorithm.unfreeze_rounds=[5,0,7]"], "unfreeze_rounds"),
        (["novalue"], "expected dotted.key=value"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_unfreeze_round_beyond_run_is_allowed():
    cfg = load_config(None, ["rounds=100", "algorithm.unfreeze_rounds=[0,100,200]"])
    assert cfg.algorithm.unfreeze_rounds == [0, 100, 200]


@server_only  # run directories are written by the coordinator (tomli-w)
def test_dump_roundtrip(tmp_path):
    cfg = load_config(EXAMPLES / "fmnist-testbed.toml")
    path = tmp_path / "c.toml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_train_threads_is_a_count_or_auto():
    assert load_config(None, ["train.threads=3"]).train.threads == 3
    assert load_config(None, ['train.threads="auto"']).train.threads == "auto"
    assert load_config(None, []).train.threads is None
    for bad in ("train.threads=0", 'train.threads="fast"'):
        with pytest.raises(ConfigError, match="train.threads"):
            load_config(None, [bad])


def test_the_broadcast_config_carries_no_coordinator_paths_or_account():
    cfg = load_config(None, ["deploy.username=coordinator", "deploy.password_file='/etc/c.pw'",
                             "deploy.key_file='/etc/k.pem'", "deploy.ca_file='/etc/ca.pem'",
                             "data.root='/home/alice/data'", "deploy.broker='mqtt://h:1883'"])
    sent = cfg.for_devices()
    text = json.dumps(sent)
    for secret in ("/etc/", "/home/alice", "coordinator", "mqtt://h"):
        assert secret not in text, secret
    back = ExperimentConfig.model_validate(sent)  # what a device validates on receipt
    assert back.model_dump(exclude={"deploy", "data"}) == cfg.model_dump(exclude={"deploy", "data"})
    assert back.data.num_clients == cfg.data.num_clients


def test_the_head_init_reaches_devices():
    """model.head_init crosses to the devices as chosen; a bad one is refused."""
    sent = load_config(None, ['model.head_init="orthogonal"']).for_devices()
    assert ExperimentConfig.model_validate(sent).model.head_init == "orthogonal"
    with pytest.raises(ConfigError, match="head_init"):
        load_config(None, ['model.head_init="xavier"'])


def test_max_abs_delta_auto_follows_the_models_scale():
    auto = load_config(None, []).aggregation
    assert auto.max_abs_delta == "auto"
    assert auto.delta_bound(0.69) == pytest.approx(6.9)  # the testbed ConvNet's initial scale
    assert auto.delta_bound(0.01) == 1.0  # at least 1
    assert load_config(None, ["aggregation.max_abs_delta=50"]).aggregation.delta_bound(0.69) == 50
    with pytest.raises(ConfigError, match="max_abs_delta"):
        load_config(None, ["aggregation.max_abs_delta=-1"])


def test_algorithm_names_are_the_registrys():
    """algorithm.name takes every registered algorithm and nothing else, and says which exist."""
    from fedseq.common.algorithms import ALGORITHMS

    for name in ALGORITHMS:
        assert load_config(None, [f"algorithm.name={name}"]).algorithm.name == name
    with pytest.raises(ConfigError,
                       match="unknown algorithm 'fedfoo'; use one of ditto, fedadam, fedavg, ") as e:
        load_config(None, ["algorithm.name=fedfoo"])
    assert "\n" not in str(e.value)


def test_model_and_dataset_names_are_the_registries():
    from fedseq.common.data.catalog import NUM_CLASSES
    from fedseq.common.registry import REGISTRY

    # the catalog's datasets and the three generic readers are the built-in datasets
    assert sorted([*NUM_CLASSES, "npz", "csv", "imagefolder"]) == [
        e.name for e in REGISTRY.entries("datasets") if e.builtin]
    for name in REGISTRY.names("models"):
        assert load_config(None, [f"model.name={name}"]).model.name == name
    for name in NUM_CLASSES:
        assert load_config(None, [f"data.dataset={name}"]).data.dataset == name
    with pytest.raises(ConfigError, match="model.name: .*unknown model 'vgg'; use one of 4convnet, cnn, "):
        load_config(None, ["model.name=vgg"])
    with pytest.raises(ConfigError, match="data.dataset: .*unknown dataset 'svhn'; use one of cifar10, "):
        load_config(None, ["data.dataset=svhn"])


def test_a_run_directory_never_picks_its_data_root(tmp_path, monkeypatch):
    """--resume, --replay and --finetune-from read a run directory's config.toml without its
    data.root: a shared run directory cannot point the run at data (pickles) it carries; the
    user's --set data.root, else the default root, is used."""
    from fedseq.common.config import load_run_config, run_data_root

    monkeypatch.setenv("FEDSEQ_DATA", str(tmp_path / "mine"))
    (tmp_path / "config.toml").write_text(
        f'[data]\ndataset = "cifar10"\nroot = "{tmp_path / "planted"}"\n')
    assert load_run_config(tmp_path).data.root == tmp_path / "mine"
    assert load_run_config(tmp_path, ["data.root='/x'"]).data.root == Path("/x")
    assert load_run_config(tmp_path).data.dataset == "cifar10"  # the rest is the run's
    assert run_data_root(tmp_path) == str(tmp_path / "planted")


@pytest.mark.parametrize("key, meant", [("train.lerning_rate", "train.lr"),
                                        ("train.local_epoch", "train.local_epochs"),
                                        ("trian.lr", "train"), ("algorithm.nme", "algorithm.name")])
def test_a_misspelt_key_says_what_was_meant(key, meant):
    """Newcomer II, finding 8: "did you mean" for a misspelt key, by its name or by what its
    description says it is; one line."""
    with pytest.raises(ConfigError, match=f"did you mean {meant}\\?") as err:
        load_config(None, [f"{key}=1"])
    assert "\n" not in str(err.value)
