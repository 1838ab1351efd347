"""`fedseq new NAME`: a lab's own pip-installable package of fedseq plugins, ready to edit.

It holds a model (a plain torch module), a dataset (synthetic rows, so its tests need no files, and
a reader of the files a device holds), an algorithm with a server step and a client hook, an
aggregation rule with options and state (server momentum), a config.toml that runs them on the data
root's Fashion-MNIST (`fedseq-sim --config config.toml`), a device-data.toml that runs them on data
left on the devices (data.placement = "device"; simulated with `fedseq-sim --devices-data`), tests
that pass with `python -m pytest` inside it, and a README saying how to install, test, run and
deploy it. The entry points (groups fedseq.models, fedseq.datasets, fedseq.algorithms,
fedseq.aggregators) register NAME-net (and NAME-net1d, for sensor series), NAME-data, NAME-avg and
NAME-rule; a device allows the models, dataset and algorithm with --allow-plugin (a rule runs on
the coordinator alone).
"""

from __future__ import annotations

import re
from pathlib import Path

from fedseq.common.errors import ConfigError

#: a package name: what pip and the entry point names accept
PACKAGE = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
description = "{name}: fedseq plugins (a model, a dataset, an algorithm and an aggregation rule)"
requires-python = ">=3.8"
dependencies = ["fedseq", "torch>=1.12", "numpy>=1.21", "pydantic>=2.5"]

[project.optional-dependencies]
test = ["fedseq[server]", "pytest>=8"]

[project.entry-points."fedseq.models"]
{name}-net = "{module}:make_model"
{name}-net1d = "{module}:make_model_1d"

[project.entry-points."fedseq.datasets"]
{name}-data = "{module}:DATA"

[project.entry-points."fedseq.algorithms"]
{name}-avg = "{module}:ScaledAvg"

[project.entry-points."fedseq.aggregators"]
{name}-rule = "{module}:MomentumRule"

