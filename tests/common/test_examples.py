"""Every paper's example config against examples/papers/stated.toml, the table of what each paper
states: a setting that differs from a stated value is marked "# differs:" on its line, every
setting of the experiment the paper does not state is written out and marked "# not stated:",
and a stated value carries no mark. Which settings define an experiment follows from the config
itself (its partition, model, training options) and from the algorithms of its table. What the
code does that no key sets (a "reading": how the data is pooled and split, where the head begins)
is listed in stated.toml's [NAME.readings] and the config's header, and checked here against the
code (`READINGS`)."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedseq.common.algorithms import make_algorithm, model_layout
from fedseq.common.algorithms.base import local_finetune_plan
from fedseq.common.config import load_config
from fedseq.common.data.federated import client_indices, load_federated
from fedseq.common.data.partition import train_test_split
from fedseq.common.data.readers import read_dataset
from fedseq.common.models import build_model, model_spec

if sys.version_info >= (3, 11):
    import tomllib
else:  # the device stack's Python
    import tomli as tomllib

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STATED = tomllib.loads((EXAMPLES / "papers" / "stated.toml").read_text())
NOT_PAPERS = {"quickstart", "dp-fmnist",  # a first experiment; the headline DP experiment
              "secagg-testbed",  # fmnist-testbed.toml plus [secagg] (tests/server/test_secure.py)
              "sites-testbed",  # fmnist-testbed.toml plus [fleet], [hierarchy] (test_sites.py)
              "sites-fleet"}  # a fleet of two sites, as deploy/ansible/inventory/sites.yml rolls out

ALWAYS = ("rounds", "data.dataset", "data.partition", "data.num_clients", "data.train_fraction",
          "data.normalize", "model.name", "train.join_ratio", "train.local_epochs",
          "train.batch_size", "train.lr", "train.momentum", "train.lr_milestones", "train.augment")
BY_PARTITION = {"dirichlet": ("data.alpha", "data.min_samples"), "shards": ("data.shards_per_client",),
                "classes": ("data.classes_per_client",), "iid": ()}
WITH_BATCHNORM = {"4convnet", "mobilenet", "resnet18", "resnet34"}
FINE_TUNED = {"fedbabu", "fedseq-vanilla", "fedseq-anti", "local"}
BY_ALGORITHM = {
    "fedprox": ("algorithm.fedprox.mu",),
    "feddyn": ("algorithm.feddyn.alpha",),
    "ditto": ("algorithm.ditto.lam", "algorithm.ditto.epochs"),
    "gpfl": ("algorithm.gpfl.lam", "algorithm.gpfl.mu"),
    "fedrep": ("algorithm.fedrep.head_epochs",),
    "fedper": ("algorithm.fedper.personal_layers",),
    "fedreg": ("algorithm.fedreg.threshold", "algorithm.fedreg.passes",
               "algorithm.fedreg.rebalance"),
    "fedseq-vanilla": ("algorithm.unfreeze_rounds",),
    "fedseq-anti": ("algorithm.unfreeze_rounds",),
    "fedbabu": ("model.head_init",),
}
LINE = re.compile(r"^\s*([A-Za-z_]+)\s*=\s*([^#]*?)\s*(#.*)?$")


def value(cfg, key: str):
    out = cfg
    for part in key.split("."):
        out = getattr(out, part)
    return list(out) if isinstance(out, (list, tuple)) else out


def defining_keys(cfg, algorithms: set[str]) -> list[str]:
    """The settings that define `cfg`'s experiment under any of `algorithms`."""
    keys = list(ALWAYS) + list(BY_PARTITION[cfg.data.partition])
    if cfg.model.name in WITH_BATCHNORM:
        keys.append("model.norm")
    if cfg.train.lr_milestones:
        keys.append("train.lr_gamma")
    if "crop" in cfg.train.augment:
        keys.append("train.crop_padding")
    for alg in sorted(algorithms):
        keys += [k for k in BY_ALGORITHM.get(alg, ()) if k not in keys]
    if algorithms & FINE_TUNED or cfg.algorithm.final_finetune:
        keys += ["algorithm.finetune_epochs", "algorithm.finetune_blocks"]
    return keys


def marks(path: Path) -> dict[str, str]:
    """Dotted key -> the comment on its line ("" without one), for every key the file sets."""
    out: dict[str, str] = {}
    section = ""
    for line in path.read_text().splitlines():
        head = re.match(r"^\s*\[([A-Za-z_.]+)\]", line)
        if head:
            section = head.group(1) + "."
            continue
        m = LINE.match(line)
        if m and not line.lstrip().startswith("#"):
            out[section + m.group(1)] = (m.group(3) or "").strip()
    return out


def header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(x for x in lines[: next(i for i, x in enumerate(lines) if not x.startswith("#"))])


def configs() -> list[str]:
    return sorted(p.stem for p in EXAMPLES.glob("*.toml") if p.stem not in NOT_PAPERS)


def test_every_papers_config_has_a_table_of_what_its_paper_states():
    assert configs() == sorted(STATED), "add the config's paper to examples/papers/stated.toml"


