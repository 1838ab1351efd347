"""Experiment configuration: TOML in, pydantic-validated, shared by simulation and deployment."""

from __future__ import annotations

import contextlib
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Tuple, TypeVar, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fedseq.common.data.catalog import CHANNEL_STATS
from fedseq.common.data.store import default_data_root
from fedseq.common.errors import ConfigError, validation_problem
from fedseq.common.registry import DEVICE_GROUPS, REGISTRY, RegistryError
from fedseq.common.text import printable

if TYPE_CHECKING:
    from pydantic.json_schema import JsonDict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 on Jetson
    import tomli as tomllib

#: Who reads a key is declared on its field (`json_schema_extra`), read by
#: ExperimentConfig.for_devices. COORDINATOR: the coordinator alone (its paths and broker
#: account, the driver, the server's step, simulated time, privacy); the config a run
#: broadcasts leaves it out.
COORDINATOR: JsonDict = {"devices": False}


def since(protocol: int) -> JsonDict:
    """The mark of a device-visible key added while protocol `protocol` was current
    (common/protocol/messages.py PROTOCOL_VERSION): a device of that protocol older than the key
    would refuse it, so the broadcast config leaves it out at its default. A key added with a
    protocol bump needs no mark (devices of another protocol are refused)."""
    return {"since": protocol}


#: The flat [algorithm] keys before every algorithm had its own table: history, never extended.
#: A config file that uses one keeps working (its value moves to the table(s) named); a new
#: parameter goes in its algorithm's table (`Algorithm.params_model`).
FORMER_KEYS = {
    "mu": ("fedprox.mu",), "ditto_lambda": ("ditto.lam",), "ditto_epochs": ("ditto.epochs",),
    "feddyn_alpha": ("feddyn.alpha",), "gpfl_lambda": ("gpfl.lam",), "gpfl_mu": ("gpfl.mu",),
    "moon_mu": ("moon.mu",), "moon_tau": ("moon.tau",), "head_epochs": ("fedrep.head_epochs",),
    "personal_layers": ("fedper.personal_layers",),
    "rebalance_threshold": ("fedreg.threshold",), "fedreg_passes": ("fedreg.passes",),
    "fedreg_rebalance": ("fedreg.rebalance",),
    "beta1": ("fedavgm.beta1", "fedadam.beta1", "fedyogi.beta1"),
    "beta2": ("fedadam.beta2", "fedyogi.beta2"), "tau": ("fedadam.tau", "fedyogi.tau"),
}

#: The random streams a run draws from; each follows `seed` unless [seeds] pins it.
SEED_STREAMS = ("data", "init", "selection", "training", "noise")


P = TypeVar("P", bound="AlgorithmParams")


def _read_by(field: Any) -> int | str | None:
    """"coordinator" for a COORDINATOR key, its protocol for a `since` one, else None."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("devices") is False:
        return "coordinator"
    since = extra.get("since")
    return since if isinstance(since, int) else None


def _registered_name(group: str, name: str) -> str:
    """`name` if the registry (common/registry.py) has it in `group`: a ValueError in one line
    otherwise (unknown, a module path, or a plugin this device does not allow). Imports nothing."""
    try:
        REGISTRY.entry(group, name)
    except RegistryError as exc:
        raise ValueError(str(exc)) from None
    return name


def _check_registries(info: ValidationInfo) -> bool:
    """Whether model and algorithm names are checked against their registries (which import
    torch): always, but where a reader of finished runs validates with the context
    {"registries": False} (the report, which reads run directories without torch)."""
    return not (isinstance(info.context, dict) and info.context.get("registries") is False)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    """[data]: dataset, where its files are, and how it is split over clients."""

    dataset: str = Field("fmnist", description=(
        "A registered dataset (`fedseq plugins`): the catalog's mnist, fmnist, cifar10, cifar100, the "
        "six emnist-<split>s (emnist-letters, -digits, -balanced, -byclass, -bymerge, -mnist), "
        "tiny-imagenet, or one an installed package registers (entry point group fedseq.datasets)."))
    options: Dict[str, Any] = Field(default_factory=dict, json_schema_extra=since(9), description=(
        "[data.options]: the dataset's own options, validated by its schema (a catalog dataset "
        "takes none)."))
    root: Path = Field(default_factory=default_data_root, json_schema_extra=COORDINATOR, description=(
        "The folder holding MNIST/raw, FashionMNIST/raw, EMNIST/raw, cifar-10-batches-py, "
        "cifar-100-python or tiny-imagenet-200. Default: the one data root of every command "
        "($FEDSEQ_DATA, else ~/.local/share/fedseq/data; `fedseq data where`)."))
    partition: Literal["dirichlet", "shards", "iid", "classes"] = Field("dirichlet", description=(
        "How the training rows are dealt to clients: dirichlet (PFLlib's label-Dirichlet, `alpha`), "
        "shards (FedAvg/FedBABU's, `shards_per_client`), iid, or classes (FedPer's: at most "
        "`classes_per_client` classes a client)."))
    alpha: float = Field(0.1, gt=0, description="dirichlet: the concentration; smaller is more skewed.")
    shards_per_client: int = Field(2, ge=1, description="shards: the label-sorted shards each client gets.")
    classes_per_client: int = Field(2, ge=1, description=(
        "classes: every client holds at most this many classes, each class shared equally by the "
        "clients that hold it; k >= the classes is an IID split by class."))
    num_clients: int = Field(30, ge=1, description="The logical clients the data is split over.")
    train_fraction: float = Field(0.75, gt=0, lt=1, description=(
        "The share of each client's rows it trains on; the rest is its own test split."))
    min_samples: int = Field(40, ge=1, description=(
        "dirichlet: redraw the partition until every client has this many rows."))
    fraction: float = Field(1.0, gt=0, le=1, description=(
        "Use a seed-chosen subset of the dataset of this size (quick runs)."))
    normalize: Literal["half", "channel", "stats"] = Field("half", description=(
        "How rows become model inputs. Pixels (uint8): half ((x - 0.5) / 0.5 per channel, to "
        "[-1, 1]: PFLlib's transform) or channel ((x - mean_c) / std_c with each channel's fixed "
        "statistics, as FedBABU's code normalizes; common/data/catalog.py's CHANNEL_STATS: "
        "mnist, fmnist, cifar10, cifar100, tiny-imagenet). Float rows (sensor series, tabular "
        "rows, a plugin's own) are used as they are, unless stats: (x - mean) / std with "
        "data.mean and data.std, per channel (per feature for tabular rows), in the rows' own "
        "units (pixels: [0, 1]); `fedseq data stats` computes them from the run's training "
        "rows."))
    mean: List[float] = Field(default_factory=list, json_schema_extra=since(9), description=(
        "data.normalize = \"stats\": each channel's mean (each feature's, for tabular rows)."))
    std: List[float] = Field(default_factory=list, json_schema_extra=since(9), description=(
        "data.normalize = \"stats\": each channel's standard deviation, > 0."))

    placement: Literal["shared", "device"] = Field("shared", json_schema_extra=since(9), description=(
        "Where the rows come from: shared (every process derives the same partition of the "
        "dataset under the data root: the papers' testbeds) or device (each device reads only "
        "its own data folder, fedseq-client --data-dir, and announces its clients' sizes; "
        "`data.num_clients` and the partition keys are then the devices', and fedseq-sim reads "
        "the devices' folders from --devices-data; docs/tutorials/own-code.md)."))
    max_rows_per_client: Optional[int] = Field(None, ge=1, json_schema_extra=since(9), description=(
        "placement = \"device\": a client trains on at most this many of its training rows and "
        "scores on at most this many test rows (the first ones its reader gives); None: all."))
    max_weight_ratio: float = Field(10.0, ge=1, json_schema_extra=COORDINATOR, description=(
        "placement = \"device\": bounded influence. A device's clients' sizes are its own word "
        "and weigh its updates, so a device that announces more training rows than this many "
        "times the median of the other devices' is left out of the run, in one line naming it "
        "(fedseq-sim --devices-data refuses such a folder). One lying device among n honest "
        "ones then weighs at most ratio / (ratio + n - 1) of a round they all join "
        "(docs/security.md); raise it for a fleet whose devices really differ this much, or "
        "choose an unweighted rule (aggregation.rule = \"median\")."))
    validation: Optional[str] = Field(None, json_schema_extra=COORDINATOR, description=(
        "placement = \"device\": the coordinator's validation set, a file or folder under "
        "data.root (unless absolute) in the layout of a client's test part; the global model's "
        "accuracy on it is each evaluation's global_acc. None: global_acc is not measured, and "
        "the devices' scores of the global model (federated_acc) are the run's measure."))
    devices_root: Optional[Path] = Field(None, json_schema_extra=COORDINATOR, description=(
        "placement = \"device\": the folder holding one data folder per device, "
        "`<devices_root>/<device>/`, read by fedseq-sim (--devices-data) and given to "
        "fedseq-server start's --local-devices (local01, local02, ...)."))

    @field_validator("dataset")
    @classmethod
    def _catalogued(cls, v: str) -> str:
        return _registered_name("datasets", v)

    @model_validator(mode="after")
    def _options_fit(self, info: ValidationInfo) -> DataConfig:
        """[data.options] as the dataset's own schema reads them (its `describe`), so a bad option
        fails with the config, before any file is read."""
        if _check_registries(info):
            from fedseq.common.data.datasets import describe

            try:
                describe(self.dataset, self.options)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _placed(self) -> DataConfig:
        if self.placement == "shared":
            for key in ("max_rows_per_client", "validation", "devices_root"):
                if getattr(self, key) is not None:
                    raise ValueError(f"data.{key} is for data.placement = \"device\" (each device "
                                     "reads its own folder); remove it, or set the placement")
        elif self.fraction < 1.0:
            raise ValueError("data.fraction subsets a shared dataset; with data.placement = "
                             "\"device\" cap each client with data.max_rows_per_client instead")
        return self

    @model_validator(mode="after")
    def _has_channel_stats(self) -> DataConfig:
        if self.normalize == "channel" and self.dataset not in CHANNEL_STATS:
            raise ValueError(f"data.normalize = \"channel\" has no statistics for {self.dataset} "
                             f"(it has {', '.join(CHANNEL_STATS)}); use data.normalize = \"half\"")
        if (self.mean or self.std) and self.normalize != "stats":
            raise ValueError("data.mean and data.std are for data.normalize = \"stats\"; set it, "
                             "or remove them")
        if self.normalize == "stats":
            if not self.mean or len(self.mean) != len(self.std):
                raise ValueError(f"data.normalize = \"stats\" needs data.mean and data.std of one "
                                 f"length each (got {len(self.mean)} and {len(self.std)}); "
                                 "`fedseq data stats --config FILE` prints them")
            if not all(math.isfinite(m) for m in self.mean) or \
                    not all(math.isfinite(d) and d > 0 for d in self.std):
                raise ValueError("data.mean must be finite and data.std finite and > 0")
        return self

    def stats(self) -> Optional[Tuple[Tuple[float, ...], Tuple[float, ...]]]:
        """(mean, std) that turn rows into model inputs, or None: data.normalize's "channel"
        statistics of the catalog dataset, or "stats"' own."""
        if self.normalize == "stats":
            return tuple(self.mean), tuple(self.std)
        return CHANNEL_STATS[self.dataset] if self.normalize == "channel" else None


