"""Wire messages: pydantic models with a protocol version; invalid input is a ProtocolError.

JSON messages carry control; tensor frames (frames.py) carry a JSON header plus raw bytes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedseq.common.errors import ProtocolError, validation_problem

# 2: Step.personal added; the never-used DeviceStatus.slots, UpdateHeader.train_flops and the
# "stop" step kind removed; Control(abort) is sent when a run ends abnormally.
# 4: UpdateHeader.diverged_at and EvalResult.diverged (a NaN or Inf loss stops training).
# 5: updates on one topic per device (fedseq/update/<device>; client and chunk in the header), so
# a device login can leave at most one retained message there (the ACL grants no deeper level).
# 6: the "async" step kind (train.mode = "async"): Step.dispatched; an update's seq is then the
# step that dispatched its client, its round the model version it trained on.
PROTOCOL_VERSION = 6
#: seconds between an online device's status messages (its heartbeat)
HEARTBEAT_S = 15.0


def version_mismatch(payload: bytes) -> tuple[int, str | None] | None:
    """(the other side's protocol version, its run id) when `payload` is JSON of another protocol
    version; None otherwise. Lets either side say *why* it cannot read the other."""
    import json

    if len(payload) > 1 << 20:  # no run config or step is that long: not worth parsing again
        return None
    try:
        raw = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested junk
        return None
    if isinstance(raw, dict) and isinstance(raw.get("v"), int) and raw["v"] != PROTOCOL_VERSION:
        run_id = raw.get("run_id")
        return raw["v"], run_id if isinstance(run_id, str) else None
    return None


class PeerVersion(ProtocolError):
    """A message of another protocol version (`version`): its sender runs another fedseq. Told
    from the one validation of the message, so a refused message is never parsed again."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


class Message(BaseModel):
    """Base of every JSON message: unknown fields are refused, and `v` must be this side's
    protocol version (a peer of another version is rejected loudly, see version_mismatch)."""

    model_config = ConfigDict(extra="forbid")
    v: Literal[6] = 6  # PROTOCOL_VERSION

    def encode(self) -> bytes:
        """The message as compact JSON bytes."""
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, payload: bytes):
        """Parse and validate; anything invalid is a one-line ProtocolError."""
        try:
            return cls.model_validate_json(payload)
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
    run_id: Optional[str] = None
    broker: Optional[str] = None


class DeviceStatus(Message):
    """A device's presence and health (retained; its last will says offline)."""

    device: str
    state: Literal["online", "offline"]
    package_version: str = Field("", max_length=100)
    torch_device: str = Field("cpu", max_length=100)
    memory_mb: int = 0
    # The last step this device could not execute, and why (missing data, out of memory, CUDA
    # error, ...); the coordinator fails the device's clients in that step at once.
    error: str = Field("", max_length=2000)
    error_seq: Optional[int] = None
    error_run_id: Optional[str] = None
    # Unix time this state began (online: when the daemon connected); finite, before year 5000
    since: float = Field(0.0, ge=0, le=1e11)
    # An online device re-publishes its status every heartbeat_s seconds (v3): the coordinator
    # treats one it has not heard from for 3 heartbeats as gone, whatever its retained status
    # says (a device that died while the broker was down leaves "online" retained forever).
    heartbeat_s: float = Field(HEARTBEAT_S, gt=0, le=4 * HEARTBEAT_S)  # silent 3 min at most
    # Health, refreshed with every heartbeat (informational; None where the device cannot tell):
    # the hottest thermal zone, a zone past a passive trip point, the Jetson GPU's load (0-1),
    # available memory, the power source its energy figures come from (or why there is none),
    # and the energy of its last client-round.
    temp_c: Optional[float] = None
    throttled: Optional[bool] = None
    gpu_load: Optional[float] = None
    mem_available_mb: Optional[int] = None
    energy_source: Optional[str] = Field(None, max_length=200)
    last_round_j: Optional[float] = None


class DeviceInfo(Message):
    """What a device trains with (retained, published on every connect): what bitwise
    reproducibility depends on besides the config and the seed (docs/explanation/reproducibility.md). The
    coordinator records it in the run directory (devices.json). Informational: a device whose
    broker account may not write this topic (an ACL from before it existed) still trains."""

    device: str
    package_version: str = Field("", max_length=100)
    python: str = Field("", max_length=100)
    torch: str = Field("", max_length=100)
    cuda: str = Field("", max_length=100)  # the CUDA torch was built for ("" for a CPU build)
    torch_device: str = Field("cpu", max_length=100)
    gpu: str = Field("", max_length=200)  # the GPU's name when it trains on one
    threads: int = Field(0, ge=0)  # torch's CPU threads
    machine: str = Field("", max_length=100)  # aarch64, x86_64
    cpu: str = Field("", max_length=200)  # the CPU's model (x86) or the board's (Jetson)
    cpu_kernels: str = Field("", max_length=200)  # hardware.cpu_kernels ("": an older device)
    l4t: str = Field("", max_length=100)  # a Jetson's L4T release (JetPack generation)


