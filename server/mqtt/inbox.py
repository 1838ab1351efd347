"""What devices send, as typed events: the network thread parses and checks every message against
what it can know without the round's state (run, device, owner, step), reassembles update frames
within their memory bound, and queues an event; the coordinator thread acts on events only."""

from __future__ import annotations

import logging
import math
import os
import queue
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeAlias

from fedseq.common.algorithms.aggregate import ClientUpdate, DeviceCost
from fedseq.common.errors import FedseqError, ProtocolError
from fedseq.common.protocol.frames import FramePool, unpack_chunk
from fedseq.common.protocol.messages import (
    PROTOCOL_VERSION,
    DeviceInfo,
    DeviceStatus,
    EvalResult,
    UpdateHeader,
    version_mismatch,
)
from fedseq.common.protocol.tensors import decode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.common.text import printable

log = logging.getLogger(__name__)


#: at most this many events wait for the coordinator thread (all devices together)
MAX_EVENTS = 10_000
#: bytes of complete update frames kept in memory until they are folded in (UpdateSpool)
HELD_IN_MEMORY = 64 << 20
#: complete update frames queued per client and step (an invalid one must not hide a valid one)
UPDATES_PER_CLIENT = 4
#: evaluation messages (progress and final) queued per assigned client and step
EVALS_PER_CLIENT = 4
#: distinct DeviceInfo messages kept per device (the first ones and the latest)
STACKS_PER_DEVICE = 10
#: bytes an evaluation message may carry per client its device holds (a score, joules, a batch
#: number: well under 100 bytes of JSON), plus a fixed allowance for the envelope
EVAL_BYTES_PER_CLIENT, EVAL_BYTES_BASE = 256, 4096
#: messages a device may send at once and per second, plus per client it holds (statuses, update
#: chunks, evaluations): an honest device sends a few per client and step, and re-sends its step's
#: answers after a reconnect; a flood beyond this is dropped before it is parsed, so one login
#: cannot spend the coordinator's network thread for everyone. On top of it, per client, the
#: chunks of one whole update at once (a big model's update is many 1 MiB chunks: ResNet-34's
#: 82) and again every RESEND_SPACING_S seconds, so a device can answer a resend of all its
#: clients' updates at once (`Inbox.update_chunks`, set when a run opens).
BURST_BASE, BURST_PER_CLIENT, RATE_BASE, RATE_PER_CLIENT = 100, 16, 20.0, 2.0
RESEND_SPACING_S = 10.0
#: warnings about one device's invalid or dropped messages logged per minute; the rest are counted
#: and summed up in one line (journald's own rate limit would otherwise drop the operator's lines)
WARNINGS_PER_MINUTE = 10


def queue_share(clients: int) -> int:
    """Events one device may have waiting for the coordinator thread at once, holding `clients`
    clients: what its honest answers to one step can be (every update frame and evaluation
    message it may have queued), so a flood from one login never takes another device's room."""
    return (UPDATES_PER_CLIENT + EVALS_PER_CLIENT) * (clients + 1)


@dataclass(frozen=True)
class StatusArrived:
    """A device's status changed (online with its last error, or offline): `Inbox.take_status`."""

    device: str


@dataclass(frozen=True)
class UpdateArrived:
    """A complete update frame for the step being collected: decoded, holding `held` bytes of
    the inbox's memory budget, or (`spooled`) waiting in its spool file, `update.deltas` empty."""

    device: str
    seq: int
    update: ClientUpdate
    held: int = 0
    spooled: tuple[int, int] | None = None