class ModelConfig(_Section):
    """[model]: which model of the zoo (common/models.py)."""

    name: str = Field("cnn", description=(
        "A registered model (`fedseq plugins`; the limits column lists the built-ins): cnn is the "
        "FedSeq paper's FedAvg/PFLlib CNN, convnet FedReG's FedDyn/FedRoD ConvNet; docs/models.md "
        "gives every model's source, blocks and parameters. An installed package adds its own "
        "(entry point group fedseq.models)."))
    options: Dict[str, Any] = Field(default_factory=dict, json_schema_extra=since(9), description=(
        "[model.options]: keyword arguments of a plugin model's factory (a built-in takes none)."))
    head_init: Literal["default", "orthogonal"] = Field("default", description=(
        "The heads' initial weights: default (PyTorch's, the same for every algorithm) or "
        "orthogonal (nn.init.orthogonal_ on each head's weight, as FedBABU section 3 describes its "
        "fixed random head; the bias as PyTorch initialises it)."))
    norm: Literal["batch", "running", "fedbn"] = Field("batch", description=(
        "What the BatchNorm layers of 4convnet, mobilenet and the ResNets keep (docs/models.md): "
        "batch (batch statistics only, FedBABU's code), running (running statistics aggregated with "
        "their block; a frozen block normalizes by them) or fedbn (every normalization layer stays "
        "with its client: FedBN). cnn and convnet have none and take batch only."))

    @field_validator("name")
    @classmethod
    def _modelled(cls, v: str, info: ValidationInfo) -> str:
        if not _check_registries(info):
            return v
        return _registered_name("models", v)