[tool.setuptools.packages.find]
where = ["src"]
'''

MODULE = '''\
"""{name}: fedseq plugins. Each object below is registered by an entry point (pyproject.toml);
fedseq finds them once this package is installed, and a device once it allows them
(fedseq-client --allow-plugin {name}-net ...)."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from fedseq.common.algorithms.aggregate import ServerStep, WeightedDeltaSum
from fedseq.common.algorithms.robust import Rule
from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.hooks import ClientSide
from fedseq.common.config import AlgorithmParams
from fedseq.common.data.datasets import Dataset
from fedseq.common.data.readers import RawDataset
from fedseq.common.errors import DatasetError


# -- the model: a plain torch module; its top-level children that hold parameters are its blocks
# in order (FedSeq unfreezes them one by one), the last one the head (its output: the logits)
class Net(nn.Module):
    def __init__(self, channels: int, height: int, width: int, classes: int, hidden: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, 16, 3, padding=1)
        self.body = nn.Linear(16 * (height // 2) * (width // 2), hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.head(torch.relu(self.body(x.flatten(1))))


def make_model(input_shape, num_classes: int, hidden: int = 64) -> nn.Module:
    """(input shape, classes, **[model.options]) -> the model."""
    c, h, w = input_shape
    return Net(c, h, w, num_classes, hidden)


# -- a 1-D model for sensor series: npz rows of (C, L) reach a model as (N, C, 1, L); it reads any
# (N, C, H, L) as C x H channels of length L
class Net1d(nn.Module):
    def __init__(self, channels: int, length: int, classes: int, hidden: int):
        super().__init__()
        self.conv = nn.Conv1d(channels, 16, 5, padding=2)
        self.body = nn.Linear(16 * max(1, length // 2), hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1, 2)  # (N, C x H, L)
        x = torch.relu(self.conv(x))
        x = torch.max_pool1d(x, 2) if x.shape[-1] > 1 else x
        return self.head(torch.relu(self.body(x.flatten(1))))


def make_model_1d(input_shape, num_classes: int, hidden: int = 64) -> nn.Module:
    """(input shape, classes, **[model.options]) -> the 1-D model."""
    c, h, length = input_shape
    return Net1d(c * h, length, num_classes, hidden)


# -- the dataset: describes itself without files; loads pooled rows from the data root (`load`:
# here made up, so the tests need no files) and, with data.placement = "device", one part of a
# client's rows from a device's own folder (`load_part`: here train.npz / test.npz with x and y;
# replace both with readers of your files)
class DataOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rows: int = Field(600, ge=10)
    classes: int = Field(4, ge=2)
    seed: int = 0


class SyntheticData(Dataset):
    options_model = DataOptions

    def describe(self, options: Dict[str, Any]):
        return (1, 8, 8), DataOptions.model_validate(options).classes

    def load(self, root, options: Dict[str, Any], rows: Optional[np.ndarray] = None) -> RawDataset:
        o = DataOptions.model_validate(options)
        rng = np.random.default_rng(o.seed)
        labels = rng.integers(0, o.classes, o.rows)
        images = rng.normal(0, 1, (o.rows, 1, 8, 8)).astype(np.float32)
        images[np.arange(o.rows), 0, labels, labels] += 4.0  # each class lights one pixel
        return RawDataset(images if rows is None else images[rows], labels.astype(np.int64),
                          o.classes, o.rows * 4 // 5)

    def load_part(self, path, options: Dict[str, Any]) -> RawDataset:
        """Every row of one part (`train.npz` or `test.npz`) of a client's data on a device: x
        of shape (N, 1, 8, 8), y of N labels. A bad file is one line naming it."""
        o = DataOptions.model_validate(options)
        try:
            with np.load(path, allow_pickle=False) as f:
                x, y = f["x"].astype(np.float32), f["y"].astype(np.int64)
        except (OSError, ValueError, KeyError) as exc:
            raise DatasetError(f"{{path}}: not a {name}-data part, an .npz file with x and y "
                               f"({{exc}})") from None
        if x.shape[1:] != (1, 8, 8) or y.shape != (len(x),) or \
                (len(y) and not 0 <= y.min() <= y.max() < o.classes):
            raise DatasetError(f"{{path}}: x is {{x.shape}} and y {{y.shape}}; want (N, 1, 8, 8) "
                               f"and N labels in 0..{{o.classes - 1}}")
        return RawDataset(x, y, o.classes, len(y))


DATA = SyntheticData()


def write_device_folders(dest, seed: int = 0, classes: int = 4):
    """Demo data folders, one per device, as each device's --data-dir would hold them:
    dev-a is one client (train.npz, test.npz), dev-b two (north/, south/), each client seeing
    only some classes. For fedseq-sim --devices-data DEST; on a device, your files instead."""
    from pathlib import Path

    rng = np.random.default_rng(seed)
    clients = {{"dev-a": (0, 1), "dev-b/north": (1, 2), "dev-b/south": (2, 3)}}
    for i, (where, seen) in enumerate(clients.items()):
        folder = Path(dest) / where
        folder.mkdir(parents=True, exist_ok=True)
        for part, n in (("train", 160), ("test", 40)):
            y = rng.choice(np.array(seen) % classes, n)
            x = rng.normal(0, 1, (n, 1, 8, 8)).astype(np.float32)
            x[np.arange(n), 0, y, y] += 4.0  # the same signal as `load`'s rows
            np.savez(folder / (part + ".npz"), x=x, y=y)
    return Path(dest)


# -- the algorithm: a client hook (an L2 penalty on what a step trains) and a server step (the
# mean delta scaled by `scale`): [algorithm.{name}-avg] lam and scale
class Params(AlgorithmParams):
    lam: float = Field(0.0, ge=0, description="The clients' L2 penalty weight.")
    scale: float = Field(1.0, gt=0, description="The server's step along the mean delta.")


class Penalty(ClientSide):
    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        super().__init__(params)
        self.lam = float(self.params.get("lam", 0.0))

    def penalty(self, model, x, feats):
        if self.lam <= 0:
            return None
        return self.lam * sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad)


class ScaledAvg(Algorithm):
    """FedAvg with an L2 penalty on the clients and a scaled step on the server."""

    name = "{name}-avg"
    client_class = Penalty
    params_model = Params
    own_server_step = True

    def client_params(self) -> Dict[str, Any]:
        return {{"lam": self.cfg.algorithm.table(self.name, Params).lam}}

    def server_update(self, global_weights, aggregate) -> ServerStep:
        scale = self.cfg.algorithm.table(self.name, Params).scale
        mean = aggregate.apply(global_weights)  # the global model plus the round's mean delta
        moved = set(aggregate.moved())
        new = dict(global_weights)
        for k in moved:
            new[k] = global_weights[k] + scale * (mean[k] - global_weights[k])
        return ServerStep(new, frozenset(moved))


# -- an aggregation rule (coordinator only): built once a run, options from [aggregation.options],
# state kept across rounds and checkpointed. Each round gets a fresh aggregator from `round()`:
# `add` folds one checked update (its deltas, a weight per block: the algorithm's, by default the
# client's training rows), `apply` returns the new global tensors, `moved` the tensors it changed.
class MomentumOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    beta: float = Field(0.5, ge=0, lt=1)  # the momentum of the rounds' mean deltas


class MomentumRound:
    """One round: the weighted mean streams in; `apply` moves the model by the momentum."""

    def __init__(self, rule):
        self.rule, self.mean = rule, WeightedDeltaSum()

    def add(self, deltas, weight_of, client, device=None):
        self.mean.add(deltas, weight_of, client, device)

    def count(self):
        return self.mean.count()

    def clients_added(self):
        return self.mean.clients_added()

    def apply(self, global_weights):
        new = self.mean.apply(global_weights)  # a refused round raises here, state untouched
        m, beta = self.rule.momentum, self.rule.options.beta
        for k in self.mean.moved():
            if global_weights[k].is_floating_point():  # counters move as the mean moves them
                m[k] = new[k] - global_weights[k] + (beta * m[k] if k in m else 0)
                new[k] = global_weights[k] + m[k]
        return new

    def moved(self):
        return self.mean.moved()


class MomentumRule(Rule):
    """The round's weighted mean, then server momentum on it."""

    options_model = MomentumOptions

    def __init__(self, cfg, options):
        super().__init__(cfg, options)
        self.momentum: Dict[str, torch.Tensor] = {{}}

    def round(self):
        return MomentumRound(self)

    def state(self):  # checkpointed after every round; a resumed run is bitwise
        return dict(self.momentum)

    def load_state(self, state):
        self.momentum = dict(state)
