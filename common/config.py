"""Experiment configuration: TOML in, pydantic-validated, shared by simulation and deployment."""

from __future__ import annotations

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

from fedseq.common.data.catalog import NUM_CLASSES
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

#: The random streams a run draws from; each follows `seed` unless [seeds] pins it.
SEED_STREAMS = ("data", "init", "selection", "training")


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

    # a dataset of the catalog (common/data/catalog.py): mnist, fmnist, cifar10, cifar100, the
    # six emnist-<split>s, tiny-imagenet
    dataset: str = "fmnist"
    # the folder holding MNIST/raw, FashionMNIST/raw, cifar-10-batches-py, ...; default: the one
    # data root of every command ($FEDSEQ_DATA, else ~/.local/share/fedseq/data; `fedseq data`)
    root: Path = Field(default_factory=default_data_root)
    partition: Literal["dirichlet", "shards", "iid", "classes"] = "dirichlet"
    alpha: float = Field(0.1, gt=0)
    shards_per_client: int = Field(2, ge=1)
    # "classes" (FedPer's CIFAR split): every client holds at most this many classes, each class
    # shared equally by the clients that hold it; k >= the classes is an IID split by class
    classes_per_client: int = Field(2, ge=1)
    num_clients: int = Field(30, ge=1)
    train_fraction: float = Field(0.75, gt=0, lt=1)
    min_samples: int = Field(40, ge=1, description="Dirichlet: redraw until every client has this many")
    fraction: float = Field(1.0, gt=0, le=1, description="use a seed-chosen subset (quick runs)")

    @field_validator("dataset")
    @classmethod
    def _catalogued(cls, v: str) -> str:
        return _one_of("dataset", v, NUM_CLASSES)


class ModelConfig(_Section):
    """[model]: which model of the zoo (common/models.py)."""

    # cnn: the FedSeq paper's (FedAvg/PFLlib) CNN; convnet: FedReG's (FedDyn/FedRoD) ConvNet;
    # 4convnet and mobilenet: FedBABU's; resnet18, resnet34: FedPer's and FedBABU's appendix
    # (docs/models.md: blocks, parameters, normalization)
    # (a name of common/models.py's MODELS, checked below: the registry is the one list)
    name: str = "cnn"
    # the heads' initial weights: "default" (PyTorch's, the same for every algorithm) or
    # "orthogonal" (FedBABU section 3 credits its fixed random head to an orthogonal init, after
    # Saxe et al.): nn.init.orthogonal_ on each head's weight, its bias as PyTorch initialises it
    head_init: Literal["default", "orthogonal"] = "default"
    # what the BatchNorm layers of 4convnet, mobilenet and the ResNets keep (docs/models.md,
    # "Normalization in FL"): "batch" (FedBABU's code: batch statistics only, no running state),
    # "running" (running mean and variance, aggregated with their block like its weights; a
    # frozen block normalizes by them, unchanged) or "fedbn" (running statistics, and every
    # normalization layer's scale, shift and statistics stay with the client: FedBN, Li et al.
    # ICLR 2021); cnn and convnet have no normalization layers and take "batch" only
    norm: Literal["batch", "running", "fedbn"] = "batch"

    @field_validator("name")
    @classmethod
    def _modelled(cls, v: str, info: ValidationInfo) -> str:
        if not _check_registries(info):
            return v
        from fedseq.common.models import MODELS  # torch: read when a config is built, not before

        return _one_of("model", v, MODELS)