class AlgorithmParams(BaseModel):
    """An algorithm's own parameters, its table [algorithm.<name>] (e.g. `[algorithm.fedprox]`
    then `mu = 0.01`, or `--set algorithm.fedprox.mu=0.01`): a subclass in the algorithm's
    module, its `params_model`, validated with the config. The coordinator alone reads it; a
    client gets what it needs in every plan (`Algorithm.client_params`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class AlgorithmConfig(_Section):
    """[algorithm]: which algorithm, the keys several algorithms share, and a table per
    algorithm with its own parameters ([algorithm.<name>], listed below)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str = Field("fedseq-anti", description=(
        "A registered algorithm (`fedseq plugins`; the limits column lists the built-ins; `local` "
        "is the control: every client alone on the same schedule). An installed package adds its "
        "own (entry point group fedseq.algorithms)."))
    unfreeze_rounds: List[int] = Field(default_factory=list, description=(
        "FedSeq: the round (from 0) at which each base block starts training, t_1..t_K in the "
        "schedule's order; empty: evenly spaced over the rounds. A t_k >= rounds keeps that block "
        "frozen until fine-tuning."))
    finetune_epochs: int = Field(10, ge=0, description=(
        "FedBABU, FedSeq, local (and every algorithm under final_finetune = true): epochs of the "
        "final fine-tuning on each client's training rows (0: none)."))
    final_finetune: Optional[bool] = Field(None, description=(
        "Whether every client fine-tunes after the last round: unset, where the algorithm does "
        "(FedBABU, FedSeq, local); true, also FedAvg, FedProx and the other one-head algorithms "
        "(FedBABU's Table 4 \"FedAvg\" column is FedAvg fine-tuned); false, no algorithm."))
    finetune_blocks: Union[str, List[str]] = Field("all", description=(
        "What the final fine-tuning (FedBABU, FedSeq, local) trains: `all` blocks (FedBABU's "
        "Algorithm 1), the `head` alone (FedReG section 5's reading), or a block name or list of "
        "them, e.g. [\"conv1\", \"head\"], checked against the model when the run starts."))
    server_lr: Optional[float] = Field(None, gt=0, json_schema_extra=COORDINATOR, description=(
        "The server's step size along the round's mean delta: FedAvgM, FedAdam, FedYogi (Reddi "
        "et al., ICLR 2021; default 1.0 for FedAvgM, 0.01 for the others), SCAFFOLD's global step "
        "(default 1), and under train.mode = \"async\" the scale of FedAvg's folded deltas "
        "(default 1). Coordinator only."))

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str, info: ValidationInfo) -> str:
        if not _check_registries(info):
            return v
        return _registered_name("algorithms", v)

    @model_validator(mode="before")
    @classmethod
    def _former_keys(cls, data: Any) -> Any:
        """A former flat key (FORMER_KEYS) moves to its table(s); any other key that is neither
        a field nor a table is refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in [k for k in data if k in FORMER_KEYS]:
            value = data.pop(key)
            for target in FORMER_KEYS[key]:
                name, field = target.split(".")
                table = dict(data.get(name) or {})
                if field in table and table[field] != value:
                    raise ValueError(f"algorithm.{key} = {value!r} and algorithm.{target} = "
                                     f"{table[field]!r}: {key} is the former name of "
                                     f"algorithm.{target}; keep one")
                table.setdefault(field, value)
                data[name] = table
        for key, value in data.items():
            if key not in cls.model_fields and not isinstance(value, (dict, AlgorithmParams)):
                where = f"algorithm.{printable(str(key), 60)}"
                raise ValueError(f"unknown key {where}"
                                 + (_suggest(where) or " (check the spelling; an algorithm's "
                                    "own parameters are in its table, e.g. algorithm.fedprox.mu)")
                                 + " (every key: the site's configuration reference)")
        return data

    @model_validator(mode="after")
    def _tables(self, info: ValidationInfo) -> AlgorithmConfig:
        """Every [algorithm.<name>] table validated by that algorithm's `params_model`, and the
        selected algorithm's present (its defaults), so a run's config.toml records all of its
        parameters."""
        if not _check_registries(info):
            return self

        def params_of(name: str) -> Any:
            return REGISTRY.load("algorithms", name).params_model

        extra = self.__pydantic_extra__ if self.__pydantic_extra__ is not None else {}
        for name, raw in list(extra.items()):
            known = REGISTRY.has("algorithms", name)
            model = params_of(name) if known else None
            if model is None:
                tables = [n for n in REGISTRY.names("algorithms") if params_of(n) is not None]
                raise ValueError(f"[algorithm.{printable(str(name), 60)}]: "
                                 + ("this algorithm has no parameters of its own" if known
                                    else "no such algorithm")
                                 + f"; the tables are {', '.join(tables)}")
            if not isinstance(raw, model):
                try:
                    extra[name] = model.model_validate(raw)
                except ValidationError as exc:
                    err = exc.errors()[0]
                    where = ".".join(str(x) for x in err["loc"])
                    given = f" = {printable(repr(err['input']), 40)}" if err["loc"] else ""
                    raise ValueError(f"{name}.{where}{given}: {err['msg']}") from None
        own = params_of(self.name) if REGISTRY.has("algorithms", self.name) else None
        if own is not None and self.name not in extra:
            extra[self.name] = own()
        return self

    def table(self, name: str, model: type[P]) -> P:
        """[algorithm.<name>] as `model` (its defaults where the config has no such table)."""
        got = (self.model_extra or {}).get(name)
        return got if isinstance(got, model) else model.model_validate(got or {})

    @field_validator("finetune_blocks")
    @classmethod
    def _block_list(cls, v: Union[str, List[str]]) -> Union[str, List[str]]:
        if isinstance(v, list) and (not v or len(set(v)) != len(v) or "all" in v):
            raise ValueError(f"{v}: give \"all\", \"head\" or a list of distinct block names, "
                             "e.g. [\"conv1\", \"head\"]")
        return v


class TrainConfig(_Section):
    """[train]: local training and evaluation settings shared by every algorithm."""

    join_ratio: float = Field(0.2, gt=0, le=1, description=(
        "The share of clients selected a round: floor(join_ratio x num_clients), at least one."))
    local_epochs: int = Field(5, ge=1, description="Local epochs a selected client trains a round.")
    batch_size: int = Field(20, ge=1, description="Local training batch size.")
    lr: float = Field(0.01, gt=0, description="Local SGD learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="Local SGD momentum.")
    lr_milestones: List[float] = Field(default_factory=list, description=(
        "Step decay of the learning rate: fractions of `rounds` (each in (0, 1), increasing) from "
        "which lr is multiplied by lr_gamma once more (FedBABU's code: [0.5, 0.75]); empty: a "
        "constant rate. The final fine-tuning trains at train.lr."))
    lr_gamma: float = Field(0.1, gt=0, le=1, description="Step decay: the factor at each milestone.")
    augment: List[Literal["crop", "flip", "jitter"]] = Field(default_factory=list, description=(
        "Training augmentation, drawn per image from the run's training stream, the same on a "
        "device: crop (pad by crop_padding with black, then a random crop of the image's size), "
        "flip (horizontal, p = 0.5), jitter (brightness, contrast and, on colour images, "
        "saturation each scaled by a factor in [0.8, 1.2]). Applied to local training and "
        "fine-tuning, never to evaluation; empty: none."))
    crop_padding: int = Field(4, ge=1, description="augment = crop: the padding in pixels.")
    eval_every: int = Field(1, ge=1, description="Evaluate every this many rounds (and the last).")
    eval_batch_size: int = Field(128, ge=1, description=(
        "Evaluation batch: 128 keeps a device's peak memory low (at 2000 the ConvNet's first "
        "activation alone is 295 MB on a Jetson Nano's 4 GB) at the same speed on CPU."))
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:[0-9]+)?)$", description=(
        "fedseq-sim: where the model, batches and images live: cpu, cuda, cuda:N, or auto (cuda "
        "when available). Results differ from CPU runs in the last bits (kernels)."))
    threads: Union[int, str, None] = Field(None, description=(
        "fedseq-sim's torch threads: a number; default 1 (the same run from a seed on every "
        "machine and under any load, bitwise what --workers gives; --workers N is the fast way "
        "to use N cores); `auto` = the cores not busy at start (faster on an idle machine, but "
        "the result then depends on the load). Recorded in the run directory."))
    mode: Literal["sync", "async"] = Field("sync", json_schema_extra=COORDINATOR, description=(
        "How the run advances (server/rounds/buffered.py): sync rounds, each waiting for its selected "
        "clients (or its deadline), or async: buffered asynchronous aggregation (FedBuff): "
        "`concurrency` clients train at once and the server steps every `buffer` updates; a server "
        "step is a round for everything that counts rounds."))
    concurrency: Optional[int] = Field(None, ge=1, json_schema_extra=COORDINATOR, description=(
        "async: clients training at once (default: the clients a round selects)."))
    buffer: Optional[int] = Field(None, ge=1, json_schema_extra=COORDINATOR, description=(
        "async: updates folded per server step (default: half the concurrency, rounded up)."))
    staleness_alpha: float = Field(0.5, ge=0, json_schema_extra=COORDINATOR, description=(
        "async: an update trained tau server steps ago counts (1 + tau)^-alpha as much (FedBuff's "
        "1/sqrt(1 + tau) at 0.5; 0: staleness ignored)."))
    max_staleness: Optional[int] = Field(10, ge=0, json_schema_extra=COORDINATOR, description=(
        "async: an update staler than this many server steps is refused (none: none is)."))
    over_select: float = Field(1.0, ge=1, json_schema_extra=COORDINATOR, description=(
        "sync: select over_select x the round's clients and count the first updates to arrive "
        "(the others are late); 1: no over-selection."))

    @field_validator("threads")
    @classmethod
    def _threads_count_or_auto(cls, v: Union[int, str, None]) -> Union[int, str, None]:
        if (isinstance(v, int) and v < 1) or (isinstance(v, str) and v != "auto"):
            raise ValueError(f"{v!r} is not a thread count >= 1 or \"auto\"")
        return v


class AggregationConfig(_Section):
    """[aggregation]: how validated updates become the new global model (docs/security.md)."""

    rule: str = Field("mean", json_schema_extra=COORDINATOR, description=(
        "A registered aggregation rule (`fedseq plugins`): mean, exact FedAvg; clipped-mean, "
        "trimmed-mean, median, krum: robust rules (docs/security.md); or one an installed package "
        "registers (entry point group fedseq.aggregators). Coordinator only: a device needs no "
        "rule installed."))
    options: Dict[str, Any] = Field(default_factory=dict, json_schema_extra=COORDINATOR,
                                    description=(
        "[aggregation.options]: the rule's own options, validated by its `options_model` "
        "(a plugin rule's; the built-in rules take none: their keys are the ones here)."))
    clip_norm: Optional[float] = Field(None, gt=0, description="clipped-mean: an absolute L2 bound.")
    clip_factor: float = Field(2.0, gt=0, description="clipped-mean: bound = factor x median norm.")
    trim_ratio: float = Field(0.1, gt=0, lt=0.5, description="trimmed-mean: ceil(ratio x n) cut per end.")
    outlier_factor: float = Field(5.0, gt=1, description=(
        "Log updates with a norm > factor x the median of the round's other updates (rounds of "
        "at least five updates)."))
    max_abs_delta: Union[float, Literal["auto"]] = Field("auto", description=(
        "Refuse an update with a larger element; auto: 10 x the largest parameter magnitude of the "
        "global model at that round, at least 1. Running statistics have bounds of their own "
        "(server/rounds/contract.py)."))
    byzantine_devices: Optional[int] = Field(None, ge=0, description=(
        "f, the Byzantine devices (logins) a robust rule must withstand; default 1 for the robust "
        "rules (rounds then need 2f+1 reporting devices), 0 for the mean, which withstands none."))

    @field_validator("rule")
    @classmethod
    def _rule_registered(cls, v: str, info: ValidationInfo) -> str:
        return _registered_name("aggregators", v) if _check_registries(info) else v

    @model_validator(mode="after")
    def _options_fit(self, info: ValidationInfo) -> AggregationConfig:
        """[aggregation.options] as the rule's own schema reads them, so a bad option fails with
        the config (a plugin rule's code is imported for it; a built-in's only to refuse
        options)."""
        if _check_registries(info) and (self.options or not REGISTRY.entry(
                "aggregators", self.rule).builtin):
            from fedseq.common.algorithms.robust import rule_options

            try:
                rule_options(self, REGISTRY.load("aggregators", self.rule))
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _mean_bounds_nothing(self) -> AggregationConfig:
        if self.rule == "mean" and self.byzantine_devices:
            raise ValueError(f"aggregation.byzantine_devices={self.byzantine_devices} needs a robust "
                             "rule: the mean is moved arbitrarily by one device; set aggregation.rule "
                             "to clipped-mean, trimmed-mean, median or krum")
        return self

    @field_validator("max_abs_delta")
    @classmethod
    def _positive(cls, v: Union[float, str]) -> Union[float, str]:
        if not isinstance(v, str) and not v > 0:
            raise ValueError(f"{v!r} is not a positive bound or \"auto\"")
        return v

    def delta_bound(self, largest_weight: float) -> float:
        """The largest element an update may hold, given the global model's largest |weight|."""
        if self.max_abs_delta == "auto":
            return max(10.0 * largest_weight, 1.0)
        return float(self.max_abs_delta)

    def byzantine(self) -> int:
        """f, resolved: the configured value, else 1 for a robust rule and 0 for the mean."""
        if self.byzantine_devices is not None:
            return self.byzantine_devices
        return 0 if self.rule == "mean" else 1