'''

CONFIG = '''\
# {name} on the data root's Fashion-MNIST: fedseq-sim --config config.toml --out runs/{name}
# (the data: fedseq data download fmnist). Its own dataset instead: [data] dataset = "{name}-data"
rounds = 5

[data]
dataset = "fmnist"
fraction = 0.1
num_clients = 10

[model]
name = "{name}-net"

[algorithm]
name = "{name}-avg"

[algorithm.{name}-avg]
lam = 0.0001
scale = 1.0

[aggregation]
rule = "{name}-rule"         # or a built-in: mean, median, ... (`fedseq plugins`)

[aggregation.options]
beta = 0.5

[train]
join_ratio = 0.5
local_epochs = 1
'''

DEVICE_CONFIG = '''\
# {name} on data left on the devices: each device reads only its own folder (fedseq-client
# --device NAME --data-dir PATH) and announces what its clients hold; the coordinator holds no
# row. Simulated, one device per folder of DIR: fedseq-sim --config device-data.toml
# --devices-data DIR --out runs/{name}-devices (demo folders: python -c "import {module};
# {module}.write_device_folders('devices')")
rounds = 5

[data]
placement = "device"
dataset = "{name}-data"

[model]
name = "{name}-net"

[algorithm]
name = "{name}-avg"

[train]
join_ratio = 1.0
local_epochs = 2
'''

TESTS = '''\
"""{name}'s plugins, run by fedseq as it runs its own (python -m pytest)."""

import torch

from fedseq.common.config import load_config
from fedseq.common.registry import REGISTRY
from fedseq.server.ops.simulation import run_simulation


def config(*extra):
    return load_config(None, ["model.name={name}-net", "data.dataset={name}-data",
                              "algorithm.name={name}-avg", "data.num_clients=4", "data.alpha=1.0",
                              "data.min_samples=10", "rounds=5", "train.join_ratio=1.0",
                              "train.local_epochs=2", *extra])


def test_fedseq_finds_the_plugins():
    for group, name in (("models", "{name}-net"), ("models", "{name}-net1d"),
                        ("datasets", "{name}-data"), ("algorithms", "{name}-avg"),
                        ("aggregators", "{name}-rule")):
        assert REGISTRY.entry(group, name).distribution == "{name}"


def test_it_learns():
    rows = run_simulation(config(), None).rows
    assert rows[-1]["global_acc"] > 0.5  # four classes: chance is 0.25