class AlgorithmConfig(_Section):
    """[algorithm]: which algorithm and its own hyperparameters."""

    # a name of common/algorithms' REGISTRY (checked below: the registry is the one list)
    name: str = "fedseq-anti"
    unfreeze_rounds: List[int] = Field(default_factory=list)
    finetune_epochs: int = Field(10, ge=0)
    mu: float = Field(0.001, ge=0, description="FedProx proximal weight")
    head_epochs: int = Field(1, ge=0, description="FedRep head epochs before the body epochs")
    # FedPer's K_P: the personalization layers in blocks, the head and the last K_P - 1 base
    # blocks (1: the head alone, FedPer's default; its section 4.3 tries 1 to 4)
    personal_layers: int = Field(1, ge=1)
    rebalance_threshold: Literal["mean", "median", "max"] = "mean"
    # FedReG's local procedure (docs/design.md, "FedReG"): passes over the original and over the
    # rebalanced set per round ("epochs": train.local_epochs each, section 4.1; "one": one each,
    # as Algorithm 1 is written), and whether the rebalanced set is built once per client
    # (Algorithm 3, an input of Algorithm 1) or rebuilt with fresh augmentations every round.
    fedreg_passes: Literal["epochs", "one"] = "epochs"
    fedreg_rebalance: Literal["once", "every-round"] = "once"
    # What the final fine-tuning (FedBABU, FedSeq, local) trains: "all" blocks (FedBABU's paper,
    # Algorithm 1: the whole model), the "head" alone (how FedReG section 5 describes FedBABU's
    # re-tuning), or a block name or list of them ("head" naming the model's head), e.g.
    # ["conv1", "head"]; the names are checked against the model when the run starts. docs/results.md,
    # "Deviations from the papers".
    finetune_blocks: Union[str, List[str]] = "all"
    # The server's optimizer (FedAvgM, FedAdam, FedYogi; Reddi et al., "Adaptive Federated
    # Optimization", ICLR 2021, Algorithm 2): the round's mean delta is a pseudo-gradient that the
    # server steps along with learning rate `server_lr` (default: 1.0 for FedAvgM, 0.01 for FedAdam
    # and FedYogi), momentum `beta1` (FedAvgM: m = beta1 m + delta; FedAdam, FedYogi: the EMA
    # m = beta1 m + (1 - beta1) delta), second-moment decay `beta2` and adaptivity `tau` (the
    # second moment starts at tau^2). SCAFFOLD's global step size is `server_lr` too (default 1).
    # Server-side only: devices are never sent them.
    server_lr: Optional[float] = Field(None, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-3, gt=0)

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

    join_ratio: float = Field(0.2, gt=0, le=1)
    local_epochs: int = Field(5, ge=1)
    batch_size: int = Field(20, ge=1)
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    eval_every: int = Field(1, ge=1)
    # evaluation batch: 128 keeps a device's peak memory low (at 2000 the ConvNet's first
    # activation alone is 295 MB on a Jetson Nano's 4 GB) at the same speed on CPU
    eval_batch_size: int = Field(128, ge=1)
    # fedseq-sim: where the model, batches and the dataset's images live ("cuda", "cuda:1", or
    # "auto" = cuda when available). Results differ from CPU runs in the last bits (kernels).
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:[0-9]+)?)$")
    # fedseq-sim's torch threads: a number; default torch's count in the process (in fedseq-sim
    # this machine's physical cores, or OMP_NUM_THREADS: fixed, so a seed gives the same run
    # whatever the load); "auto" = the cores not busy at start (1-minute load average: faster
    # beside other work, but the result then depends on the load). Recorded in the run directory.
    threads: Union[int, str, None] = Field(None)
    # how the run advances (server/asynchronous.py): "sync" rounds, each waiting for its selected
    # clients (or its deadline), or "async": buffered asynchronous aggregation (FedBuff, Nguyen et
    # al. 2022): `concurrency` clients train at once, each arrival is replaced by a newly selected
    # client, and the server steps every `buffer` updates; a server step is a round for
    # everything that counts rounds (FedSeq's schedule, evaluation, checkpoints, rows)
    mode: Literal["sync", "async"] = "sync"
    # async: clients training at once (None: clients_per_round())
    concurrency: Optional[int] = Field(None, ge=1)
    # async: updates folded per server step (None: half the concurrency, rounded up)
    buffer: Optional[int] = Field(None, ge=1)
    # async: an update trained tau server steps ago counts (1 + tau)^-alpha as much (FedBuff's
    # 1/sqrt(1 + tau) at 0.5; 0: staleness ignored)
    staleness_alpha: float = Field(0.5, ge=0)
    # async: an update staler than this many server steps is refused (None: none is)
    max_staleness: Optional[int] = Field(10, ge=0)
    # sync: select over_select x clients_per_round() clients and count the first
    # clients_per_round() updates to arrive (the others are late); 1 = no over-selection
    over_select: float = Field(1.0, ge=1)

    @field_validator("threads")
    @classmethod
    def _threads_count_or_auto(cls, v: Union[int, str, None]) -> Union[int, str, None]:
        if (isinstance(v, int) and v < 1) or (isinstance(v, str) and v != "auto"):
            raise ValueError(f"{v!r} is not a thread count >= 1 or \"auto\"")
        return v