@pytest.mark.parametrize("name", configs())
def test_unstated_and_differing_settings_are_marked_and_only_those(name):
    path = EXAMPLES / f"{name}.toml"
    paper = STATED[name]
    cfg = load_config(path)
    stated = paper["stated"]
    written = marks(path)
    problems = []
    for key in defining_keys(cfg, set(paper["columns"]) | {cfg.algorithm.name}):
        mark = written.get(key)
        if key in stated:
            if value(cfg, key) == stated[key]:
                if mark and ("not stated" in mark or "differs" in mark):
                    problems.append(f"{key}: the paper states {stated[key]!r}; drop its mark")
            elif not (mark and mark.startswith("# differs:")):
                problems.append(f"{key} = {value(cfg, key)!r} but the paper states "
                                f"{stated[key]!r}: set it, or mark it '# differs: why'")
        elif mark is None or not mark.startswith("# not stated:"):
            problems.append(f"{key} = {value(cfg, key)!r} is not stated by the paper: write it "
                            "out, marked '# not stated: where it comes from'")
    assert not problems, f"{name}.toml ({paper['paper']}):\n" + "\n".join(problems)


@pytest.mark.parametrize("name", configs())
def test_the_header_says_what_it_can_and_cannot_reproduce(name):
    path = EXAMPLES / f"{name}.toml"
    text = header(path)
    assert "# Reproduces:" in text and "# Cannot reproduce:" in text, name
    for alg, over in STATED[name].get("column", {}).items():
        lines = [x for x in text.splitlines() if f"algorithm.name={alg}" in x]
        for key, v in over.items():
            shown = str(v).lower() if isinstance(v, bool) else str(v)
            assert any(f"{key}={shown}" in x for x in lines), (name, alg, key)
        column = load_config(path, [f"algorithm.name={alg}"] + [
            f"{k}={str(v).lower() if isinstance(v, bool) else v!r}" for k, v in over.items()])
        assert all(value(column, k) == v for k, v in over.items())


def test_one_experiment_one_partition():
    """FedReG's Tables 3 and 4 report one experiment twice (CIFAR-10, 100 clients, Dirichlet
    0.1, join rate 0.2): the two configs give it the same data and training."""
    t3 = load_config(EXAMPLES / "fedreg-table3.toml")
    t4 = load_config(EXAMPLES / "fedreg-table4.toml", ["data.alpha=0.1"])
    assert t3.data == t4.data and t3.train == t4.train and t3.algorithm == t4.algorithm


# -- readings: what the code does that no key sets ------------------------------------------------
HEADS = ("fedreg", "fedrod", "fedrep", "fedbabu", "gpfl")  # the algorithms whose head is set apart


def column(name: str, alg: str, *overrides: str):
    """The config of `name` run as column `alg`, and that algorithm on its model's layout."""
    cfg = load_config(EXAMPLES / f"{name}.toml", [f"algorithm.name={alg}", *overrides])
    spec = model_spec(cfg.model.name, norm=cfg.model.norm, **model_layout(alg))
    return cfg, spec, make_algorithm(cfg, spec)


def reads_merged_split(name, root):
    """Every row of the training and the test file is dealt to a client (the partition sees
    both), and each client's rows are cut at data.train_fraction."""
    cfg = load_config(EXAMPLES / f"{name}.toml", [f"data.root={str(root)!r}", "data.dataset=fmnist"])
    labels = read_dataset(root, "fmnist", rows=np.empty(0, np.int64)).labels
    assert len(labels) == 70_000  # 60,000 training + 10,000 test images
    parts = client_indices(labels, cfg.data, cfg.seed)
    assert sorted(np.concatenate(parts).tolist()) == list(range(70_000))
    for cid, rows in enumerate(parts[:3]):
        train, test = train_test_split(rows, cfg.data.train_fraction, cfg.seed, cid)
        assert len(train) == round(len(rows) * cfg.data.train_fraction)
        assert len(train) + len(test) == len(rows)


def reads_merged_500_100(name, root):
    """Shards over 60,000 pooled labels give each of 100 clients 600 rows, split 500/100."""
    cfg = load_config(EXAMPLES / f"{name}.toml")
    labels = np.repeat(np.arange(100), 600)  # CIFAR-100's 50,000 + 10,000, 600 a class
    parts = client_indices(labels, cfg.data, cfg.seed)
    assert [len(p) for p in parts] == [600] * 100
    for cid, rows in enumerate(parts):
        train, test = train_test_split(rows, cfg.data.train_fraction, cfg.seed, cid)
        assert (len(train), len(test)) == (500, 100)


def reads_finetune_lr(name, root):
    cfg, spec, _ = column(name, "fedbabu")
    assert cfg.train.lr_milestones, "no decay: the reading says nothing"
    assert local_finetune_plan(cfg, spec).lr == cfg.train.lr != cfg.lr_at(cfg.rounds - 1)