class UpdateSpool:
    """Where complete update frames wait until the coordinator thread folds them in (in client
    order: an early client's update can keep a round's others waiting): in memory up to `budget`
    bytes (always at least one frame), beyond it in a temporary file, read back when the update
    is checked and again when it is folded in. The network thread keeps frames (`hold`); the
    coordinator thread reads and releases them; `reset` empties the file between steps. The
    coordinator's memory then stays flat however many updates a round brings."""

    def __init__(self, budget: int = HELD_IN_MEMORY):
        self.budget = budget
        self.in_memory = 0
        self.spilled = 0  # frames written to the file, over the run
        self._file: BinaryIO | None = None
        self._lock = threading.Lock()

    def hold(self, frame: memoryview) -> tuple[int, tuple[int, int] | None]:
        """(bytes of the budget it holds in memory, 0 when spooled; where it is spooled, if)."""
        with self._lock:
            if not self.in_memory or self.in_memory + len(frame) <= self.budget:
                self.in_memory += len(frame)
                return len(frame), None
            self.spilled += 1
        return 0, self.write(frame)

    def release(self, size: int) -> None:
        with self._lock:
            self.in_memory -= size

    def write(self, frame: memoryview) -> tuple[int, int]:
        with self._lock:
            if self._file is None:  # closed with the inbox's process; emptied every step
                self._file = tempfile.TemporaryFile(prefix="fedseq-updates-")  # noqa: SIM115
            offset = self._file.seek(0, os.SEEK_END)
            self._file.write(frame)
            return offset, len(frame)

    def spill_chunk(self, chunk: memoryview | bytes) -> Callable[[], bytearray]:
        """A partial frame's chunk to the file (FramePool's `spill`): how to read it back."""
        at = self.write(memoryview(chunk))
        return lambda: self.read(at)

    def read(self, at: tuple[int, int]) -> bytearray:
        with self._lock:
            assert self._file is not None
            self._file.seek(at[0])
            return bytearray(self._file.read(at[1]))

    def reset(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.truncate(0)


@dataclass(frozen=True)
class EvalArrived:
    """A device's scores for an evaluate or finetune step (final or progress)."""

    result: EvalResult


Event: TypeAlias = StatusArrived | UpdateArrived | EvalArrived


def plausible(v: float | None, lo: float, hi: float) -> float | None:
    """`v` if it is a finite number within [lo, hi], else None (a device's informational figure)."""
    return v if v is not None and math.isfinite(v) and lo <= v <= hi else None


def device_cost(head: UpdateHeader) -> DeviceCost | None:
    """The update header's energy and health figures, each kept only if plausible (finite and
    within physical bounds; anything else is dropped, never the update): they are informational
    and never touch aggregation. None when the device sent none."""
    rails = {str(k)[:40]: v for k, v in (head.energy_rails or {}).items()
             if plausible(v, 0.0, 1e7) is not None}
    mem = head.mem_available_mb
    cost = DeviceCost(
        energy_j=plausible(head.energy_j, 0.0, 1e7),
        energy_w=plausible(head.energy_w, 0.0, 1e5),
        energy_rails=rails or None,
        energy_source=head.energy_source,
        max_temp_c=plausible(head.max_temp_c, -60.0, 200.0),
        throttled=head.throttled,
        gpu_load=plausible(head.gpu_load, 0.0, 1.0),
        mem_available_mb=mem if mem is not None and 0 <= mem <= 1 << 24 else None,
    )
    return None if cost == DeviceCost() else cost


def _same_device(claimed: str, topic_device: str) -> None:
    if claimed != topic_device:
        raise ProtocolError(f"body names device {claimed!r} but was sent on {topic_device!r}'s topic")


def _device_of(event: Event) -> str:
    return event.result.device if isinstance(event, EvalArrived) else event.device


class Inbox:
    """Turns the topics the coordinator reads into events on `queue`.

    The sender is the device its topic names (the broker's ACL binds topics to logins); a body
    that claims another device is rejected. Updates count only for the step being collected
    (`collecting`) from the device that owns the client (`owner`); both are set by the pool."""

    def __init__(self, topics: Topics, run_id: str):
        self.topics = topics
        self.run_id = run_id
        self.queue: queue.Queue[Event] = queue.Queue(MAX_EVENTS)
        self.owner = {}
        self.collecting = -1  # the step whose answers are being collected; others are late
        self.late = 0
        self.late_evals = 0
        self.arrivals = 0  # answers (update chunks, evaluations) of the step being collected
        self.frames = FramePool(max_frame=1, per_sender=1)  # sized by the pool when a run opens
        self.update_chunks = 0  # messages one update frame takes at most (set with `frames`)
        self.spool = UpdateSpool()
        self.heard: dict[str, float] = {}  # device -> monotonic time of its last valid message
        # Bounded whatever arrives, per device: its statuses are coalesced (the latest one waits,
        # never dropped: the queued event only wakes the coordinator thread), answers count only
        # for the step being collected, at most UPDATES_PER_CLIENT frames per client and step and
        # EVALS_PER_CLIENT messages per assigned client and step are queued, and no device has
        # more than its queue_share waiting; the queue refuses more than MAX_EVENTS in all.
        # `on_junk(topic)` hears of every invalid message on a device-written topic (the session
        # clears it in case it was retained).
        self._status: dict[str, DeviceStatus] = {}
        self._lock = threading.Lock()
        self._queued: dict[tuple[str, int, object], int] = {}
        self._held: dict[str, int] = {}  # device -> its events waiting in the queue
        self._warned: dict[str, tuple[float, int]] = {}  # device -> (minute began, lines logged)
        self._tokens: dict[str, tuple[float, float]] = {}  # device -> (messages left, when)
        self.flooded = 0  # messages dropped unparsed: their device sent faster than its budget
        self.dropped = 0
        # device -> the distinct stacks it described (DeviceInfo), with when each was first seen
        self._stacks: dict[str, list[tuple[float, DeviceInfo]]] = {}
        self.on_junk: Callable[[str], None] = lambda topic: None

    @property
    def owner(self) -> dict[int, str]:
        """client -> the device that holds it (set by the pool when a run opens)."""
        return self._owner

    @owner.setter
    def owner(self, owner: dict[int, str]) -> None:
        self._owner = owner
        self._clients = Counter(owner.values())  # device -> clients: read for every message

    def subscriptions(self) -> list[str]:
        t = self.topics
        return [t.device_status(), t.device_info(), t.update(), t.evaluation()]

    def collect(self, seq: int) -> None:
        """Accept answers (updates, evaluations) of step `seq` from now on (-1: none); partial
        frames and the per-step counts of other steps go."""
        self.collecting = seq
        self.frames.expire(lambda sender, tag: tag[1] == seq)
        if seq >= 0:  # the previous step's updates are all folded in or dropped
            self.spool.reset()
        with self._lock:
            self._queued = {k: n for k, n in self._queued.items() if k[1] == seq}

    def next_event(self, timeout: float) -> Event | None:
        """Coordinator thread: the next queued event within `timeout` seconds (0: only one that is
        already there), or None; its device's share of the queue is freed."""
        try:
            ev = (self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait())
        except queue.Empty:
            return None
        if not isinstance(ev, StatusArrived):
            with self._lock:
                device = _device_of(ev)
                self._held[device] = self._held.get(device, 1) - 1
        return ev

    def take_statuses(self) -> list[DeviceStatus]:
        """Coordinator thread: every device's latest status not yet taken, in arrival order
        (whether or not its wake-up event found room in the queue)."""
        with self._lock:
            out = list(self._status.values())
            self._status.clear()
        return out

    def device_stacks(self) -> dict[str, list[dict[str, Any]]]:
        """What each device said it trains with (DeviceInfo, oldest first), as JSON-ready rows
        with the Unix time each was first seen: for the run directory's devices.json."""
        with self._lock:
            return {d: [{"seen": round(t, 3), **i.model_dump(exclude={"v", "device"})}
                        for t, i in seen] for d, seen in self._stacks.items()}

    def _put(self, event: Event, key: tuple[str, int, object] | None = None, cap: int = 0) -> bool:
        """Queue `event` unless its key (kind, step, who) already had `cap` events queued, its
        device has its whole share waiting, or the queue is full: the network thread never
        blocks, and memory stays bounded. Whether it was queued."""
        device = _device_of(event)
        if key is not None:
            with self._lock:
                full = (self._queued.get(key, 0) >= cap
                        or self._held.get(device, 0) >= queue_share(self._clients[device]))
                if not full:
                    self._queued[key] = self._queued.get(key, 0) + 1
                    self._held[device] = self._held.get(device, 0) + 1
            if full:
                self.dropped += 1
                self._warn(device, "dropped a message from %s: it sent more than a step needs, or "
                           "has its share of the coordinator's queue waiting", device)
                return False
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            if key is not None:
                with self._lock:
                    self._held[device] -= 1
            self.dropped += 1
            self._warn(device, "event queue full (%d): dropped a message from %s", MAX_EVENTS,
                       device)
            return False
        return True

    def budget(self, device: str) -> tuple[int, float]:
        """(messages at once, messages a second) that `device` may send: a token bucket that
        grows with its clients and with the size of an update (module constants)."""
        mine = self._clients[device]
        return (BURST_BASE + mine * (BURST_PER_CLIENT + self.update_chunks),
                RATE_BASE + mine * (RATE_PER_CLIENT + self.update_chunks / RESEND_SPACING_S))

    def _within_rate(self, device: str) -> bool:
        """Network thread: whether `device` still has budget for one more message (`budget`)."""
        burst, rate = self.budget(device)
        now = time.monotonic()
        tokens, when = self._tokens.get(device, (float(burst), now))
        tokens = min(float(burst), tokens + (now - when) * rate)
        if tokens < 1.0:
            self._tokens[device] = (tokens, now)
            self.flooded += 1
            self._warn(device, "dropped messages from %s unread: it sends faster than a device "
                       "needs (%d at once, %.0f a second)", device, burst, rate)
            return False
        self._tokens[device] = (tokens - 1.0, now)
        return True

    def _warn(self, device: str, msg: str, *args: object) -> None:
        """A warning about `device`'s messages, at most WARNINGS_PER_MINUTE a minute per device;
        the first one after a quiet spell says how many were left out. Every argument is printed
        as one line of plain text (a device cannot forge a line of the coordinator's log)."""
        now = time.monotonic()
        began, logged = self._warned.get(device, (now, 0))
        if now - began >= 60.0:
            if logged > WARNINGS_PER_MINUTE:
                log.warning("%d more warnings about %s's messages were not logged",
                            logged - WARNINGS_PER_MINUTE, printable(device, 80))
            began, logged = now, 0
        self._warned[device] = (began, logged + 1)
        if logged < WARNINGS_PER_MINUTE:
            log.warning(msg, *(printable(a, 300) if isinstance(a, str) else a for a in args))

    def on_message(self, topic: str, payload: bytes) -> None:
        """Network thread: one message in, at most one event out; anything invalid is logged
        with its reason and dropped."""
        if not payload:
            return
        ref = None
        try:
            ref = self.topics.parse(topic)
            if ref is not None and ref.device and not self._within_rate(ref.device):
                return
            if ref is not None and ref.kind == "device_status":
                status = DeviceStatus.decode(payload)
                _same_device(status.device, ref.device)
                with self._lock:  # coalesced: the latest status waits, its event only wakes up
                    fresh = status.device not in self._status
                    self._status[status.device] = status
                if fresh:
                    self._put(StatusArrived(status.device))
            elif ref is not None and ref.kind == "device_info":
                info = DeviceInfo.decode(payload)
                _same_device(info.device, ref.device)
                with self._lock:  # a new entry only when the stack changed (a reboot, an upgrade)
                    seen = self._stacks.setdefault(info.device, [])
                    if not seen or seen[-1][1] != info:
                        if len(seen) == STACKS_PER_DEVICE:
                            seen.pop()
                        seen.append((time.time(), info))
            elif ref is not None and ref.kind == "eval":
                mine = self._clients[ref.device]
                limit = EVAL_BYTES_BASE + EVAL_BYTES_PER_CLIENT * mine
                if len(payload) > limit:  # refused before parsing: never allocated as objects
                    raise ProtocolError(f"evaluation of {len(payload)} bytes; {ref.device} holds "
                                        f"{mine} clients, whose scores fit in {limit}")
                res = EvalResult.decode(payload)
                _same_device(res.device, ref.device)
                if res.run_id != self.run_id:
                    raise ProtocolError(f"evaluation for run {res.run_id}, this is {self.run_id}")
                if res.seq != self.collecting:
                    self.late_evals += 1
                    return  # a step that is over (or never was): nothing waits for it
                self.arrivals += 1
                self._put(EvalArrived(res), ("eval", res.seq, res.device),
                          EVALS_PER_CLIENT * (mine + 1))
            elif ref is not None and ref.kind == "update":
                self._on_update_chunk(ref.device, payload)
            else:
                raise ProtocolError("not a topic the coordinator reads")
            if ref.kind != "device_info":  # a retained description says nothing of presence
                self.heard[ref.device] = time.monotonic()
        except FedseqError as exc:
            if ref is not None and ref.kind in ("update", "eval"):
                self.on_junk(topic)
            other = version_mismatch(payload)
            hint = (f" (it speaks protocol v{other[0]}, this coordinator v{PROTOCOL_VERSION}: install "
                    "the same fedseq version on both sides)") if other else ""
            self._warn(ref.device if ref is not None else "", "dropped message on %s: %s%s",
                       topic, str(exc), hint)

    def _on_update_chunk(self, device: str, payload: bytes) -> None:
        head, data = unpack_chunk(payload, UpdateHeader)
        _same_device(head.device, device)
        if head.run_id != self.run_id:
            raise ProtocolError(f"update for run {head.run_id}, this is {self.run_id}")
        if self.owner.get(head.client) != device:
            raise ProtocolError(f"client {head.client} is not assigned to {device}")
        if head.seq != self.collecting:
            if head.chunk == 0:
                self.late += 1
                self._warn(device, "late update of client %d from %s dropped: step %d, "
                           "collecting step %d", head.client, device, head.seq, self.collecting)
            return
        self.arrivals += 1
        frame = self.frames.add(device, (head.client, head.seq), head, data)
        if frame is None:
            return
        deltas = decode_tensors(frame, copy=False, check_finite=False)  # the contract checks values
        held, spooled = self.spool.hold(frame)
        if spooled is not None:  # (decoded all the same: a malformed frame is refused now)
            deltas = {}
        update = ClientUpdate(client=head.client, round=head.round, deltas=deltas,
                              num_samples=head.num_samples, effective_samples=head.effective_samples,
                              train_seconds=head.train_seconds,
                              local_score=None if head.local_correct is None or head.local_total is
                              None else (head.local_correct, head.local_total), device=device,
                              cost=device_cost(head), diverged_at=head.diverged_at)
        if not self._put(UpdateArrived(device, head.seq, update, held, spooled),
                         ("update", head.seq, head.client), UPDATES_PER_CLIENT):
            self.spool.release(held)