class AggregationConfig(_Section):
    """How validated updates become the new global model (docs/security.md)."""

    rule: Literal["mean", "clipped-mean", "trimmed-mean", "median"] = "mean"
    clip_norm: Optional[float] = Field(None, gt=0, description="clipped-mean: absolute L2 bound")
    clip_factor: float = Field(2.0, gt=0, description="clipped-mean: bound = factor x median norm")
    trim_ratio: float = Field(0.1, gt=0, lt=0.5, description="trimmed-mean: ceil(ratio*n) per end")
    outlier_factor: float = Field(5.0, gt=1, description="log updates with norm > factor x median")
    # reject an update with a larger element; "auto": 10 x the largest parameter magnitude of the
    # global model at that round, at least 1 (measured legitimate maxima: docs/security.md);
    # running statistics have bounds of their own (server/validation.py, STAT_GROWTH, STAT_CAP)
    max_abs_delta: Union[float, Literal["auto"]] = "auto"
    # f: Byzantine devices (logins) a robust rule must withstand; None = 1 for the robust rules
    # (rounds then need 2f+1 reporting devices), 0 for the mean, which withstands none
    byzantine_devices: Optional[int] = Field(None, ge=0)

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
    """MQTT deployment (fedseq-server start); ignored by fedseq-sim."""

    host: str = "127.0.0.1"  # embedded broker bind address
    # embedded broker port (0 = a free one); not 1883, where a system Mosquitto usually listens
    port: int = Field(18830, ge=0, le=65535)
    broker: Optional[str] = None  # mqtt://HOST:PORT of an external broker (Mosquitto); none = embedded
    topic_root: str = Field("fedseq", pattern=r"^[A-Za-z0-9_\-]+$")
    min_devices: int = Field(1, ge=1)
    # how long to wait for min_devices: at the start, and before a step while fewer of the
    # assigned devices are online; a device still missing then is not waited for again until
    # it is back online (one wait per loss)
    wait_devices_s: float = Field(300, gt=0)
    # Round deadline: fixed when set; else factor x the slowest device's recent pace (seconds
    # per client x its clients this round), within [min, max]; max until every device was measured.
    round_timeout_s: Optional[float] = Field(None, gt=0)
    round_timeout_factor: float = Field(3.0, gt=1)
    round_timeout_min_s: float = Field(60, gt=0)
    round_timeout_max_s: float = Field(1800, gt=0)
    finetune_timeout_s: float = Field(3600, gt=0)  # every client fine-tunes: its own deadline
    min_updates: int = Field(1, ge=1)
    eval_timeout_s: float = Field(600, gt=0)
    username: Optional[str] = None  # the coordinator's broker account (Mosquitto with a password file)
    password_file: Optional[Path] = None
    # TLS for an mqtts:// broker: the CA that signed the broker's certificate, optionally this
    # side's certificate and key (mutual TLS). Hostname verification stays on unless disabled.
    ca_file: Optional[Path] = None
    cert_file: Optional[Path] = None
    key_file: Optional[Path] = None
    tls_verify_hostname: bool = True
    # Embedded broker only: an amqtt password file (`fedseq-server passwd`). Bound to anything but
    # loopback it refuses anonymous logins unless allow_anonymous is set.
    broker_password_file: Optional[Path] = None
    allow_anonymous: bool = False
    # Which embedded broker: amqtt in the coordinator, or "mosquitto": Mosquitto started for the run
    # from the checkout's broker.conf and ACL, with a login made for the run that the coordinator
    # and its --local-clients share (devices elsewhere need a Mosquitto of your own: --broker).
    # amqtt drops a message a device does not acknowledge within 5 s (amqtt issue #391), so links
    # on which a model takes longer (a rehearsal's wifi-poor, 3g-fast) need Mosquitto.
    embedded_broker: Literal["amqtt", "mosquitto"] = "amqtt"


class FleetGroup(_Section):
    """Devices of one kind in a simulated fleet: a device profile (server/fleet.py PROFILES),
    how many, and their link (a rehearsal link profile, server/rehearsal.py)."""

    profile: str
    count: int = Field(1, ge=1)
    link: str = "wifi-good"


class FleetConfig(_Section):
    """[fleet]: fedseq-sim's model of time (server/fleet.py). Empty (default): no virtual clock.
    Given devices, clients are dealt to them as a deployment deals them (devices by name,
    round-robin), and every row carries the round's simulated seconds and modelled joules."""

    devices: List[FleetGroup] = Field(default_factory=list)
    # the spread of a device's pace from one client-round to the next: its time is multiplied by
    # exp(jitter x N(0, 1)), drawn from the run's training seed
    jitter: float = Field(0.1, ge=0, le=2)

    def __bool__(self) -> bool:
        return bool(self.devices)