class DeployConfig(_Section):
    """[deploy]: MQTT deployment (fedseq-server start); ignored by fedseq-sim."""

    host: str = Field("127.0.0.1", json_schema_extra=COORDINATOR,
                      description="The embedded broker's bind address.")
    port: int = Field(18830, ge=0, le=65535, description=(
        "The embedded broker's port (0: a free one); not 1883, where a system Mosquitto usually "
        "listens."))
    broker: Optional[str] = Field(None, json_schema_extra=COORDINATOR, description=(
        "mqtt://HOST:PORT or mqtts://HOST:PORT of an external broker (Mosquitto); none: an embedded "
        "one."))
    topic_root: str = Field("fedseq", pattern=r"^[A-Za-z0-9_\-]+$", description=(
        "The first level of every topic (docs/protocol.md)."))
    min_devices: int = Field(1, ge=1, description="Devices the run waits for before it starts.")
    wait_devices_s: float = Field(300, gt=0, description=(
        "How long to wait for min_devices: at the start, and before a step while fewer of the "
        "assigned devices are online; a device still missing then is not waited for again until "
        "it is back online."))
    round_timeout_s: Optional[float] = Field(None, gt=0, description=(
        "A fixed round deadline; default: round_timeout_factor x the slowest device's recent pace "
        "(seconds per client x its clients this round), within [min, max], max until every device "
        "was measured."))
    round_timeout_factor: float = Field(3.0, gt=1, description=(
        "The deadline's multiple of the slowest device's pace."))
    round_timeout_min_s: float = Field(60, gt=0, description="The shortest measured deadline.")
    round_timeout_max_s: float = Field(1800, gt=0, description=(
        "The longest measured deadline, and the deadline until every device was measured."))
    finetune_timeout_s: float = Field(3600, gt=0, description=(
        "The final fine-tuning's deadline (every client fine-tunes)."))
    min_updates: int = Field(1, ge=1, description=(
        "Valid updates a round needs; below it the round is discarded with its reason."))
    eval_timeout_s: float = Field(600, gt=0, description="An evaluation step's deadline.")
    username: Optional[str] = Field(None, json_schema_extra=COORDINATOR, description=(
        "The coordinator's broker account (Mosquitto with a password file)."))
    password_file: Optional[Path] = Field(None, json_schema_extra=COORDINATOR,
                                          description="A file holding that account's password.")
    ca_file: Optional[Path] = Field(None, json_schema_extra=COORDINATOR, description=(
        "TLS (mqtts://): the CA that signed the broker's certificate."))
    cert_file: Optional[Path] = Field(None, json_schema_extra=COORDINATOR,
                                      description="Mutual TLS: this side's certificate.")
    key_file: Optional[Path] = Field(None, json_schema_extra=COORDINATOR,
                                     description="Mutual TLS: this side's key.")
    tls_verify_hostname: bool = Field(True, description=(
        "Check that the broker's certificate names the host connected to."))
    guard_username: Optional[str] = Field(None, json_schema_extra=COORDINATOR, description=(
        "Mosquitto with its dynamic-security plugin (broker.conf): the login that holds the "
        "plugin's admin role. With it the coordinator disables at the broker a device login that "
        "keeps flooding after its budget is spent, for a cool-down that doubles with each flood "
        "(docs/security.md); without it the budget alone bounds a flood."))
    guard_password_file: Optional[Path] = Field(None, json_schema_extra=COORDINATOR, description=(
        "A file holding deploy.guard_username's password."))
    broker_password_file: Optional[Path] = Field(None, json_schema_extra=COORDINATOR, description=(
        "Embedded amqtt only: its password file (`fedseq-server passwd`). Bound to anything but "
        "loopback, the embedded broker refuses anonymous logins unless allow_anonymous is set."))
    allow_anonymous: bool = Field(False, description=(
        "Embedded amqtt beyond loopback: accept logins without a password."))
    pin_plugin_code: bool = Field(True, json_schema_extra=COORDINATOR, description=(
        "Pin each plugin the run uses to its code as installed here (a digest of its package's "
        "source): a device whose installed code differs under the same version, an edited "
        "`pip install -e` checkout for one, refuses the run in one line naming the plugin. "
        "false: versions alone are compared."))
    embedded_broker: Literal["amqtt", "mosquitto"] = Field("amqtt", json_schema_extra=COORDINATOR,
                                                           description=(
        "Which embedded broker: amqtt in the coordinator, or mosquitto started for the run from the "
        "checkout's broker.conf and ACL, with a login made for the run that the coordinator and its "
        "--local-devices share. amqtt drops a message a device does not acknowledge within 5 s "
        "(amqtt issue #391): slow links (a rehearsal's wifi-poor, 3g-fast) need mosquitto."))


