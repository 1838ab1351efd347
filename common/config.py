"""Experiment configuration: TOML in, pydantic-validated, shared by simulation and deployment."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterable, List, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fedseq.common.data.catalog import CHANNEL_STATS, NUM_CLASSES
from fedseq.common.data.store import default_data_root
from fedseq.common.errors import ConfigError, validation_problem
from fedseq.common.text import printable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 on Jetson
    import tomli as tomllib

#: [algorithm] keys the coordinator alone reads (the server's optimizer)
SERVER_ONLY = ("server_lr", "beta1", "beta2", "tau")

#: [train] keys the coordinator alone reads (how the run advances)
ASYNC_ONLY = ("mode", "concurrency", "buffer", "staleness_alpha", "max_staleness", "over_select")

#: keys that devices older than them reject; the broadcast config leaves them out at their default
NEWER_KEYS = (("model", "head_init"), ("data", "normalize"), ("algorithm", "final_finetune"),
              ("algorithm", "ditto_lambda"),
              ("algorithm", "ditto_epochs"), ("algorithm", "feddyn_alpha"),
              ("algorithm", "gpfl_lambda"), ("algorithm", "gpfl_mu"),
              ("train", "lr_milestones"), ("train", "lr_gamma"), ("train", "augment"),
              ("train", "crop_padding"))

#: The random streams a run draws from; each follows `seed` unless [seeds] pins it.
SEED_STREAMS = ("data", "init", "selection", "training", "noise")


def _one_of(kind: str, name: str, names: Iterable[str]) -> str:
    """`name` if `names` (a registry's keys) holds it; else a ValueError that lists them."""
    names = list(names)
    if name not in names:
        raise ValueError(f"unknown {kind} {printable(name, 60)!r}; use one of {', '.join(names)}")
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
        "A dataset of the catalog (common/data/catalog.py): mnist, fmnist, cifar10, cifar100, the six "
        "emnist-<split>s (emnist-letters, -digits, -balanced, -byclass, -bymerge, -mnist), tiny-imagenet."))
    root: Path = Field(default_factory=default_data_root, description=(
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
    normalize: Literal["half", "channel"] = Field("half", description=(
        "How pixels become model inputs: half ((x - 0.5) / 0.5 per channel, to [-1, 1]: PFLlib's "
        "transform) or channel ((x - mean_c) / std_c with each channel's fixed statistics, as "
        "FedBABU's code normalizes; common/data/catalog.py's CHANNEL_STATS: mnist, fmnist, "
        "cifar10, cifar100, tiny-imagenet)."))

    @field_validator("dataset")
    @classmethod
    def _catalogued(cls, v: str) -> str:
        return _one_of("dataset", v, NUM_CLASSES)

    @model_validator(mode="after")
    def _has_channel_stats(self) -> DataConfig:
        if self.normalize == "channel" and self.dataset not in CHANNEL_STATS:
            raise ValueError(f"data.normalize = \"channel\" has no statistics for {self.dataset} "
                             f"(it has {', '.join(CHANNEL_STATS)}); use data.normalize = \"half\"")
        return self


class ModelConfig(_Section):
    """[model]: which model of the zoo (common/models.py)."""

    name: str = Field("cnn", description=(
        "A model of common/models.py's MODELS (the limits column lists them): cnn is the FedSeq "
        "paper's FedAvg/PFLlib CNN, convnet FedReG's FedDyn/FedRoD ConvNet; docs/models.md gives "
        "every model's source, blocks and parameters."))
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
        from fedseq.common.models import MODELS  # torch: read when a config is built, not before

        return _one_of("model", v, MODELS)


class AlgorithmConfig(_Section):
    """[algorithm]: which algorithm and its own hyperparameters."""

    name: str = Field("fedseq-anti", description=(
        "An algorithm of common/algorithms' REGISTRY (the limits column lists them; `local` is "
        "the control: every client alone on the same schedule)."))
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
    ditto_lambda: float = Field(0.1, ge=0, description=(
        "Ditto: the weight of the personal model's proximal term lambda/2 ||v - w||^2."))
    ditto_epochs: int = Field(5, ge=1, description=(
        "Ditto: epochs of the personal model a round (FedReG's \"personal local step\": 5)."))
    feddyn_alpha: float = Field(0.01, gt=0, description=(
        "FedDyn: the dynamic regularizer's weight alpha (FedReG section 4.2: 0.01, from FedDyn's "
        "code)."))
    gpfl_lambda: float = Field(0.1, ge=0, description=(
        "GPFL: the weight of its magnitude-level global guidance (FedReG section 4.2: 0.1, "
        "from GPFL's code)."))
    gpfl_mu: float = Field(0.001, ge=0, description=(
        "GPFL: the L2 regularization (weight decay) of its CoV and GCE (FedReG section 4.2's "
        "eta: 0.001)."))
    mu: float = Field(0.001, ge=0, description="FedProx: the proximal term's weight.")
    moon_mu: float = Field(1.0, ge=0, description=(
        "MOON: the weight mu of its model-contrastive term (the paper: 5 on CIFAR-10, 1 on "
        "CIFAR-100 and Tiny-ImageNet)."))
    moon_tau: float = Field(0.5, gt=0, description=(
        "MOON: the temperature tau of its model-contrastive term (the paper's 0.5)."))
    head_epochs: int = Field(1, ge=0, description="FedRep: head epochs before the body epochs.")
    personal_layers: int = Field(1, ge=1, description=(
        "FedPer's K_P: the personalization layers in blocks, the head and the last K_P - 1 base "
        "blocks (1: the head alone, FedPer's default; its section 4.3 tries 1 to 4)."))
    rebalance_threshold: Literal["mean", "median", "max"] = Field("mean", description=(
        "FedReG: the client size a client's rebalanced set is filled up to."))
    fedreg_passes: Literal["epochs", "one"] = Field("epochs", description=(
        "FedReG: passes over the original and over the rebalanced set per round: `epochs` "
        "(train.local_epochs each, section 4.1) or `one` (one each, Algorithm 1 as written)."))
    fedreg_rebalance: Literal["once", "every-round"] = Field("once", description=(
        "FedReG: build a client's rebalanced set with its augmented images once (Algorithm 3, an "
        "input of Algorithm 1) or again with fresh augmentations every round."))
    finetune_blocks: Union[str, List[str]] = Field("all", description=(
        "What the final fine-tuning (FedBABU, FedSeq, local) trains: `all` blocks (FedBABU's "
        "Algorithm 1), the `head` alone (FedReG section 5's reading), or a block name or list of "
        "them, e.g. [\"conv1\", \"head\"], checked against the model when the run starts."))
    server_lr: Optional[float] = Field(None, gt=0, description=(
        "FedAvgM, FedAdam, FedYogi (Reddi et al., ICLR 2021): the server's learning rate along the "
        "round's mean delta (default 1.0 for FedAvgM, 0.01 for the others); SCAFFOLD: its global "
        "step size (default 1). Coordinator only."))
    beta1: float = Field(0.9, ge=0, lt=1, description=(
        "The server optimizer's momentum: FedAvgM m = beta1 m + delta; FedAdam, FedYogi the EMA "
        "m = beta1 m + (1 - beta1) delta. Coordinator only."))
    beta2: float = Field(0.99, ge=0, lt=1, description=(
        "FedAdam, FedYogi: the second moment's decay. Coordinator only."))
    tau: float = Field(1e-3, gt=0, description=(
        "FedAdam, FedYogi: adaptivity; the second moment starts at tau^2. Coordinator only."))

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str, info: ValidationInfo) -> str:
        if not _check_registries(info):
            return v
        from fedseq.common.algorithms import REGISTRY  # imports this module: read at run time

        return _one_of("algorithm", v, REGISTRY)

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
        "fedseq-sim's torch threads: a number; default torch's count (this machine's physical "
        "cores, or OMP_NUM_THREADS: fixed, so a seed gives the same run whatever the load); `auto` "
        "= the cores not busy at start (faster beside other work, but the result then depends on "
        "the load). Recorded in the run directory."))
    mode: Literal["sync", "async"] = Field("sync", description=(
        "How the run advances (server/asynchronous.py): sync rounds, each waiting for its selected "
        "clients (or its deadline), or async: buffered asynchronous aggregation (FedBuff): "
        "`concurrency` clients train at once and the server steps every `buffer` updates; a server "
        "step is a round for everything that counts rounds."))
    concurrency: Optional[int] = Field(None, ge=1, description=(
        "async: clients training at once (default: the clients a round selects)."))
    buffer: Optional[int] = Field(None, ge=1, description=(
        "async: updates folded per server step (default: half the concurrency, rounded up)."))
    staleness_alpha: float = Field(0.5, ge=0, description=(
        "async: an update trained tau server steps ago counts (1 + tau)^-alpha as much (FedBuff's "
        "1/sqrt(1 + tau) at 0.5; 0: staleness ignored)."))
    max_staleness: Optional[int] = Field(10, ge=0, description=(
        "async: an update staler than this many server steps is refused (none: none is)."))
    over_select: float = Field(1.0, ge=1, description=(
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

    rule: Literal["mean", "clipped-mean", "trimmed-mean", "median"] = Field("mean", description=(
        "mean: exact FedAvg; clipped-mean, trimmed-mean, median: robust rules (docs/security.md)."))
    clip_norm: Optional[float] = Field(None, gt=0, description="clipped-mean: an absolute L2 bound.")
    clip_factor: float = Field(2.0, gt=0, description="clipped-mean: bound = factor x median norm.")
    trim_ratio: float = Field(0.1, gt=0, lt=0.5, description="trimmed-mean: ceil(ratio x n) cut per end.")
    outlier_factor: float = Field(5.0, gt=1, description="Log updates with a norm > factor x the median.")
    max_abs_delta: Union[float, Literal["auto"]] = Field("auto", description=(
        "Refuse an update with a larger element; auto: 10 x the largest parameter magnitude of the "
        "global model at that round, at least 1. Running statistics have bounds of their own "
        "(server/validation.py)."))
    byzantine_devices: Optional[int] = Field(None, ge=0, description=(
        "f, the Byzantine devices (logins) a robust rule must withstand; default 1 for the robust "
        "rules (rounds then need 2f+1 reporting devices), 0 for the mean, which withstands none."))

    @model_validator(mode="after")
    def _mean_bounds_nothing(self) -> AggregationConfig:
        if self.rule == "mean" and self.byzantine_devices:
            raise ValueError(f"aggregation.byzantine_devices={self.byzantine_devices} needs a robust "
                             "rule: the mean is moved arbitrarily by one device; set aggregation.rule "
                             "to clipped-mean, trimmed-mean or median")
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

    host: str = Field("127.0.0.1", description="The embedded broker's bind address.")
    port: int = Field(18830, ge=0, le=65535, description=(
        "The embedded broker's port (0: a free one); not 1883, where a system Mosquitto usually "
        "listens."))
    broker: Optional[str] = Field(None, description=(
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
    username: Optional[str] = Field(None, description=(
        "The coordinator's broker account (Mosquitto with a password file)."))
    password_file: Optional[Path] = Field(None, description="A file holding that account's password.")
    ca_file: Optional[Path] = Field(None, description=(
        "TLS (mqtts://): the CA that signed the broker's certificate."))
    cert_file: Optional[Path] = Field(None, description="Mutual TLS: this side's certificate.")
    key_file: Optional[Path] = Field(None, description="Mutual TLS: this side's key.")
    tls_verify_hostname: bool = Field(True, description=(
        "Check that the broker's certificate names the host connected to."))
    guard_username: Optional[str] = Field(None, description=(
        "Mosquitto with its dynamic-security plugin (broker.conf): the login that holds the "
        "plugin's admin role. With it the coordinator disables at the broker a device login that "
        "keeps flooding after its budget is spent, for a cool-down that doubles with each flood "
        "(docs/security.md); without it the budget alone bounds a flood."))
    guard_password_file: Optional[Path] = Field(None, description=(
        "A file holding deploy.guard_username's password."))
    broker_password_file: Optional[Path] = Field(None, description=(
        "Embedded amqtt only: its password file (`fedseq-server passwd`). Bound to anything but "
        "loopback, the embedded broker refuses anonymous logins unless allow_anonymous is set."))
    allow_anonymous: bool = Field(False, description=(
        "Embedded amqtt beyond loopback: accept logins without a password."))
    embedded_broker: Literal["amqtt", "mosquitto"] = Field("amqtt", description=(
        "Which embedded broker: amqtt in the coordinator, or mosquitto started for the run from the "
        "checkout's broker.conf and ACL, with a login made for the run that the coordinator and its "
        "--local-clients share. amqtt drops a message a device does not acknowledge within 5 s "
        "(amqtt issue #391): slow links (a rehearsal's wifi-poor, 3g-fast) need mosquitto."))


class FleetGroup(_Section):
    """Devices of one kind in a simulated fleet: a device profile (server/fleet.py PROFILES),
    how many, and their link (a rehearsal link profile, server/rehearsal.py)."""

    profile: str = Field(description=(
        "nano, xavier-nx, orin-nano (each also -cpu), or custom:gflops=G,train_w=W,idle_w=W."))
    count: int = Field(1, ge=1, description="How many devices of this kind.")
    link: str = Field("wifi-good", description=(
        "Their link: wifi-good, wifi-poor, lte, 3g-fast or custom:... (docs/rehearsal.md)."))


class FleetConfig(_Section):
    """[fleet]: fedseq-sim's model of time (server/fleet.py). Empty (default): no virtual clock.
    Given devices, clients are dealt to them as a deployment deals them (devices by name,
    round-robin), and every row carries the round's simulated seconds and modelled joules."""

    devices: List[FleetGroup] = Field(default_factory=list, description=(
        "The simulated devices, e.g. [{profile=\"nano\", count=5}, {profile=\"orin-nano\", "
        "count=5}]; empty: no virtual clock."))
    jitter: float = Field(0.1, ge=0, le=2, description=(
        "The spread of a device's pace from one client-round to the next: its time is multiplied "
        "by exp(jitter x N(0, 1)), drawn from the run's training seed."))

    def __bool__(self) -> bool:
        return bool(self.devices)


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
    """[seeds]: pin one random stream to its own seed; a stream left unset follows `seed`.
    `fedseq-sim --seeds 0,1,2 --vary init` uses this to vary some streams and fix the others."""

    data: Optional[int] = Field(None, description=(
        "The partition, each client's train/test split, data.fraction's subset."))
    init: Optional[int] = Field(None, description="The initial model weights.")
    selection: Optional[int] = Field(None, description="Which clients join each round.")
    training: Optional[int] = Field(None, description=(
        "Batch order, augmentation, fine-tuning batches."))
    noise: Optional[int] = Field(None, description=(
        "[privacy]'s Gaussian noise on the coordinator. Whoever knows it can subtract the noise: "
        "pin it to a secret value where the guarantee matters. Never sent to devices."))


class PrivacyConfig(_Section):
    """[privacy]: client-level differential privacy, DP-FedAvg (McMahan et al., ICLR 2018):
    clipped on the device, noised and accounted on the coordinator (docs/how-to/privacy.md).
    Coordinator only: devices get the clip norm in their plans."""

    enabled: bool = Field(False, description=(
        "Clip every update on its device, add Gaussian noise to the round's sum, sample clients "
        "by Poisson sampling (rate train.join_ratio), and report epsilon in every round's row."))
    clip_norm: float = Field(1.0, gt=0, description=(
        "C: the L2 norm every client's whole upload is scaled to at most; the round contract "
        "refuses an update above it."))
    noise_multiplier: float = Field(1.0, ge=0, description=(
        "z: the noise on the sum of the round's updates has standard deviation z x clip_norm "
        "(0: no noise, epsilon infinite)."))
    delta: float = Field(1e-5, gt=0, lt=1, description=(
        "The delta epsilon is reported at; well below 1 / num_clients."))
    target_epsilon: Optional[float] = Field(None, gt=0, description=(
        "Refuse a run whose epsilon after its last round would exceed it, saying how many "
        "rounds fit."))
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
    fleet: FleetConfig = Field(default_factory=lambda: FleetConfig(), description="[fleet]")
    privacy: PrivacyConfig = Field(default_factory=lambda: PrivacyConfig(), description="[privacy]")

    def seed_for(self, stream: str) -> int:
        """The seed of one random stream (SEED_STREAMS): its [seeds] pin, else `seed`."""
        pinned = getattr(self.seeds, stream)
        return self.seed if pinned is None else pinned

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
        if not self.privacy.enabled:
            return self
        why = "privacy.enabled = true (DP-FedAvg, docs/how-to/privacy.md)"
        if self.aggregation.rule != "mean":
            raise ValueError(f"{why} calibrates its noise to a sum; aggregation.rule = "
                             f"{self.aggregation.rule!r} has another sensitivity: use \"mean\"")
        if self.train.mode == "async":
            raise ValueError(f"{why} is accounted per synchronous round; train.mode = \"async\" "
                             "is not yet: use train.mode = \"sync\"")
        if self.wire.up not in ("none", "fp16", "bf16"):
            raise ValueError(f"{why}: wire.up = {self.wire.up!r} changes an update's norm after "
                             "it is clipped; use none, fp16 or bf16")
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
        """The config as the run broadcasts it: without the coordinator's own paths and broker
        account (its data root, password and key files, TLS files, user name), which devices
        neither need nor should learn."""
        data = self.model_dump(mode="json")
        for key in ("username", "password_file", "ca_file", "cert_file", "key_file",
                    "broker_password_file", "broker", "host", "embedded_broker", "guard_username",
                    "guard_password_file"):
            data["deploy"].pop(key, None)
        data["data"].pop("root", None)
        if not any(v is not None for v in data["seeds"].values()):
            data.pop("seeds")  # nothing pinned: the config as devices before [seeds] read it
        for key in SERVER_ONLY:  # the server optimizer's; devices before it never read them
            data["algorithm"].pop(key, None)
        data.pop("fleet")  # the simulation's model of time: a device never reads it
        data.pop("privacy")  # the coordinator's: a device gets the clip norm in its plans
        data.get("seeds", {}).pop("noise", None)  # the noise's seed stays secret
        for key in ASYNC_ONLY:  # the coordinator's driver; devices before it never read them
            data["train"].pop(key, None)
        if data["wire"] == WireConfig().model_dump(mode="json"):
            data.pop("wire")  # as devices before [wire] read it
        for section, key in NEWER_KEYS:  # at their defaults: as devices before them read it
            if data[section][key] == type(getattr(self, section)).model_fields[key].get_default(
                    call_default_factory=True):
                data[section].pop(key)
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