class WireConfig(_Section):
    """[wire]: the codecs of what crosses the wire (common/codecs.py): `up` for the clients'
    updates, `down` for the global blocks sent to them (the coordinator keeps its float32
    master). Applied in every transport alike: a simulation trains on what a device would."""

    up: Literal["none", "fp16", "bf16", "int8", "topk"] = "none"
    down: Literal["none", "fp16", "bf16", "int8"] = "none"
    topk: float = Field(0.01, gt=0, le=1)  # up = "topk": the fraction of each tensor's entries
    int8_scale: Literal["channel", "tensor"] = "channel"  # a scale per output channel or tensor
    # up = "int8": round to nearest, or stochastically from the run's seeded streams (unbiased)
    int8_rounding: Literal["nearest", "stochastic"] = "nearest"

    def codec(self, direction: Literal["up", "down"]) -> Any:
        """That direction's common.codecs.Codec."""
        from fedseq.common.codecs import Codec  # torch: read when a run starts, not before

        name = self.up if direction == "up" else self.down
        return Codec(name, topk=self.topk, per_channel=self.int8_scale == "channel",
                     stochastic=direction == "up" and self.int8_rounding == "stochastic")


class SeedsConfig(_Section):
    """[seeds]: pin one random stream to its own seed; a stream left unset follows `seed`.
    `fedseq-sim --seeds 0,1,2 --vary init` uses this to vary some streams and fix the others."""

    data: Optional[int] = None  # the partition, each client's train/test split, data.fraction's subset
    init: Optional[int] = None  # the initial model weights
    selection: Optional[int] = None  # which clients join each round
    training: Optional[int] = None  # batch order, augmentation, fine-tuning batches


class ExperimentConfig(_Section):
    """One experiment: everything a run (simulated or deployed) is a function of, with the seed."""

    seed: int = 0
    rounds: int = Field(100, ge=1)
    data: DataConfig = Field(default_factory=lambda: DataConfig())
    model: ModelConfig = Field(default_factory=lambda: ModelConfig())
    algorithm: AlgorithmConfig = Field(default_factory=lambda: AlgorithmConfig())
    train: TrainConfig = Field(default_factory=lambda: TrainConfig())
    aggregation: AggregationConfig = Field(default_factory=lambda: AggregationConfig())
    deploy: DeployConfig = Field(default_factory=lambda: DeployConfig())
    seeds: SeedsConfig = Field(default_factory=lambda: SeedsConfig())
    wire: WireConfig = Field(default_factory=lambda: WireConfig())
    fleet: FleetConfig = Field(default_factory=lambda: FleetConfig())

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
    def _check_schedule(self) -> ExperimentConfig:
        # A t_k >= rounds is allowed: that block stays frozen until fine-tuning (the FedSeq paper's
        # T=100 rows use t = 0/100/200).
        t = self.algorithm.unfreeze_rounds
        if t and (t != sorted(t) or t[0] < 0):
            raise ValueError(f"algorithm.unfreeze_rounds {t} must be ascending rounds >= 0")
        return self

    def for_devices(self) -> dict[str, Any]:
        """The config as the run broadcasts it: without the coordinator's own paths and broker
        account (its data root, password and key files, TLS files, user name), which devices
        neither need nor should learn."""
        data = self.model_dump(mode="json")
        for key in ("username", "password_file", "ca_file", "cert_file", "key_file",
                    "broker_password_file", "broker", "host", "embedded_broker"):
            data["deploy"].pop(key, None)
        data["data"].pop("root", None)
        if not any(v is not None for v in data["seeds"].values()):
            data.pop("seeds")  # nothing pinned: the config as devices before [seeds] read it
        for key in SERVER_ONLY:  # the server optimizer's; devices before it never read them
            data["algorithm"].pop(key, None)
        data.pop("fleet")  # the simulation's model of time: a device never reads it
        for key in ASYNC_ONLY:  # the coordinator's driver; devices before it never read them
            data["train"].pop(key, None)
        if data["wire"] == WireConfig().model_dump(mode="json"):
            data.pop("wire")  # as devices before [wire] read it
        if data["model"]["head_init"] == "default":
            data["model"].pop("head_init")  # as devices before model.head_init read it
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


def _format_validation(exc: ValidationError, source: str) -> str:
    p = validation_problem(exc)
    msg = p.msg
    if p.kind == "extra_forbidden":
        msg = "unknown key (check the spelling; see examples/*.toml for valid keys)"
    return f"{p.where or 'config'}: {msg}; fix it in {source}{p.more}"


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a TOML file (optional), apply --set overrides, validate. Raises ConfigError."""
    raw: dict[str, Any] = {}
    source = "the command line"
    if path is not None:
        source = str(path)
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} not found; pass an existing --config FILE") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML ({exc}); fix the file") from exc
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