class FleetGroup(_Section):
    """Devices of one kind in a simulated fleet: a device profile (server/rounds/virtual_fleet.py PROFILES),
    how many, and their link (a rehearsal link profile, server/ops/rehearsal.py)."""

    profile: str = Field(description=(
        "nano, xavier-nx, orin-nano (each also -cpu), or custom:gflops=G,train_w=W,idle_w=W."))
    count: int = Field(1, ge=1, description="How many devices of this kind.")
    link: str = Field("wifi-good", description=(
        "Their link: wifi-good, wifi-poor, lte, 3g-fast or custom:... (docs/rehearsal.md)."))


class FleetConfig(_Section):
    """[fleet]: fedseq-sim's model of time (server/rounds/virtual_fleet.py). Empty (default): no
    virtual clock. Given devices, clients are dealt to them as a deployment deals them (devices by name,
    round-robin), and every row carries the round's simulated seconds and modelled joules."""

    devices: List[FleetGroup] = Field(default_factory=list, description=(
        "The simulated devices, e.g. [{profile=\"nano\", count=5}, {profile=\"orin-nano\", "
        "count=5}]; empty: no virtual clock."))
    jitter: float = Field(0.1, ge=0, le=2, description=(
        "The spread of a device's pace from one client-round to the next: its time is multiplied "
        "by exp(jitter x N(0, 1)), drawn from the run's training seed."))

    def __bool__(self) -> bool:
        return bool(self.devices)


class HierarchyConfig(_Section):
    """[hierarchy]: edge sites, HierFAVG (Liu et al. 2019): the fleet's devices grouped into sites,
    each with an edge aggregator that folds its clients' updates and sends the coordinator one
    partial aggregate (server/rounds/sites.py; docs/how-to/edge-sites.md). Empty (default): one
    tier, every update goes to the coordinator."""

    sites: Dict[str, List[str]] = Field(default_factory=dict, description=(
        "Site name -> the device names it holds, e.g. {lab1 = [\"jetson01\", \"jetson02\"], "
        "lab2 = [\"jetson03\"]}; clients are dealt to the devices of all sites as a deployment "
        "deals them (devices by name, round-robin), or with data.placement = \"device\" are the "
        "clients each device holds. In simulation with a [fleet], the names are "
        "the fleet's (nano-00, ...)."))
    edge_rounds: int = Field(1, ge=1, le=100, description=(
        "k: site rounds per global round; each site averages its clients' updates k times "
        "before it sends the coordinator its model's change (HierFAVG's kappa_1). 1: FedAvg "
        "through two tiers, the flat run's result within float rounding. At most 100."))
    edge_aggregation: bool = Field(True, description=(
        "false: the sites are only the network's shape, every update crosses its site's link "
        "to the coordinator and is folded there (the flat run, timed over the same tree: the "
        "baseline for two tiers)."))
    links: Dict[str, str] = Field(default_factory=dict, description=(
        "Site name -> its link to the coordinator in the simulated fleet and the rehearsal "
        "(a link profile, e.g. \"custom:down=10,up=2,delay=20\"); a site not named: no "
        "cost. Each device's own link ([fleet]) is then its link to its site."))

    def __bool__(self) -> bool:
        return bool(self.sites)

    @field_validator("sites")
    @classmethod
    def _check_sites(cls, v: Dict[str, List[str]]) -> Dict[str, List[str]]:
        seen: Dict[str, str] = {}
        for site, devices in v.items():
            if not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", site):
                raise ValueError(f"site name {site!r}: use 1-64 letters, digits, _ or -")
            if not devices:
                raise ValueError(f"site {site!r} has no devices; list its device names")
            for d in devices:
                if d in seen:
                    raise ValueError(f"device {d!r} is in sites {seen[d]!r} and {site!r}; "
                                     "a device belongs to one site")
                seen[d] = site
        clash = sorted(set(v) & set(seen))
        if clash:  # a site's edge aggregator logs in as its site: a device cannot be it
            raise ValueError(f"{', '.join(map(repr, clash))} names both a site and a device; "
                             "give sites names of their own")
        return v

    @model_validator(mode="after")
    def _check_links(self) -> HierarchyConfig:
        unknown = sorted(set(self.links) - set(self.sites))
        if unknown:
            raise ValueError(f"hierarchy.links names {', '.join(unknown)}, not among "
                             f"hierarchy.sites ({', '.join(self.sites) or 'none'})")
        return self

    def site_of(self) -> Dict[str, str]:
        """device name -> its site."""
        return {d: s for s, devices in self.sites.items() for d in devices}


