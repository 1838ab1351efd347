"""Every paper's example config against examples/papers/stated.toml, the table of what each paper
states: a setting that differs from a stated value is marked "# differs:" on its line, every
setting of the experiment the paper does not state is written out and marked "# not stated:",
and a stated value carries no mark. Which settings define an experiment follows from the config
itself (its partition, model, training options) and from the algorithms of its table."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fedseq.common.config import load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # the device stack's Python
    import tomli as tomllib

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STATED = tomllib.loads((EXAMPLES / "papers" / "stated.toml").read_text())
NOT_PAPERS = {"quickstart", "dp-fmnist",  # a first experiment; the headline DP experiment
              "secagg-testbed"}  # fmnist-testbed.toml plus [secagg] (tests/server/test_secure.py)

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