def reads_cyclic_classes(name, root):
    """Client i holds the (seed-ordered) classes i*k .. i*k+k-1 mod C; a class's rows are
    dealt equally to its N*k/C holders."""
    cfg = load_config(EXAMPLES / f"{name}.toml")
    n, k, c = cfg.data.num_clients, cfg.data.classes_per_client, 10
    labels = np.repeat(np.arange(c), 6000)  # CIFAR-10's 60,000 images
    parts = client_indices(labels, cfg.data, cfg.seed)
    held = [sorted(set(labels[p].tolist())) for p in parts]
    period = c // math.gcd(c, k)  # positions i*k mod C repeat after this many clients
    assert n > period, "the config's N is too small to show the cycle"
    assert all(len(h) == k for h in held)
    for i in range(n - period):
        assert held[i] == held[i + period], "client i and i + C/gcd(C, k) hold one window"
    for cls in range(c):
        holders = [i for i in range(n) if cls in held[i]]
        assert len(holders) == n * k // c
        assert len({int((labels[parts[i]] == cls).sum()) for i in holders}) == 1


def reads_head_fc3(name, root):
    """The head (both heads where there are two) is the last linear layer alone, 192 -> classes,
    and it is what FedRep and GPFL keep personal and FedBABU freezes and re-tunes."""
    algs = [a for a in STATED[name]["columns"] if a in HEADS]
    assert algs
    for alg in algs:
        cfg, spec, algorithm = column(name, alg)
        assert spec.head == "fc3" and spec.personal_head in (None, "fc3_p"), alg
        model = build_model(cfg.model.name, (1, 28, 28), 10, **model_layout(alg))
        for head in spec.heads:
            layer = getattr(model, head)
            assert isinstance(layer, torch.nn.Linear) and layer.in_features == 192, alg
        if alg in ("fedrep", "gpfl"):
            assert "fc3" in algorithm.personal_blocks(), alg
        if alg == "fedbabu":
            plan = algorithm.plan(0)
            assert "fc3" not in plan.upload and all("fc3" not in p.trainable for p in plan.phases)
            assert local_finetune_plan(cfg, spec).phases[0].trainable == ("fc3",)


def reads_steps_as_epochs(name, root):
    """FedBABU's re-tuning, FedRep's head step and Ditto's personal step are phases of that
    many epochs (a phase's count is epochs over the client's rows)."""
    cfg, spec, _ = column(name, "fedbabu")
    assert local_finetune_plan(cfg, spec).phases[0].epochs == cfg.algorithm.finetune_epochs == 10
    cfg, spec, rep = column(name, "fedrep")
    head_phase = rep.plan(0).phases[0]
    assert head_phase.trainable == ("fc3",) and head_phase.epochs == 5
    cfg, spec, ditto = column(name, "ditto")
    plan = ditto.plan(0)
    (own,) = ditto.client_side(plan.params).extra_plans(plan)
    assert own.phases[0].epochs == 5


def reads_convnet_28x28(name, root):
    cfg = load_config(EXAMPLES / f"{name}.toml", ["data.dataset=fmnist"])
    gray = build_model(cfg.model.name, (1, 28, 28), 10)
    color = build_model(cfg.model.name, (3, 32, 32), 10)
    assert (gray.conv1.in_channels, gray.fc1.in_features) == (1, 64 * 4 * 4)
    assert (color.conv1.in_channels, color.fc1.in_features) == (3, 64 * 5 * 5)


def reads_pooled_test(name, root):
    """The global test set is the clients' test rows pooled: rows of both original files, about
    a quarter of all 70,000, not the original 10,000 test images."""
    cfg = load_config(EXAMPLES / f"{name}.toml", [f"data.root={str(root)!r}"])
    data = load_federated(cfg.data, cfg.seed, test_images_only=True)
    pooled = data.all_test()
    assert sorted(pooled.tolist()) == sorted(r for c in data.clients for r in c.test.tolist())
    assert abs(len(pooled) - 17_500) < 100
    assert (pooled < 60_000).any() and (pooled >= 60_000).any()


READINGS = {
    "merged-split": reads_merged_split, "merged-500-100": reads_merged_500_100,
    "finetune-lr": reads_finetune_lr, "cyclic-classes": reads_cyclic_classes,
    "head-fc3": reads_head_fc3, "steps-as-epochs": reads_steps_as_epochs,
    "convnet-28x28": reads_convnet_28x28, "pooled-test": reads_pooled_test,
}
NEEDS_DATA = {"merged-split", "pooled-test"}


@pytest.mark.parametrize("name", configs())
def test_the_header_lists_the_readings_of_stated_toml(name):
    text = header(EXAMPLES / f"{name}.toml")
    listed = re.findall(r"^#   ([a-z0-9-]+): ", text.split("# Read, no key sets it", 1)[-1], re.M)
    assert "# Read, no key sets it" in text, f"{name}.toml: list its readings in the header"
    assert listed == list(STATED[name].get("readings", {})), name
    assert set(listed) <= set(READINGS), "a reading with no check in READINGS"


@pytest.mark.parametrize("name,reading", [(n, r) for n in configs()
                                          for r in STATED[n].get("readings", {})])
def test_the_code_does_what_each_reading_says(name, reading, request):
    root = request.getfixturevalue("data_root") if reading in NEEDS_DATA else None
    READINGS[reading](name, root)