class WireConfig(_Section):
    """[wire]: the codecs of what crosses the wire (common/codecs.py): `up` for the clients'
    updates, `down` for the global blocks sent to them (the coordinator keeps its float32
    master). Applied in every transport alike: a simulation trains on what a device would."""

    up: Literal["none", "fp16", "bf16", "int8", "topk"] = Field("none", description=(
        "The clients' updates: none (float32), fp16, bf16, int8, or topk (the fraction `topk` of "
        "each tensor's largest entries, with error feedback kept by the client)."))
    down: Literal["none", "fp16", "bf16", "int8"] = Field("none", description=(
        "The global blocks sent to clients (personal blocks always travel as they are)."))
    topk: float = Field(0.01, gt=0, le=1, description="up = topk: the fraction of each tensor's entries.")
    int8_scale: Literal["channel", "tensor"] = Field("channel", description=(
        "int8: a scale per output channel or per tensor."))
    int8_rounding: Literal["nearest", "stochastic"] = Field("nearest", description=(
        "up = int8: round to nearest, or stochastically from the run's seeded streams (unbiased)."))

    def codec(self, direction: Literal["up", "down"]) -> Any:
        """That direction's common.codecs.Codec."""
        from fedseq.common.codecs import Codec  # torch: read when a run starts, not before

        name = self.up if direction == "up" else self.down
        return Codec(name, topk=self.topk, per_channel=self.int8_scale == "channel",
                     stochastic=direction == "up" and self.int8_rounding == "stochastic")


class SeedsConfig(_Section):
    """[seeds]: pin one random stream to its own seed; a stream left unset follows `seed` (the
    noise: a secret of each run).
    `fedseq-sim --seeds 0,1,2 --vary init` uses this to vary some streams and fix the others."""

    data: Optional[int] = Field(None, description=(
        "The partition, each client's train/test split, data.fraction's subset."))
    init: Optional[int] = Field(None, description="The initial model weights.")
    selection: Optional[int] = Field(None, description="Which clients join each round.")
    training: Optional[int] = Field(None, description=(
        "Batch order, augmentation, fine-tuning batches."))
    noise: Optional[int] = Field(None, json_schema_extra=COORDINATOR, description=(
        "[privacy]'s Gaussian noise on the coordinator. Unset (the default): a secret drawn for "
        "each run and kept in its checkpoint alone, not the run's seed. Pinned: reproducible "
        "noise (a simulation against --workers or a deployment), but config.toml records it and "
        "whoever knows it can subtract the noise; never pin it where the guarantee matters. "
        "Never sent to devices."))


class PrivacyConfig(_Section):
    """[privacy]: differential privacy (docs/how-to/privacy.md). Client level, DP-FedAvg
    (McMahan et al., ICLR 2018): clipped on the device, noised and accounted on the coordinator.
    Record level, DP-SGD (Abadi et al., CCS 2016): every local step of every client clips each
    example's gradient and adds noise, and the coordinator accounts each client's epsilon.
    Coordinator only: devices get what they need in their plans."""

    enabled: bool = Field(False, description=(
        "Differential privacy at privacy.level, with epsilon in every round's row. Client level: "
        "clip every update on its device, add Gaussian noise to the round's sum (an async run's: "
        "every server step's), sample a synchronous run's clients by Poisson sampling (rate "
        "train.join_ratio)."))
    level: Literal["client", "record"] = Field("client", description=(
        "What one unit of privacy is: a client (DP-FedAvg: whether a client took part at all) "
        "or one training example of a client (DP-SGD in local training: clip_norm is then the "
        "per-example gradient's bound and noise_multiplier the noise of every local step; "
        "needs torch >= 2.0 and opacus where clients train, a model without batch "
        "normalization, and an algorithm without client-side loss terms)."))
    clip_norm: float = Field(1.0, gt=0, description=(
        "C: the L2 norm every client's whole upload is scaled to at most; the round contract "
        "refuses an update above it."))
    noise_multiplier: float = Field(1.0, ge=0, description=(
        "z: the noise on the sum of the round's updates has standard deviation z x clip_norm "
        "(0: no noise, epsilon infinite)."))
    delta: float = Field(1e-5, gt=0, lt=1, description=(
        "The delta epsilon is reported at; well below 1 / num_clients."))
    target_epsilon: Optional[float] = Field(None, gt=0, description=(
        "Client level: refuse a run whose epsilon after its last round would exceed it, saying "
        "how many rounds fit. Record level (sync): end the federated rounds before the first "
        "round that would take a client past it (the last round run is evaluated, the "
        "fine-tuning follows, the row says why)."))
    adaptive: bool = Field(False, description=(
        "Adaptive clipping (Andrew et al., NeurIPS 2021): clip_norm is the first round's, then "
        "it follows target_quantile of the updates' norms, learned from a noised count of the "
        "clients whose update was within it; its privacy cost is in noise_multiplier."))
    target_quantile: float = Field(0.5, gt=0, lt=1, description=(
        "adaptive: the quantile of the updates' norms the clip norm tracks (0.5: the median)."))
    clip_lr: float = Field(0.2, gt=0, description=(
        "adaptive: eta, C <- C exp(-eta (noised share within C - target_quantile))."))
    count_noise: Optional[float] = Field(None, gt=0, description=(
        "adaptive: sigma_b, the standard deviation of the noise on the count; default: the "
        "expected clients a round / 20 (the paper's). The updates' noise multiplier is then "
        "(z^-2 - (2 sigma_b)^-2)^-1/2, so that both together spend what noise_multiplier z does."))

    @property
    def client_level(self) -> bool:
        """DP-FedAvg: clipped updates, a noised sum, Poisson-sampled clients."""
        return self.enabled and self.level == "client"

    @property
    def record_level(self) -> bool:
        """DP-SGD in every client's local training."""
        return self.enabled and self.level == "record"


class SecAggConfig(_Section):
    """[secagg]: secure aggregation, SecAgg+ (Bell et al., CCS 2020): the coordinator learns only
    the sum of a round's updates (docs/how-to/secure-aggregation.md). Coordinator only: devices
    get their round's setup in their plans."""

    enabled: bool = Field(False, description=(
        "Mask every update on its device so that only the round's sum can be unmasked; needs "
        "aggregation.rule = \"mean\", train.mode = \"sync\", wire.up = \"none\" (a 32-bit ring, 4 "
        "bytes a value) or \"int8\" (a 16-bit ring, 2 bytes a value)."))
    clip_range: float = Field(4.0, gt=0, description=(
        "B: every coordinate of an update is clamped to [-B, B] on its device before it is "
        "encoded in fixed point (the sum then cannot wrap around the ring); the mean's "
        "encoding error is at most (clients x B) / 2^32 per coordinate in the 32-bit ring, "
        "(clients x B) / 2^16 in the 16-bit one (wire.up = \"int8\"), times the largest "
        "client's weight over the mean weight."))
    neighbours: Optional[int] = Field(None, ge=1, description=(
        "k: each client masks with k others (a random regular graph); default 2 ceil(log2 n) "
        "for n clients in the round, every other client where that is more."))
    threshold: float = Field(0.5, gt=0, lt=1, description=(
        "t as a share of k: floor(threshold x k) + 1 of a client's neighbours recover its "
        "masks if it drops; fewer, colluding with the coordinator, learn nothing of it."))


