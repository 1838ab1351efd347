"""A run's records as typed values: a round's row (`RoundRecord`) and the parts it is made of.

The round loop fills a RoundRecord; the run directory writes it to metrics.jsonl as one JSON line
(`to_json`); the report, the trackers and the CLIs read it back (`from_json`) and use its
attributes. A misspelt field is an error (mypy, and pydantic at run time), never a silent None.

The JSON keys are stable, so that every run directory reads: a row from an older fedseq lacks
some keys (they read as the fields' defaults) and may hold keys this version does not know (kept
in `unknown` and written back as they were). A row holds the keys of the fields its round set
(each whole: a device's energy has all its keys), no others: a simulation's rows have no
deployment fields, a fine-tuning row no training ones. `v` says which version of this schema
wrote a row: 1 (no `v` key) before this module, 2 since (`client_steps` added).

Nothing here imports torch: `fedseq report` reads run directories without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedseq.common.errors import ConfigError

if TYPE_CHECKING:
    from fedseq.common.algorithms.aggregate import DeviceCost

#: the schema version this fedseq writes (see the module's docstring)
VERSION = 2

#: Why an update was refused, as a closed set of codes (RoundRecord.refusals), the particulars in
#: words beside it (RoundRecord.rejected): server/rounds/contract.py's round contract gives both.
Refusal = Literal[
    "wrong-round",  # the update is for another round
    "not-selected",  # its client is not selected this round
    "wrong-samples",  # its sample counts are not what the coordinator knows of the client
    "diverged",  # its training hit a NaN or Inf loss
    "wrong-score",  # its local score does not fit the client's test rows
    "wrong-tensors",  # tensors missing, or not uploadable this round
    "wrong-shape",  # a tensor of another dtype or shape than the model's
    "non-finite",  # a tensor holds NaN or Inf
    "too-large",  # an element beyond the round's bound (aggregation.max_abs_delta)
    "bad-statistic",  # a running statistic out of its bounds
    "bad-encoding",  # a compressed tensor that cannot be decoded safely (wire.up)
    "too-stale",  # trained on a model more than train.max_staleness server steps old (async)
    "bad-version",  # names a model version it cannot have trained on (async, on a fleet)
    "over-clip",  # an L2 norm above privacy.clip_norm: not clipped on its device
    "at-site",  # refused by its site's edge aggregator ([hierarchy]; the particulars say why)
]


@dataclass(frozen=True)
class Rejection:
    """A refused update: the code, and the particulars for a person (its str)."""

    code: Refusal
    text: str

    def __str__(self) -> str:
        return self.text


#: numeric RoundRecord fields that the trackers and the report show under names of their own
#: (accuracies, bytes, FLOPs, time, energy). Every other numeric field is picked up by its name:
#: the trackers log it as metrics/<field> (track.py) and the report summarizes it over a run's
#: rows as its field says (`summary`: "sum", the default, "mean" or "max"), so a new metric is
#: one field here, set where it is measured.
OWN_NAMES = frozenset({"v", "round", "global_acc", "federated_acc", "personal_acc", "local_acc",
                       "round_local_acc", "bytes_down", "bytes_up", "train_flops", "seconds",
                       "energy_j"})


def summary(kind: Literal["sum", "mean", "max"]) -> dict[str, Any]:
    """A field's `json_schema_extra`: how the report summarizes it over a run's rows."""
    return {"summary": kind}


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _args(annotation: Any) -> tuple[Any, ...]:
    """The types a field's annotation allows: (int,) for int, (float, NoneType) for
    float | None; () for anything else (lists, dicts, records, literals)."""
    if annotation in (int, float):
        return (annotation,)
    if get_origin(annotation) not in (Union, UnionType):
        return ()
    args = get_args(annotation)
    return args if all(a in (int, float, type(None)) for a in args) else ()


class SlowestDevice(_Record):
    """The device that finished a deployment round last, and the seconds the round waited for it
    after the next slowest had finished."""

    device: str
    waited_s: float


class DeviceEnergy(_Record):
    """One device's share of a round's energy, as it measured it: joules, mean watts, power
    source, hottest temperature, throttling, GPU load and free memory (None: not measured)."""

    j: float | None = None
    source: str | None = None
    max_temp_c: float | None = None
    throttled: bool | None = None
    gpu_load: float | None = None
    mem_available_mb: int | None = None
    w: float | None = None


class ClientEnergy(_Record):
    """Joules per client, as its device measured them; the clients without a figure apart."""

    clients: dict[int, float] = Field(default_factory=dict)
    unmeasured: list[int] = Field(default_factory=list)


class RoundEnergy(ClientEnergy):
    """A training round's joules per client, and per device its joules and health (a
    fine-tuning row has no devices part)."""

    devices: dict[str, DeviceEnergy]


class Fold(_Record):
    """One update that arrived during an asynchronous server step, in arrival order: its client,
    the model version (server step) it trained on, its staleness (steps since then) and the
    weight that gave it, or why it was refused (then it was not folded in). The order is what
    `fedseq-sim --replay` re-executes."""

    client: int
    version: int
    staleness: int
    discount: float | None = None
    refused: Refusal | None = None


class RoundRecord(_Record):
    """One line of metrics.jsonl: a training round (`phase` "train") or the final fine-tuning
    ("finetune", `round` = the number of rounds). Accuracies are fractions (correct over total,
    pooled over clients); None where the round did not evaluate."""

    v: int = VERSION
    round: int
    phase: Literal["train", "finetune"]
    #: the global model on every client's test rows (data.placement = "device": on
    #: data.validation, None without one)
    global_acc: float | None = None
    #: data.placement = "device": the global model on the clients' own test rows, scored where
    #: they are (the devices) and pooled; rows of a shared placement have none (the report: F)
    federated_acc: float | None = None
    #: every client's personalized model on its own test rows
    personal_acc: float | None = None
    #: FedReG's testbed accuracy: every client's most recent locally trained model
    local_acc: float | None = None
    #: the same, of this round's trainers' fresh local models only (None: the round failed)
    round_local_acc: float | None = None
    #: the selected clients (fine-tuning: every client scored)
    clients: list[int] = Field(default_factory=list)
    #: clients whose update counted, in the order they were folded in
    reported: list[int] = Field(default_factory=list)
    status: Literal["ok", "failed"] | None = None
    #: selected clients whose update did not count
    failed: list[int] = Field(default_factory=list)
    #: client -> why its update was refused (every refusal, also of a client that then counted)
    rejected: dict[int, str] = Field(default_factory=dict)
    #: client -> the code of that refusal (`Refusal`); rows written before the codes have none
    refusals: dict[int, Refusal] = Field(default_factory=dict)
    #: clients whose update norm was above aggregation.outlier_factor x the round's median
    outliers: list[int] = Field(default_factory=list)
    #: frame bytes of the blocks sent to the selected clients / received in counted updates
    bytes_down: int = 0
    bytes_up: int = 0
    trainable_params: int = Field(0, json_schema_extra=summary("max"))
    uploaded_blocks: list[str] = Field(default_factory=list)
    #: measured training FLOPs of the clients whose update arrived (the fine-tuning's, there)
    train_flops: int = 0
    #: local optimizer steps (batches x objectives) those clients ran; None in rows before v2
    client_steps: int | None = None
    seconds: float | None = None
    #: why the global model keeps an untrained head or base (FedBABU, FedSeq, FedPer, ...)
    global_model: str | None = None
    # -- a transport with deadlines (deployment) --
    deadline_s: float | None = Field(None, json_schema_extra=summary("mean"))
    #: client -> the device that sent its counted update
    reporters: dict[int, str] = Field(default_factory=dict)
    #: device -> the reason it gave for not training
    device_failures: dict[str, str] = Field(default_factory=dict)
    late_updates: int = 0
    missed_deadline: list[str] = Field(default_factory=list)
    slowest_device: SlowestDevice | None = None
    #: joules the devices measured (None where none did: never 0), and their breakdown
    energy_j: float | None = None
    energy: RoundEnergy | ClientEnergy | None = None
    #: client -> [seconds its device said training took, the FLOPs counted for it]: a fleet's
    #: measured pace (`fedseq fleet RUN_DIR` makes profiles of it)
    paces: dict[int, tuple[float, int]] = Field(default_factory=dict)
    #: payload bytes on the coordinator's connection during the round's steps
    wire_bytes_out: int | None = None
    wire_bytes_in: int | None = None
    # -- simulated time ([fleet]) --
    #: the round's (an asynchronous step's) seconds on the simulated fleet
    virtual_s: float | None = None
    #: the virtual clock at the round's end: seconds since the run's start
    virtual_time_s: float | None = Field(None, json_schema_extra=summary("max"))
    #: the fleet's modelled joules during the round (server/rounds/virtual_fleet.py)
    modelled_energy_j: float | None = None
    #: over-selected clients that were not among the first to arrive (not trained)
    cancelled: list[int] = Field(default_factory=list)
    # -- edge sites ([hierarchy]) --
    #: messages and frame bytes that reached the coordinator in the round: one partial a site
    #: with edge aggregation, else every counted update (simulated; server/rounds/sites.py)
    upstream_messages: int | None = None
    upstream_bytes: int | None = None
    # -- an asynchronous server step (train.mode = "async") --
    #: every update that arrived, in order, folded in or refused (`reported`: the folded ones)
    folds: list[Fold] = Field(default_factory=list)
    #: the stalest update folded in
    max_staleness: int | None = Field(None, json_schema_extra=summary("max"))
    # -- differential privacy ([privacy]) --
    #: epsilon spent after this round (at privacy.delta); the fine-tuning's row: the run's
    epsilon: float | None = Field(None, json_schema_extra=summary("max"))
    #: the round's clip norm under adaptive clipping (privacy.adaptive)
    clip_norm: float | None = None
    #: why the federated rounds end with this one, before `rounds` (privacy.target_epsilon)
    stopped: str | None = None
    # -- secure aggregation ([secagg]) --
    #: clients that dropped after sharing their keys, whose masks the coordinator removed with
    #: their neighbours' shares
    secure_recovered: list[int] | None = None
    #: clients left out of every later round from this one on, with why: a device of theirs
    #: sent secure-aggregation shares proven bad
    excluded: dict[int, str] | None = None
    # -- a round that did not count --
    quorum_failed: str | None = None
    received: list[int] = Field(default_factory=list)
    # -- fine-tuning --
    finetune_epochs: int | None = Field(None, json_schema_extra=summary("max"))
    #: client -> the batch where its fine-tuning hit a NaN or Inf loss
    diverged: dict[int, int] = Field(default_factory=dict)
    #: keys of an older or newer fedseq that this version does not know, kept as they were
    unknown: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @classmethod
    def picked_up(cls) -> dict[str, str]:
        """The numeric fields without names of their own (`OWN_NAMES`), each with how the
        report summarizes it over a run's rows (sum, mean or max)."""
        out = {}
        for name, f in cls.model_fields.items():
            if name in OWN_NAMES or not _args(f.annotation):
                continue
            extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
            out[name] = str(extra.get("summary", "sum"))
        return out

    def set_virtual(self, seconds: float, clock: float, joules: float) -> None:
        """The round's span on the simulated fleet, the clock at its end and the joules spent."""
        self.virtual_s = round(seconds, 3)
        self.virtual_time_s = round(clock, 3)
        self.modelled_energy_j = round(joules, 3)

    def refusal_codes(self) -> dict[int, str]:
        """client -> the code of its refusal; a row written before the codes has them read from
        the reasons' words (only "diverged" could be told apart there)."""
        if self.refusals or not self.rejected:
            return dict(self.refusals)
        return {c: "diverged" if why.startswith("training diverged") else "unknown"
                for c, why in self.rejected.items()}

    def accuracies(self) -> dict[str, float | None]:
        """The row's accuracies by their short names in tables and figures."""
        return {"G": self.global_acc, "F": self.federated_acc, "P": self.personal_acc,
                "L": self.local_acc, "Lr": self.round_local_acc}

    def set_paces(self, paces: dict[int, tuple[float, int]]) -> None:
        """A deployment's counted clients' training seconds (as their devices said) and FLOPs."""
        self.paces = {c: (round(s, 4), f) for c, (s, f) in sorted(paces.items())}

    def set_device_energy(self, costs: dict[int, tuple[str | None, DeviceCost | None]]) -> None:
        """A deployment round's energy and device health as the devices measured them
        (informational): `energy_j` over the updates that carried a figure (None if none did),
        per client, and per device its joules, mean watts, power source, hottest temperature,
        throttling, GPU load and free memory."""
        report = RoundEnergy(devices={})
        seconds: dict[str, float] = {}
        for c, (device, cost) in sorted(costs.items()):
            j = cost.energy_j if cost is not None else None
            if j is None:
                report.unmeasured.append(c)
            else:
                report.clients[c] = j
            if device is None:
                continue
            d = report.devices.setdefault(device, DeviceEnergy())
            seconds.setdefault(device, 0.0)
            if cost is None:
                continue
            if j is not None:
                d.j = (d.j or 0.0) + j
                if cost.energy_w:
                    seconds[device] += j / cost.energy_w
            d.source = cost.energy_source or d.source
            if cost.max_temp_c is not None:
                d.max_temp_c = cost.max_temp_c if d.max_temp_c is None else max(d.max_temp_c,
                                                                                 cost.max_temp_c)
            if cost.gpu_load is not None:
                d.gpu_load = cost.gpu_load if d.gpu_load is None else max(d.gpu_load, cost.gpu_load)
            if cost.mem_available_mb is not None:
                d.mem_available_mb = (cost.mem_available_mb if d.mem_available_mb is None
                                      else min(d.mem_available_mb, cost.mem_available_mb))
            if cost.throttled is not None:
                d.throttled = bool(d.throttled) or cost.throttled
        for device, d in report.devices.items():
            d.w = round(d.j / seconds[device], 3) if d.j is not None and seconds[device] else None
            if d.j is not None:
                d.j = round(d.j, 3)
        self.set_energy(report)

    def set_energy(self, report: ClientEnergy) -> None:
        """The joules the devices measured: `energy_j` their total (None if none did: never 0)."""
        self.energy_j = round(sum(report.clients.values()), 3) if report.clients else None
        self.energy = report

    def to_json(self) -> dict[str, Any]:
        """The metrics.jsonl form: the fields this round set (and `v`), plus any kept unknown keys."""
        return {"v": self.v, **self.model_dump(mode="json", include=self.model_fields_set),
                **self.unknown}

    @classmethod
    def from_json(cls, row: Any) -> RoundRecord:
        """A metrics.jsonl row of any fedseq version; a row that is not one is a ConfigError."""
        if not isinstance(row, dict):
            raise ConfigError(f"a metrics row is a JSON object, not {type(row).__name__}")
        known = {k: v for k, v in row.items() if k in cls.model_fields and k != "unknown"}
        try:
            rec = cls.model_validate({"v": 1, **known})
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ConfigError(f"a metrics row's {where!r}: {err['msg']}") from exc
        rec.unknown = {k: v for k, v in row.items() if k not in known}
        rec.__pydantic_fields_set__.discard("unknown")
        return rec