class RunConfig(Message):
    """The run's whole experiment config (retained): devices derive the partition, the model
    and the seeds from it."""

    run_id: str
    config: Dict[str, Any]  # ExperimentConfig.model_dump(mode="json"); validated again on receipt


class Assignment(Message):
    """The logical clients a device hosts in this run (retained, one topic per device)."""

    run_id: str
    device: str
    clients: List[int]


class Step(Message):
    """The coordinator's current step, retained so a reconnecting device resumes from it.

    train: each of `clients` trains once on the model of round `round`; a newer step supersedes
    it (the device stops between clients). async (train.mode = "async"): `clients` are the
    clients in flight, `dispatched` the step that dispatched each; a device trains each of its
    own once per dispatch, one after another, on the newest model it holds (`round`, `plan`,
    `versions` of the newest async step), and answers with that dispatch's seq: a newer async
    step does not supersede the dispatches it still lists."""

    run_id: str
    seq: int = Field(ge=0)  # strictly increasing within a run
    kind: Literal["train", "async", "evaluate", "finetune", "idle"]
    round: int = -1
    clients: List[int] = Field(default_factory=list)
    dispatched: List[int] = Field(default_factory=list)  # async: the seq each client answers
    plan: Optional[Dict[str, Any]] = None  # ClientPlan as plain data (train, finetune)
    versions: Dict[str, int] = Field(default_factory=dict)  # block -> version the step needs
    eval_heads: List[str] = Field(default_factory=list)
    # the algorithm's personal blocks: what a client's stored state overrides (evaluate, finetune)
    personal: List[str] = Field(default_factory=list)


class EvalResult(Message):
    """A device's clients' test scores for an evaluate or finetune step."""

    run_id: str
    seq: int
    device: str
    results: Dict[int, Tuple[int, int]]  # client -> (correct, total)
    final: bool = True  # False: progress during fine-tuning (the clients done so far)
    # fine-tuning: the joules each client's fine-tuning took on the device (informational; left
    # out where the device has no power sensor)
    energy_j: Optional[Dict[int, float]] = None
    # fine-tuning: clients whose loss went NaN or Inf -> the batch (from 1) where it stopped;
    # their scores are their diverged models'
    diverged: Optional[Dict[int, int]] = None


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
    reason: str = ""
    seq: Optional[int] = None  # resend: the step
    clients: List[int] = Field(default_factory=list, max_length=100_000)  # resend: whose answers


class WeightsHeader(Message):
    """Header of one chunk of a block's weights frame (retained, versioned)."""

    run_id: str
    block: str
    version: int = Field(ge=0)
    chunk: int = Field(ge=0)
    chunks: int = Field(ge=1)
    size: int = Field(ge=0)  # bytes of the whole frame
    sha256: str


class UpdateHeader(Message):
    """Header of one chunk of a client's update frame (its deltas) with its sample counts."""

    run_id: str
    seq: int
    round: int
    client: int
    device: str
    num_samples: int
    effective_samples: Optional[int] = None
    train_seconds: float = 0.0  # local computation: training and the local score
    local_correct: Optional[int] = None  # the trained model on the client's test rows
    local_total: Optional[int] = None
    # What the client-round cost on the device (informational: recorded, never aggregated, and
    # sanitised by the coordinator): joules and mean watts in total and per rail, the power
    # source, the hottest temperature and throttling during it, GPU load and free memory after.
    energy_j: Optional[float] = None
    energy_w: Optional[float] = None
    energy_rails: Optional[Dict[str, float]] = Field(None, max_length=16)
    energy_source: Optional[str] = Field(None, max_length=40)
    max_temp_c: Optional[float] = None
    throttled: Optional[bool] = None
    gpu_load: Optional[float] = None
    mem_available_mb: Optional[int] = None
    # the batch (from 1) where training hit a NaN or Inf loss and stopped; the update is refused
    diverged_at: Optional[int] = Field(None, ge=1)
    chunk: int = Field(ge=0)
    chunks: int = Field(ge=1)
    size: int = Field(ge=0)
    sha256: str