def test_it_learns_on_data_left_on_the_devices(tmp_path):
    from pathlib import Path

    from {module} import write_device_folders

    devices = write_device_folders(tmp_path / "devices")
    here = Path(__file__).resolve().parents[1]
    cfg = load_config(here / "device-data.toml", [f"data.devices_root={{str(devices)!r}}"])
    row = run_simulation(cfg, None).rows[-1]
    assert row["reported"] == [0, 1, 2]  # dev-a's client, then dev-b's north and south
    assert row["federated_acc"] > 0.5  # scored on each client's own test rows


def test_a_unit_step_is_fedavg():
    ours = run_simulation(config("algorithm.{name}-avg.scale=1.0"), None).global_weights
    plain = run_simulation(config("algorithm.name=fedavg"), None).global_weights
    assert all(torch.allclose(ours[k], plain[k], atol=1e-6) for k in plain)


def test_the_1d_model_learns():
    rows = run_simulation(config("model.name={name}-net1d"), None).rows
    assert rows[-1]["global_acc"] > 0.5


def test_the_rule_without_momentum_is_the_mean_and_with_it_learns():
    rule = ("aggregation.rule={name}-rule", "aggregation.options.beta=0")
    ours = run_simulation(config(*rule), None).global_weights
    plain = run_simulation(config(), None).global_weights
    assert all(torch.allclose(ours[k], plain[k], atol=1e-5) for k in plain)
    rows = run_simulation(config("aggregation.rule={name}-rule"), None).rows
    assert rows[-1]["global_acc"] > 0.5
'''

README = '''\
# {name}

fedseq plugins: the model `{name}-net` (and `{name}-net1d`, a 1-D model for sensor series), the
dataset `{name}-data`, the algorithm `{name}-avg` and the aggregation rule `{name}-rule` (docs:
"Your own model, data and algorithm").

```bash
pip install -e ".[test]"                     # beside fedseq
python -m pytest -q                          # its tests
fedseq plugins                               # the names, with this package's version
fedseq-sim --config config.toml --out runs/{name}
```

With the data left on the devices (`device-data.toml`, data.placement = "device"), simulated
first, one device per folder:

```bash
python -c "import {module}; {module}.write_device_folders('devices')"   # demo folders
fedseq-sim --config device-data.toml --devices-data devices --out runs/{name}-devices
```

On a device: `pip install` this package there (the ansible role's fedseq_client_plugin_wheels):
the same code as the coordinator's, not only the same version (a run pins each plugin's source;
a device with an edited copy refuses it in one line),
then `fedseq-client --device dev-a --data-dir /path/to/its/data --allow-plugin {name}-net
--allow-plugin {name}-data --allow-plugin {name}-avg`; the coordinator:
`fedseq-server start --config device-data.toml`.
'''


def _taken(name: str, module: str) -> str | None:
    """Why `name` cannot name a new package here (a Python keyword as its module, an installed
    distribution, a module Python already finds), or None."""
    import importlib.metadata
    import importlib.util
    import keyword

    if keyword.iskeyword(module) or keyword.issoftkeyword(module):
        return "is a Python keyword: its module and tests would not parse"
    try:
        importlib.metadata.distribution(name)
        return "is an installed distribution: installing the package would replace it"
    except importlib.metadata.PackageNotFoundError:
        pass
    if name == "fedseq" or importlib.util.find_spec(module) is not None:
        return f"is a module Python already imports ({module}): the package's would shadow it"
    return None


def new_package(name: str, dest: Path) -> list[Path]:
    """Write package `name` into `dest` (a new or empty folder); the files written."""
    if not PACKAGE.fullmatch(name) or len(name) > 40:
        raise ConfigError(f"{name[:60]!r} is not a package name: lower-case letters and digits, "
                          "words joined by '-', at most 40 characters (e.g. labnet)")
    module = name.replace("-", "_")
    taken = _taken(name, module)
    if taken:
        raise ConfigError(f"{name!r} {taken}; choose another name (e.g. {module}-lab)")
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"{dest} is not empty: give a new folder (--dir)")
    files = {
        "pyproject.toml": PYPROJECT, f"src/{module}/__init__.py": MODULE, "config.toml": CONFIG,
        "device-data.toml": DEVICE_CONFIG, f"tests/test_{module}.py": TESTS, "README.md": README,
    }
    written = []
    for rel, template in files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(name=name, module=module))
        written.append(path)
    return written


__all__ = ["new_package"]
