"""Wire messages: pydantic models with a protocol version; invalid input is a ProtocolError.

JSON messages carry control; tensor frames (frames.py) carry a JSON header plus raw bytes.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from typing_extensions import Annotated

from fedseq.common.errors import ProtocolError, validation_problem

# 2: Step.personal added; the never-used DeviceStatus.slots, UpdateHeader.train_flops and the
# "stop" step kind removed; Control(abort) is sent when a run ends abnormally.
# 4: UpdateHeader.diverged_at and EvalResult.diverged (a NaN or Inf loss stops training).
# 5: updates on one topic per device (fedseq/update/<device>; client and chunk in the header), so
# a device login can leave at most one retained message there (the ACL grants no deeper level).
# 6: the "async" step kind (train.mode = "async"): Step.dispatched; an update's seq is then the
# step that dispatched its client, its round the model version it trained on.
# 7: a plan names its algorithm and carries that algorithm's parameters (`algorithm`, `params`)
# in place of a field per algorithm (prox_mu, control_variates, dyn_alpha, personal_epochs, ...)
# 8: secure aggregation over MQTT ([secagg]): Step.secagg (the round's setup), SecAggMessage on
# fedseq/secagg/<device> (up) and fedseq/device/<device>/secagg (down)
# 9: a secure round's setup names its ring (`ring_bits`: 32, or 16 under wire.up = "int8")
PROTOCOL_VERSION = 9
#: seconds between an online device's status messages (its heartbeat)
HEARTBEAT_S = 15.0


def version_mismatch(payload: bytes) -> tuple[int, str | None] | None:
    """(the other side's protocol version, its run id) when `payload` is JSON of another protocol
    version; None otherwise. Lets either side say *why* it cannot read the other."""
    raw = _json_object(payload)
    if raw is not None and isinstance(raw.get("v"), int) and raw["v"] != PROTOCOL_VERSION:
        run_id = raw.get("run_id")
        return raw["v"], run_id if isinstance(run_id, str) else None
    return None


def run_id_of(payload: bytes) -> str | None:
    """The run id a JSON message names (read loosely: the message may be invalid), or None."""
    raw = _json_object(payload)
    run_id = raw.get("run_id") if raw is not None else None
    return run_id if isinstance(run_id, str) else None


def _json_object(payload: bytes) -> dict | None:
    """`payload` as a JSON object, or None (not JSON, not an object, or longer than any run
    config or step: not worth parsing again)."""
    import json

    if len(payload) > 1 << 20:
        return None
    try:
        raw = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested junk
        return None
    return raw if isinstance(raw, dict) else None


class PeerVersion(ProtocolError):
    """A message of another protocol version (`version`): its sender runs another fedseq. Told
    from the one validation of the message, so a refused message is never parsed again."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


#: the largest magnitude of an integer on the wire (2**53: exact as a float64 and a torch int64),
#: so that nothing allocates, counts or overflows by one; fields bound theirs further
WIRE_INT = 1 << 53
#: the most rows one client can announce (a part of data.placement = "device" larger than this
#: is no device's)
MAX_ROWS = 1_000_000_000
#: the validation context of a message parsed from the wire (Message.decode)
WIRE: Dict[str, bool] = {"wire": True}


def _beyond(value: Any) -> Optional[str]:
    """What in `value` (a field's parsed value, nested in lists, dicts and models) is an
    integer beyond WIRE_INT or a float that is not finite, or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        if isinstance(v, int):
            if abs(v) > WIRE_INT:
                return f"an integer beyond 2**53 ({str(v)[:30]})"
        elif isinstance(v, float):
            if not math.isfinite(v):
                return f"a number that is not finite ({v})"
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, BaseModel):
            stack.extend(getattr(v, f) for f in type(v).model_fields)
    return None


class Message(BaseModel):
    """Base of every JSON message: unknown fields are refused, and `v` must be this side's
    protocol version (a peer of another version is rejected loudly, see version_mismatch).
    Every number is bounded: no float that is not finite and no integer beyond 2**53, anywhere
    in it (a field of a free-form type included)."""

    model_config = ConfigDict(extra="forbid")
    v: Literal[9] = 9  # PROTOCOL_VERSION
    #: fields added while this protocol was current: left out at their default, so that a peer
    #: of the same protocol from before them (which refuses unknown fields) still reads the
    #: message; a field added with a protocol bump needs no entry
    since_current: ClassVar[Tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _numbers_bounded(self, info: ValidationInfo):
        if info.context is not WIRE:  # (built here: pydantic writes a NaN as null)
            return self
        for name in type(self).model_fields:
            why = _beyond(getattr(self, name))
            if why is not None:
                raise ValueError(f"{name} holds {why}")
        return self

    def encode(self) -> bytes:
        """The message as compact JSON bytes."""
        fields = type(self).model_fields
        left = {f for f in self.since_current
                if getattr(self, f) == fields[f].get_default(call_default_factory=True)}
        return self.model_dump_json(exclude=left or None).encode()

    @classmethod
    def decode(cls, payload: bytes):
        """Parse and validate; anything invalid is a one-line ProtocolError."""
        try:
            return cls.model_validate_json(payload, context=WIRE)
        except ValidationError as exc:
            p = validation_problem(exc)
            why = f"invalid {cls.__name__}: {p.where or 'message'}: {p.msg}"
            other = next((e.get("input") for e in exc.errors() if tuple(e["loc"]) == ("v",)), None)
            if isinstance(other, int) and not isinstance(other, bool):
                raise PeerVersion(why, other) from exc
            raise ProtocolError(why) from exc


class ServerStatus(Message):
    """The coordinator's presence (retained; its last will says offline)."""

    state: Literal["online", "offline"]
    run_id: Optional[str] = Field(None, description="The run the coordinator drives, if any.")
    broker: Optional[str] = Field(None, description="The broker URL the coordinator connected to.")


class ClientSizes(BaseModel):
    """data.placement = "device": one client a device holds, as it announces it."""

    model_config = ConfigDict(extra="forbid")

    folder: str = Field(max_length=64, description=(
        "Its folder in the device's data folder (\".\": the data folder is one client)."))
    train: int = Field(ge=0, le=MAX_ROWS, description=(
        "Its training rows (at most data.max_rows_per_client)."))
    test: int = Field(ge=0, le=MAX_ROWS, description=(
        "Its test rows (at most data.max_rows_per_client)."))
    counts: List[Annotated[int, Field(ge=0, le=MAX_ROWS)]] = Field(
        max_length=100_000, description="Its training rows per class.")


class DataReport(Message):
    """data.placement = "device": the clients a device holds for a run (in its status)."""

    run_id: str = Field(max_length=100)
    clients: List[ClientSizes] = Field(max_length=10_000)


class DeviceStatus(Message):
    """A device's presence and health (retained; its last will says offline)."""

    since_current = ("data",)

    device: str = Field(description="The device's name (its broker login).")
    state: Literal["online", "offline"]
    package_version: str = Field("", max_length=100, description="The device's fedseq version.")
    torch_device: str = Field("cpu", max_length=100, description="Where it trains (cpu, cuda:0).")
    memory_mb: int = Field(0, description="Its total memory.")
    # (the coordinator fails the device's clients in the step named by error_seq at once)
    error: str = Field("", max_length=2000, description=(
        "The last step this device could not execute, and why (missing data, out of memory, CUDA "
        "error, ...)."))
    error_seq: Optional[int] = Field(None, description="That step's seq.")
    error_run_id: Optional[str] = Field(None, description="That step's run.")
    since: float = Field(0.0, ge=0, le=1e11, description=(
        "Unix time this state began (online: when the daemon connected)."))
    # (a device that died while the broker was down leaves "online" retained forever)
    heartbeat_s: float = Field(HEARTBEAT_S, gt=0, le=4 * HEARTBEAT_S, description=(
        "An online device re-publishes its status this often: the coordinator treats one it has "
        "not heard from for 3 heartbeats as gone, whatever its retained status says."))
    # Health, refreshed with every heartbeat (informational; None where the device cannot tell)
    temp_c: Optional[float] = Field(None, description="The hottest thermal zone.")
    throttled: Optional[bool] = Field(None, description="A zone past a passive trip point.")
    gpu_load: Optional[float] = Field(None, description="The Jetson GPU's load (0-1).")
    mem_available_mb: Optional[int] = Field(None, description="Available memory.")
    energy_source: Optional[str] = Field(None, max_length=200, description=(
        "The power source its energy figures come from, or why there is none."))
    last_round_j: Optional[float] = Field(None, description="The energy of its last client-round.")
    data: Optional[DataReport] = Field(None, description=(
        "data.placement = \"device\": the run's clients in this device's data folder, which the "
        "coordinator numbers (devices by name, then folders) and assigns back."))


class DeviceInfo(Message):
    """What a device trains with (retained, published on every connect): what bitwise
    reproducibility depends on besides the config and the seed (docs/explanation/reproducibility.md). The
    coordinator records it in the run directory (devices.json). Informational: a device whose
    broker account may not write this topic (an ACL from before it existed) still trains."""

    device: str = Field(description="The device's name (its broker login).")
    package_version: str = Field("", max_length=100, description="Its fedseq version.")
    python: str = Field("", max_length=100, description="Its Python version.")
    torch: str = Field("", max_length=100, description="Its torch version.")
    cuda: str = Field("", max_length=100, description="The CUDA torch was built for (\"\": a CPU build).")
    torch_device: str = Field("cpu", max_length=100, description="Where it trains (cpu, cuda:0).")
    gpu: str = Field("", max_length=200, description="The GPU's name when it trains on one.")
    threads: int = Field(0, ge=0, description="torch's CPU threads.")
    machine: str = Field("", max_length=100, description="aarch64, x86_64.")
    cpu: str = Field("", max_length=200, description="The CPU's model (x86) or the board's (Jetson).")
    cpu_kernels: str = Field("", max_length=200, description=(
        "torch's CPU kernel level and the features deciding it (\"\": an older device)."))
    l4t: str = Field("", max_length=100, description="A Jetson's L4T release (JetPack generation).")


class RunConfig(Message):
    """The run's whole experiment config (retained): devices derive the partition, the model
    and the seeds from it."""

    since_current: ClassVar[Tuple[str, ...]] = ("plugins",)

    run_id: str
    config: Dict[str, Any] = Field(description=(
        "The experiment's config as the coordinator resolved it, less its own paths and accounts; "
        "validated again on receipt."))
    plugins: Dict[str, str] = Field(default_factory=dict, description=(
        "\"group/name\" -> \"distribution==version\" of every plugin the run uses, as the "
        "coordinator has it installed: a device with another version refuses the run, saying so."))


class Assignment(Message):
    """The logical clients a device hosts in this run (retained, one topic per device)."""

    since_current = ("folders",)

    run_id: str
    device: str
    clients: List[int] = Field(description="The logical clients this device hosts in the run.")
    folders: List[str] = Field(default_factory=list, description=(
        "data.placement = \"device\": each client's folder in the device's data folder (as "
        "its status announced them), in the order of `clients`."))


class Step(Message):
    """The coordinator's current step, retained so a reconnecting device resumes from it.

    train: each of `clients` trains once on the model of round `round`; a newer step supersedes
    it (the device stops between clients). async (train.mode = "async"): `clients` are the
    clients in flight, `dispatched` the step that dispatched each; a device trains each of its
    own once per dispatch, one after another, on the newest model it holds (`round`, `plan`,
    `versions` of the newest async step), and answers with that dispatch's seq: a newer async
    step does not supersede the dispatches it still lists."""

    run_id: str
    seq: int = Field(ge=0, description="Strictly increasing within a run.")
    kind: Literal["train", "async", "evaluate", "finetune", "idle"]
    round: int = Field(-1, description="The round, or the model version an async step carries.")
    clients: List[int] = Field(default_factory=list, description="The clients of the step.")
    dispatched: List[int] = Field(default_factory=list, description=(
        "async: the seq each client's answer names."))
    plan: Optional[Dict[str, Any]] = Field(None, description=(
        "train, finetune: what each client does (blocks trained, uploaded, epochs; a ClientPlan)."))
    versions: Dict[str, int] = Field(default_factory=dict, description=(
        "Block -> the version of its weights the step needs."))
    eval_heads: List[str] = Field(default_factory=list, description="The heads an evaluation scores.")
    personal: List[str] = Field(default_factory=list, description=(
        "The algorithm's personal blocks: what a client's stored state overrides (evaluate, finetune)."))
    secagg: Optional[Dict[str, Any]] = Field(None, description=(
        "train under [secagg]: the round's secure-aggregation setup (common/secagg.py "
        "setup_to_dict): who masks with whom, the threshold, the masked vector's layout and "
        "fixed-point scale; the clients then answer its stages on `fedseq/secagg/<device>`."))


class EvalResult(Message):
    """A device's clients' test scores for an evaluate or finetune step."""

    since_current = ("global_score",)

    run_id: str
    seq: int
    device: str
    results: Dict[int, Tuple[int, int]] = Field(description="Client -> (correct, total).")
    final: bool = Field(True, description="False: progress during fine-tuning (the clients done so far).")
    energy_j: Optional[Dict[int, float]] = Field(None, description=(
        "Fine-tuning: the joules each client's fine-tuning took on the device (informational; "
        "left out where the device has no power sensor)."))
    diverged: Optional[Dict[int, int]] = Field(None, description=(
        "Fine-tuning: clients whose loss went NaN or Inf -> the batch (from 1) where it stopped; "
        "their scores are their diverged models'."))
    global_score: Optional[Tuple[int, int]] = Field(None, description=(
        "data.placement = \"device\", evaluate: the global model on these clients' test rows "
        "together, (correct, total)."))


class Control(Message):
    """abort: sent by the coordinator when a run ends abnormally (an error, Ctrl-C, SIGTERM):
    devices abandon the run's current step at once instead of finishing work nobody collects.

    resend: step `seq` still owes answers of `clients` and nothing has arrived for a while (a
    broker drops QoS 1 messages beyond a client's queue, silently: a burst of a large fleet's
    updates can overflow the coordinator's): a device that has already sent answers of that step
    for any of them publishes those again (its evaluation, if it names one of its clients); one
    still working, or without them, does nothing. A device of fedseq before this command logs the
    message as invalid and carries on."""

    run_id: Optional[str] = None
    command: Literal["abort", "resend"]
    reason: str = Field("", description="abort: why the run ended.")
    seq: Optional[int] = Field(None, description="resend: the step.")
    clients: List[int] = Field(default_factory=list, max_length=100_000, description=(
        "resend: whose answers."))


class SecAggMessage(Message):
    """One stage of a secure round (common/secagg.py) for one device's clients. Up (a device on
    `fedseq/secagg/<device>`): keys (client -> its two public keys), shares (client -> receiver
    -> an encrypted share), unmask (client -> neighbour -> ["b" or "s", a share]). Down (the
    coordinator on `fedseq/device/<device>/secagg`): keys (client -> neighbour -> its keys),
    shares (client -> sender -> the share addressed to it), unmask (client -> [survivors,
    dropped]). Bytes travel base64-encoded; every item is validated by the stage that takes it."""

    run_id: str
    seq: int = Field(ge=0, description="The train step of the secure round.")
    stage: Literal["keys", "shares", "unmask"]
    device: str = Field(max_length=64, description="The device whose clients the items are.")
    items: Dict[int, Any] = Field(description="Client -> that client's part of the stage.")


class WeightsHeader(Message):
    """Header of one chunk of a block's weights frame (retained, versioned)."""

    run_id: str
    block: str
    version: int = Field(ge=0, description="The block's version (the round that last changed it).")
    chunk: int = Field(ge=0, description="This chunk's index.")
    chunks: int = Field(ge=1, description="The frame's chunks.")
    size: int = Field(ge=0, description="Bytes of the whole frame.")
    sha256: str = Field(description="The whole frame's SHA-256 (hex).")


class UpdateHeader(Message):
    """Header of one chunk of a client's update frame (its deltas) with its sample counts."""

    run_id: str
    seq: int = Field(description="The step that asked for it (async: that dispatched the client).")
    round: int = Field(description="The round (async: the model version it trained on).")
    client: int
    device: str
    num_samples: int = Field(description="The client's training rows.")
    effective_samples: Optional[int] = Field(None, description=(
        "FedReG: the original rows in the client's rebalanced set."))
    train_seconds: float = Field(0.0, description="Local computation: training and the local score.")
    local_correct: Optional[int] = Field(None, description=(
        "The trained model's correct answers on the client's test rows."))
    local_total: Optional[int] = Field(None, description="The client's test rows.")
    # What the client-round cost on the device (informational: recorded, never aggregated, and
    # sanitised by the coordinator)
    energy_j: Optional[float] = Field(None, description="Joules of the client-round.")
    energy_w: Optional[float] = Field(None, description="Mean watts over it.")
    energy_rails: Optional[Dict[str, float]] = Field(None, max_length=16,
                                                     description="Joules per power rail.")
    energy_source: Optional[str] = Field(None, max_length=40, description="The power sensor read.")
    max_temp_c: Optional[float] = Field(None, description="The hottest temperature during it.")
    throttled: Optional[bool] = Field(None, description="Whether a zone passed a trip point during it.")
    gpu_load: Optional[float] = Field(None, description="GPU load after it (0-1).")
    mem_available_mb: Optional[int] = Field(None, description="Free memory after it.")
    diverged_at: Optional[int] = Field(None, ge=1, description=(
        "The batch (from 1) where training hit a NaN or Inf loss and stopped; the update is refused."))
    under_clip: Optional[bool] = Field(None, description=(
        "[privacy]: whether the update's norm was within the clip norm before it was clipped."))
    chunk: int = Field(ge=0, description="This chunk's index.")
    chunks: int = Field(ge=1, description="The frame's chunks.")
    size: int = Field(ge=0, description="Bytes of the whole frame.")
    sha256: str = Field(description="The whole frame's SHA-256 (hex).")

    # The one conversion each way between a client's update and this header: the device says
    # its ClientUpdate and DeviceCost with `fields_of`; the coordinator reads them back with
    # `to_update` (the cost as it accepted it: only plausible figures, server/pools/mqtt/inbox.py)
    @staticmethod
    def fields_of(update: Any, cost: Any = None) -> Dict[str, Any]:
        """The header fields that say `update` (a ClientUpdate) and its `cost` (a DeviceCost, or
        None); the frame's run, step, device and chunk fields are the sender's."""
        import dataclasses

        score = update.local_score
        return dict(round=update.round, client=update.client, num_samples=update.num_samples,
                    effective_samples=update.effective_samples,
                    train_seconds=update.train_seconds,
                    local_correct=score[0] if score else None,
                    local_total=score[1] if score else None,
                    diverged_at=update.diverged_at, under_clip=update.under_clip,
                    **(dataclasses.asdict(cost) if cost is not None else {}))

    def to_update(self, deltas: Any, device: str, cost: Any = None) -> Any:
        """The ClientUpdate this header says, with its `deltas`, the `device` whose login sent
        it and its `cost` as the coordinator accepted it."""
        from fedseq.common.algorithms.aggregate import ClientUpdate

        score = None if self.local_correct is None or self.local_total is None else (
            self.local_correct, self.local_total)
        return ClientUpdate(client=self.client, round=self.round, deltas=deltas,
                            num_samples=self.num_samples, effective_samples=self.effective_samples,
                            train_seconds=self.train_seconds, local_score=score, device=device,
                            cost=cost, diverged_at=self.diverged_at, under_clip=self.under_clip)


class SiteTaskHeader(Message):
    """Header of one chunk of a site task ([hierarchy] on a fleet): the coordinator asks the edge
    aggregator of `site` for a step over its devices, the frame holding the blocks it needs (the
    global model as the round offers it). train: `edge_rounds` site rounds of round `round` over
    `clients`, answered with one partial aggregate; evaluate, finetune: the site's clients'
    scores; idle: the run is over. Coordinator to edge only: no device reads it."""

    run_id: str
    site: str = Field(max_length=64)
    seq: int = Field(ge=0, description="Strictly increasing within a run, over every site.")
    kind: Literal["train", "evaluate", "finetune", "idle"]
    round: int = Field(-1, description="train: the global round.")
    clients: List[int] = Field(default_factory=list, description="train: the site's clients.")
    plan: Optional[Dict[str, Any]] = Field(None, description="train, finetune: the ClientPlan.")
    needed: List[str] = Field(default_factory=list, description="train: the blocks sent.")
    bound: float = Field(0.0, ge=0, description="train: the round's bound on a delta.")
    clip: Optional[float] = Field(None, description="train, [privacy]: the round's clip norm.")
    eval_heads: List[str] = Field(default_factory=list, description="evaluate, finetune.")
    personal: List[str] = Field(default_factory=list, description="The personal blocks.")
    chunk: int = Field(ge=0, description="This chunk's index.")
    chunks: int = Field(ge=1, description="The frame's chunks.")
    size: int = Field(ge=0, description="Bytes of the whole frame.")
    sha256: str = Field(description="The whole frame's SHA-256 (hex).")


class SiteClient(BaseModel):
    """What a site's partial says of one client whose update it folded (the coordinator checks
    the counts against its own and recomputes the client's weight from them)."""

    model_config = ConfigDict(extra="forbid")
    client: int = Field(ge=0)
    device: str = Field(max_length=64)
    num_samples: int = Field(ge=0)
    effective_samples: Optional[int] = Field(None, ge=0)
    train_seconds: float = Field(0.0, ge=0, description="Its training, over all its site rounds.")
    local_correct: Optional[int] = Field(None, ge=0)
    local_total: Optional[int] = Field(None, ge=0)
    upload_bytes: int = Field(0, ge=0, description="What its update measured on the site's wire.")
    under_clip: Optional[bool] = None
    norm: Optional[float] = Field(None, ge=0, description="Its update's L2 norm (no [secagg]).")
    folds: int = Field(1, ge=1, le=1000, description="Its updates the site folded (its site rounds).")


class SiteResultHeader(Message):
    """Header of one chunk of an edge aggregator's answer to a site task (edge to coordinator).
    train: the frame holds the site's partial aggregate (its model's change since the global
    model after its site rounds, float32), `weights` its total weight per tensor, `clients` the
    clients folded in it; evaluate, finetune: an empty frame and `scores`."""

    run_id: str
    site: str = Field(max_length=64)
    seq: int = Field(ge=0, description="The site task it answers.")
    round: int = -1
    weights: Dict[str, float] = Field(default_factory=dict)
    clients: List[SiteClient] = Field(default_factory=list, max_length=1_000_000)
    rejected: Dict[int, str] = Field(default_factory=dict, description=(
        "Clients whose update the site refused, with why."))
    failures: Dict[str, str] = Field(default_factory=dict, description=(
        "Devices (or the site's own rounds) that could not run the step, with why."))
    blocked: List[int] = Field(default_factory=list, description="Clients of devices that failed.")
    bytes_up: int = Field(0, ge=0, description="Update bytes the site's devices sent it.")
    recovered: List[int] = Field(default_factory=list, max_length=1_000_000, description=(
        "[secagg]: clients whose masks the site recovered (they dropped after sharing keys)."))
    excluded: Dict[int, str] = Field(default_factory=dict, description=(
        "[secagg]: clients the site's secure rounds proved bad, left out of the rest of the run."))
    scores: Dict[int, Tuple[int, int]] = Field(default_factory=dict, description=(
        "evaluate, finetune: client -> (correct, total)."))
    diverged: Dict[int, int] = Field(default_factory=dict, description="finetune.")
    global_score: Optional[Tuple[int, int]] = Field(None, description=(
        "data.placement = \"device\", evaluate: the global model on the test rows of the "
        "clients in `scores`, together, as the site's devices scored it (correct, total)."))
    chunk: int = Field(ge=0, description="This chunk's index.")
    chunks: int = Field(ge=1, description="The frame's chunks.")
    size: int = Field(ge=0, description="Bytes of the whole frame.")
    sha256: str = Field(description="The whole frame's SHA-256 (hex).")


class SiteStatus(Message):
    """An edge aggregator's presence (retained; its last will says offline)."""

    since_current = ("run_id", "clients", "refused", "error", "error_run_id")

    site: str = Field(max_length=64)
    state: Literal["online", "offline"]
    error: str = Field("", max_length=2000, description=(
        "Why this edge cannot follow run `error_run_id` (a model, dataset or plugin missing at "
        "the site, another plugin version): the coordinator names the site and this at once."))
    error_run_id: Optional[str] = Field(None, max_length=100, description="That run.")
    devices: List[str] = Field(default_factory=list, description="Its devices online.")
    run_id: Optional[str] = Field(None, max_length=100, description=(
        "data.placement = \"device\": the run whose clients `clients` and `refused` tell."))
    clients: Dict[str, List[ClientSizes]] = Field(default_factory=dict, max_length=10_000,
                                                  description=(
        "data.placement = \"device\", before the run has its roster: each of its devices -> "
        "the clients it announced for run `run_id` (as the device's status says them)."))
    refused: Dict[str, str] = Field(default_factory=dict, max_length=10_000, description=(
        "data.placement = \"device\": its devices that cannot follow run `run_id`, each with a "
        "line saying why."))


class RosterClient(ClientSizes):
    """data.placement = "device": one client of a run's roster, with the device holding it."""

    device: str = Field(max_length=64)


class SiteRun(RunConfig):
    """The run as an edge aggregator gets it (retained on `<root>/site/<site>/run`): the whole
    experiment config, and with data.placement = "device" the clients the coordinator numbered
    from every site's announcements."""

    since_current: ClassVar[Tuple[str, ...]] = ("plugins", "roster")

    roster: Optional[List[RosterClient]] = Field(None, max_length=1_000_000, description=(
        "data.placement = \"device\": every client of the run, in client-id order, with its "
        "device; None while the coordinator gathers the sites' announcements (each edge then "
        "publishes the run to its devices and says what they announce in its status)."))
