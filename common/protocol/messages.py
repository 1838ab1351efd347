"""Wire messages: pydantic models with a protocol version; invalid input is a ProtocolError.

JSON messages carry control; tensor frames (frames.py) carry a JSON header plus raw bytes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedseq.common.errors import ProtocolError

PROTOCOL_VERSION = 1


def version_mismatch(payload: bytes) -> tuple[int, str | None] | None:
    """(the other side's protocol version, its run id) when `payload` is JSON of another protocol
    version; None otherwise. Lets either side say *why* it cannot read the other."""
    import json

    try:
        raw = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(raw, dict) and isinstance(raw.get("v"), int) and raw["v"] != PROTOCOL_VERSION:
        run_id = raw.get("run_id")
        return raw["v"], run_id if isinstance(run_id, str) else None
    return None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    v: Literal[1] = 1  # PROTOCOL_VERSION; a device of another version is rejected loudly

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, payload: bytes):
        try:
            return cls.model_validate_json(payload)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "message"
            raise ProtocolError(f"invalid {cls.__name__}: {where}: {err['msg']}") from exc


class ServerStatus(Message):
    state: Literal["online", "offline"]
    run_id: Optional[str] = None
    broker: Optional[str] = None


class DeviceStatus(Message):
    device: str
    state: Literal["online", "offline"]
    package_version: str = ""
    torch_device: str = "cpu"
    memory_mb: int = 0
    slots: int = Field(1, ge=1)
    # The last step this device could not execute, and why (missing data, out of memory, CUDA
    # error, ...); the coordinator fails the device's clients in that step at once.
    error: str = Field("", max_length=2000)
    error_seq: Optional[int] = None
    error_run_id: Optional[str] = None
    since: float = 0.0  # Unix time this state began (online: when the daemon connected)


class RunConfig(Message):
    run_id: str
    config: Dict[str, Any]  # ExperimentConfig.model_dump(mode="json"); validated again on receipt


class Assignment(Message):
    run_id: str
    device: str
    clients: List[int]


class Step(Message):
    """The coordinator's current step, retained so a reconnecting device resumes from it."""

    run_id: str
    seq: int = Field(ge=0)  # strictly increasing within a run
    kind: Literal["train", "evaluate", "finetune", "idle", "stop"]
    round: int = -1
    clients: List[int] = Field(default_factory=list)
    plan: Optional[Dict[str, Any]] = None  # ClientPlan as plain data (train, finetune)
    versions: Dict[str, int] = Field(default_factory=dict)  # block -> version the step needs
    eval_heads: List[str] = Field(default_factory=list)


class EvalResult(Message):
    run_id: str
    seq: int
    device: str
    results: Dict[int, Tuple[int, int]]  # client -> (correct, total)
    final: bool = True  # False: progress during fine-tuning (the clients done so far)


class Control(Message):
    run_id: Optional[str] = None
    command: Literal["abort"]
    reason: str = ""


class WeightsHeader(Message):
    run_id: str
    block: str
    version: int = Field(ge=0)
    chunk: int = Field(ge=0)
    chunks: int = Field(ge=1)
    size: int = Field(ge=0)  # bytes of the whole frame
    sha256: str


class UpdateHeader(Message):
    run_id: str
    seq: int
    round: int
    client: int
    device: str
    num_samples: int
    effective_samples: Optional[int] = None
    train_flops: int = 0  # ignored: the coordinator counts FLOPs from the plan (common/flops.py)
    train_seconds: float = 0.0  # local computation: training and the local score
    local_correct: Optional[int] = None  # the trained model on the client's test rows
    local_total: Optional[int] = None
    chunk: int = Field(ge=0)
    chunks: int = Field(ge=1)
    size: int = Field(ge=0)
    sha256: str
