"""What devices send, as typed events: the network thread parses and checks every message against
what it can know without the round's state (run, device, owner, step), reassembles update frames
within their memory bound, and queues an event; the coordinator thread acts on events only."""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import TypeAlias

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.errors import FedseqError, ProtocolError
from fedseq.common.protocol.frames import FramePool, unpack_chunk
from fedseq.common.protocol.messages import (
    PROTOCOL_VERSION,
    DeviceStatus,
    EvalResult,
    UpdateHeader,
    version_mismatch,
)
from fedseq.common.protocol.tensors import decode_tensors
from fedseq.common.protocol.topics import Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StatusArrived:
    """A device's retained status (online with its last error, or offline)."""

    status: DeviceStatus


@dataclass(frozen=True)
class UpdateArrived:
    """A complete, decoded update frame for the step being collected."""

    device: str
    seq: int
    update: ClientUpdate


@dataclass(frozen=True)
class EvalArrived:
    """A device's scores for an evaluate or finetune step (final or progress)."""

    result: EvalResult


Event: TypeAlias = StatusArrived | UpdateArrived | EvalArrived


def _same_device(claimed: str, topic_device: str) -> None:
    if claimed != topic_device:
        raise ProtocolError(f"body names device {claimed!r} but was sent on {topic_device!r}'s topic")


class Inbox:
    """Turns the topics the coordinator reads into events on `queue`.

    The sender is the device its topic names (the broker's ACL binds topics to logins); a body
    that claims another device is rejected. Updates count only for the step being collected
    (`collecting`) from the device that owns the client (`owner`); both are set by the pool."""

    def __init__(self, topics: Topics, run_id: str):
        self.topics = topics
        self.run_id = run_id
        self.queue: queue.Queue[Event] = queue.Queue()
        self.owner: dict[int, str] = {}
        self.collecting = -1  # the step whose updates are being collected; others are late
        self.late = 0
        self.frames = FramePool(max_frame=1, per_sender=1)  # sized by the pool when a run opens
        self.heard: dict[str, float] = {}  # device -> monotonic time of its last valid message

    def subscriptions(self) -> list[str]:
        t = self.topics
        return [t.device_status(), t.update(), t.evaluation()]

    def collect(self, seq: int) -> None:
        """Accept updates of step `seq` from now on (-1: none); partial frames of other steps go."""
        self.collecting = seq
        self.frames.expire(lambda sender, tag: tag[1] == seq)

    def on_message(self, topic: str, payload: bytes) -> None:
        """Network thread: one message in, at most one event out; anything invalid is logged
        with its reason and dropped."""
        if not payload:
            return
        try:
            ref = self.topics.parse(topic)
            if ref is not None and ref.kind == "device_status":
                status = DeviceStatus.decode(payload)
                _same_device(status.device, ref.device)
                self.queue.put(StatusArrived(status))
            elif ref is not None and ref.kind == "eval":
                res = EvalResult.decode(payload)
                _same_device(res.device, ref.device)
                if res.run_id != self.run_id:
                    raise ProtocolError(f"evaluation for run {res.run_id}, this is {self.run_id}")
                self.queue.put(EvalArrived(res))
            elif ref is not None and ref.kind == "update":
                self._on_update_chunk(ref.device, ref.client, ref.chunk, payload)
            else:
                raise ProtocolError("not a topic the coordinator reads")
            self.heard[ref.device] = time.monotonic()
        except FedseqError as exc:
            other = version_mismatch(payload)
            hint = (f" (it speaks protocol v{other[0]}, this coordinator v{PROTOCOL_VERSION}: install "
                    "the same fedseq version on both sides)") if other else ""
            log.warning("dropped message on %s: %s%s", topic, exc, hint)

    def _on_update_chunk(self, device: str, client: str, chunk: str, payload: bytes) -> None:
        head, data = unpack_chunk(payload, UpdateHeader)
        _same_device(head.device, device)
        if str(head.client) != client or str(head.chunk) != chunk:
            raise ProtocolError(f"header says client {head.client} chunk {head.chunk}, topic "
                                f"says {client}/{chunk}")
        if head.run_id != self.run_id:
            raise ProtocolError(f"update for run {head.run_id}, this is {self.run_id}")
        if self.owner.get(head.client) != device:
            raise ProtocolError(f"client {head.client} is not assigned to {device}")
        if head.seq != self.collecting:
            if head.chunk == 0:
                self.late += 1
                log.warning("late update of client %d from %s dropped: step %d, collecting step %d",
                            head.client, device, head.seq, self.collecting)
            return
        frame = self.frames.add(device, (head.client, head.seq), head, data)
        if frame is None:
            return
        deltas = decode_tensors(frame, copy=False, check_finite=False)  # the contract checks values
        update = ClientUpdate(client=head.client, round=head.round, deltas=deltas,
                              num_samples=head.num_samples, effective_samples=head.effective_samples,
                              train_seconds=head.train_seconds,
                              local_score=None if head.local_correct is None or head.local_total is
                              None else (head.local_correct, head.local_total), device=device)
        self.queue.put(UpdateArrived(device, head.seq, update))