class ExperimentConfig(_Section):
    """One experiment: everything a run (simulated or deployed) is a function of, with the seed."""

    seed: int = Field(0, description="The seed of every random stream [seeds] does not pin.")
    rounds: int = Field(100, ge=1, description="Federated rounds (server steps in async).")
    data: DataConfig = Field(default_factory=lambda: DataConfig(), description="[data]")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(), description="[model]")
    algorithm: AlgorithmConfig = Field(default_factory=lambda: AlgorithmConfig(), description="[algorithm]")
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(), description="[train]")
    aggregation: AggregationConfig = Field(default_factory=lambda: AggregationConfig(),
                                           description="[aggregation]")
    deploy: DeployConfig = Field(default_factory=lambda: DeployConfig(), description="[deploy]")
    seeds: SeedsConfig = Field(default_factory=lambda: SeedsConfig(), description="[seeds]")
    wire: WireConfig = Field(default_factory=lambda: WireConfig(), description="[wire]")
    fleet: FleetConfig = Field(default_factory=lambda: FleetConfig(), json_schema_extra=COORDINATOR,
                               description="[fleet]")
    privacy: PrivacyConfig = Field(default_factory=lambda: PrivacyConfig(), json_schema_extra=COORDINATOR,
                                   description="[privacy]")
    secagg: SecAggConfig = Field(default_factory=lambda: SecAggConfig(), json_schema_extra=COORDINATOR,
                                 description="[secagg]")
    hierarchy: HierarchyConfig = Field(default_factory=lambda: HierarchyConfig(),
                                       json_schema_extra=COORDINATOR, description="[hierarchy]")

    def registered_names(self) -> Dict[str, str]:
        """The registry names the run uses, by group (common/registry.py): its model, dataset,
        algorithm and aggregation rule."""
        return {"models": self.model.name, "datasets": self.data.dataset,
                "algorithms": self.algorithm.name, "aggregators": self.aggregation.rule}

    def plugins(self) -> List[str]:
        """The plugins a device must allow to follow the run: its model, dataset and algorithm
        where they are not fedseq's built-ins (the aggregation rule runs on the coordinator)."""
        return sorted({name for group, name in self.registered_names().items()
                       if group in DEVICE_GROUPS and not REGISTRY.entry(group, name).builtin})

    def seed_for(self, stream: str) -> int:
        """The seed of one random stream (SEED_STREAMS): its [seeds] pin, else `seed`. (The
        coordinator's noise does not use it unpinned: Ledger.noise_seed, a secret of the run.)"""
        pinned = getattr(self.seeds, stream)
        return self.seed if pinned is None else pinned

    def with_clients(self, n: int) -> ExperimentConfig:
        """This config with data.num_clients = n (data.placement = "device": as many clients as
        the devices announce, or as --devices-data's folders hold)."""
        return self.model_copy(update={"data": self.data.model_copy(update={"num_clients": n})})

    @model_validator(mode="after")
    def _check_driver(self) -> ExperimentConfig:
        t = self.train
        if t.mode == "async":
            concurrency, buffer = self.async_shape()
            if concurrency > self.data.num_clients:
                raise ValueError(f"train.concurrency={concurrency} is more than the "
                                 f"{self.data.num_clients} clients; lower it")
            if t.over_select != 1.0:
                raise ValueError("train.over_select is for train.mode = \"sync\"; an "
                                 "asynchronous run has no rounds to over-select")
        return self

    @model_validator(mode="after")
    def _check_privacy(self) -> ExperimentConfig:
        if self.privacy.record_level:
            p = self.privacy
            if p.adaptive:
                raise ValueError("privacy.adaptive is for privacy.level = \"client\"; "
                                 "record-level DP-SGD keeps a fixed clip norm and reports "
                                 "each client's epsilon in the rows")
            if p.target_epsilon is not None and self.train.mode == "async":
                raise ValueError("privacy.target_epsilon at privacy.level = \"record\" stops "
                                 "a synchronous run before the round that would pass it; an "
                                 "async run's steps are not known ahead: use train.mode = "
                                 "\"sync\" or leave target_epsilon out")
            return self
        if not self.privacy.enabled:
            return self
        why = "privacy.enabled = true (DP-FedAvg, docs/how-to/privacy.md)"
        if self.aggregation.rule != "mean":
            raise ValueError(f"{why} calibrates its noise to a sum; aggregation.rule = "
                             f"{self.aggregation.rule!r} has another sensitivity: use \"mean\"")
        if self.train.mode == "async" and self.privacy.adaptive:
            raise ValueError(f"{why}: privacy.adaptive counts its bits per synchronous round; "
                             "with train.mode = \"async\" use a fixed privacy.clip_norm")
        if self.train.over_select != 1.0:
            raise ValueError(f"{why} samples each client with probability train.join_ratio; "
                             "train.over_select changes who counts: leave it at 1")
        p = self.privacy
        if p.adaptive and p.noise_multiplier > 0:
            sigma_b = p.count_noise or self.train.join_ratio * self.data.num_clients / 20
            if 2 * sigma_b <= p.noise_multiplier:
                raise ValueError(
                    f"privacy.adaptive: the count's noise sigma_b = {sigma_b:g} leaves no noise "
                    f"for the updates under noise_multiplier {p.noise_multiplier:g} (2 sigma_b "
                    "must exceed it): raise privacy.count_noise or lower noise_multiplier")
        return self

    @model_validator(mode="after")
    def _check_secagg(self) -> ExperimentConfig:
        if not self.secagg.enabled:
            return self
        why = "secagg.enabled = true (the coordinator learns only the round's sum)"
        if self.aggregation.rule != "mean":
            raise ValueError(f"{why} cannot feed aggregation.rule = {self.aggregation.rule!r}, "
                             "which needs every update on its own: use \"mean\"")
        if self.train.mode == "async":
            raise ValueError(f"{why} needs a round's clients to share keys before any sends its "
                             "update; train.mode = \"async\" folds updates one by one as they "
                             "arrive: use \"sync\"")
        if self.wire.up not in ("none", "int8"):
            raise ValueError(f"{why}: the masked input is the upload, ring elements that "
                             f"wire.up = {self.wire.up!r} cannot code: use \"none\" (a 32-bit "
                             "ring) or \"int8\" (a 16-bit ring, 2 bytes a value)")
        if self.privacy.client_level and self.privacy.adaptive:
            raise ValueError(f"{why}: privacy.adaptive counts every client's bit in the clear; "
                             "use a fixed privacy.clip_norm")
        return self

    @model_validator(mode="after")
    def _check_hierarchy(self) -> ExperimentConfig:
        if not self.hierarchy:
            return self
        why = "[hierarchy] (edge sites)"
        if self.train.mode == "async":
            raise ValueError(f"{why} runs synchronous site rounds inside every global round; "
                             "train.mode = \"async\" has no rounds to nest: use \"sync\"")
        if self.aggregation.rule != "mean":
            raise ValueError(f"{why} folds a site's updates into one partial sum; "
                             f"aggregation.rule = {self.aggregation.rule!r} needs every update "
                             "on its own: use \"mean\" or leave [hierarchy] out")
        if self.train.over_select != 1.0:
            raise ValueError(f"{why}: train.over_select is not supported across sites; leave it "
                             "at 1")
        if self.privacy.client_level and self.hierarchy.edge_rounds > 1:
            raise ValueError(f"{why}: privacy.enabled at the client level bounds one update per "
                             "client and round; hierarchy.edge_rounds > 1 lets a client move "
                             "the model k times: use edge_rounds = 1")
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> ExperimentConfig:
        # A t_k >= rounds is allowed: that block stays frozen until fine-tuning (the FedSeq paper's
        # T=100 rows use t = 0/100/200).
        t = self.algorithm.unfreeze_rounds
        if t and (t != sorted(t) or t[0] < 0):
            raise ValueError(f"algorithm.unfreeze_rounds {t} must be ascending rounds >= 0")
        m = self.train.lr_milestones
        if m and (m != sorted(set(m)) or m[0] <= 0 or m[-1] >= 1):
            raise ValueError(f"train.lr_milestones {m} must be increasing fractions of the rounds, "
                             "each in (0, 1), e.g. [0.5, 0.75]")
        if len(set(self.train.augment)) != len(self.train.augment):
            raise ValueError(f"train.augment {self.train.augment} names an augmentation twice")
        return self

    def lr_at(self, round: int) -> float:
        """The local learning rate of `round` (from 0): train.lr, times lr_gamma for each of
        train.lr_milestones whose round (fraction x rounds) has been reached."""
        t = self.train
        steps = sum(1 for m in t.lr_milestones if round >= m * self.rounds - 1e-9)
        return t.lr * t.lr_gamma ** steps

    def for_devices(self) -> dict[str, Any]:
        """The config as the run broadcasts it: without the keys their fields declare
        coordinator-only (`COORDINATOR`: its data root, broker account and files, the driver,
        the server's step, the noise's seed, [fleet], [privacy]), which devices neither need nor
        should learn; without the algorithms' parameter tables (a device gets what its client
        side needs in every plan); and without a key marked `since` the current protocol at its
        default (a device of this protocol older than the key would refuse it)."""
        from fedseq.common.protocol.messages import PROTOCOL_VERSION  # imports nothing of this

        data = self.model_dump(mode="json")
        for name, f in type(self).model_fields.items():
            section = getattr(self, name)
            if _read_by(f) == "coordinator":
                data.pop(name)
            elif isinstance(section, BaseModel):
                out = data[name]
                for key in section.model_extra or {}:  # [algorithm.<name>] tables
                    out.pop(key)
                for key, field in type(section).model_fields.items():
                    mark = _read_by(field)
                    if mark == "coordinator" or (
                            mark == PROTOCOL_VERSION and getattr(section, key) ==
                            field.get_default(call_default_factory=True)):
                        out.pop(key)
        return data

    def clients_per_round(self) -> int:
        """floor(join_ratio * num_clients), at least one (paper Algorithm 1, line 2)."""
        return max(1, int(self.train.join_ratio * self.data.num_clients + 1e-9))

    def async_shape(self) -> tuple[int, int]:
        """train.mode = "async": (clients training at once, updates per server step), resolved."""
        concurrency = self.train.concurrency or self.clients_per_round()
        return concurrency, self.train.buffer or -(-concurrency // 2)

    def selected_per_round(self) -> int:
        """Clients a synchronous round selects: clients_per_round() x train.over_select (at most
        every client)."""
        k = self.clients_per_round()
        return min(self.data.num_clients, max(k, int(k * self.train.over_select + 1e-9)))


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split 'dotted.key=value'; the value uses TOML syntax, a bare word is a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected dotted.key=value, e.g. --set train.lr=0.005")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def _suggest(where: str) -> str:
    """ "; did you mean X?" for a misspelt dotted key (a section or a key of its section), or ""."""
    import difflib

    parts = where.split(".")
    model: Any = ExperimentConfig
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if not fields:
            return ""
        if part not in fields:
            close = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
            if not close:  # by what the key means: "learning_rate" is lr ("... learning rate")
                words = part.replace("_", " ").split()
                scored = []
                for name, f in fields.items():
                    text = [w.strip(".,:;()`'\"") for w in (f.description or "").lower().split()]
                    spans = [" ".join(text[j:j + len(words)]) for j in range(len(text))]
                    best = max((difflib.SequenceMatcher(None, " ".join(words), sp).ratio()
                                for sp in spans), default=0.0)
                    scored.append((best, -len(text), name))  # ties: the shortest description
                best, _, name = max(scored, default=(0.0, 0, ""))
                close = [name] if best >= 0.85 else []
            return f"; did you mean {'.'.join(parts[:i] + close)}?" if close else ""
        model = fields[part].annotation
    return ""


def _format_validation(exc: ValidationError, source: str) -> str:
    p = validation_problem(exc)
    msg = p.msg
    if p.kind == "extra_forbidden":
        msg = ("unknown key" + (_suggest(p.where) or " (check the spelling)")
               + " (every key: docs/how-to/experiments.md, the site's configuration reference)")
    return f"{p.where or 'config'}: {msg}; fix it in {source}{p.more}"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} not found; pass an existing --config FILE") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc}); fix the file") from exc


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a TOML file (optional), apply --set overrides, validate. Raises ConfigError."""
    raw = _read_toml(path) if path is not None else {}
    return _validated(raw, str(path) if path is not None else "the command line", overrides)


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """A run directory's config.toml as a command that continues or replays the run reads it
    (--resume, --replay, --finetune-from): everything but data.root, which is the user's (their
    --set data.root, else the default data root), never the file's. A run directory may come
    from someone else; it cannot point the run at data it carries (a dataset reader is the
    one place a file's bytes become objects)."""
    raw = _read_toml(run_dir / "config.toml")
    data = raw.get("data")
    if isinstance(data, dict):
        data.pop("root", None)
    return _validated(raw, str(run_dir / "config.toml"), overrides)


def run_data_root(run_dir: Path) -> str | None:
    """The data.root a run directory's config.toml records (for a note when it is not used)."""
    with contextlib.suppress(ConfigError):
        root = _read_toml(run_dir / "config.toml").get("data", {}).get("root")
        return root if isinstance(root, str) else None
    return None


def _validated(raw: dict[str, Any], source: str, overrides: list[str] | None) -> ExperimentConfig:
    for item in overrides or []:
        keys, value = parse_override(item)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {k} is not a table")
        node[keys[-1]] = value
    if overrides:
        source += " or its --set override"
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source)) from exc


def dump_config(cfg: ExperimentConfig) -> str:
    """The resolved config as TOML (what a run directory stores)."""
    import tomli_w

    data = cfg.model_dump(mode="json", exclude_none=True)
    return tomli_w.dumps(data)
