"""What devices send, as typed events: the network thread parses and checks every message against
what it can know without the round's state (run, device, owner, step), reassembles update frames
within their memory bound, and queues an event; the coordinator thread acts on events only."""

from __future__ import annotations

import dataclasses
import logging
import math
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
from fedseq.common.protocol.frames import (
    CHUNK_BYTES,
    CHUNK_MESSAGE_BYTES,
    FramePool,
    Spilled,
    unpack_chunk,
)
from fedseq.common.protocol.messages import (
    PROTOCOL_VERSION,
    DeviceInfo,
    DeviceStatus,
    EvalResult,
    PeerVersion,
    SecAggMessage,
    UpdateHeader,
)
from fedseq.common.protocol.tensors import decode_tensors
from fedseq.common.protocol.topics import TopicRef, Topics
from fedseq.common.text import printable
from fedseq.server.pools.mqtt.budget import (
    CPU_PER_UPDATE_BYTE,
    MESSAGE_BYTES,
    STEP_CPU,
    STEP_CPU_PER_CLIENT,
    Allowance,
    LoginBudgets,
    allowance,
    thread_seconds,
)

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
#: the largest status or device description a device may send (an honest one is under 1 KiB;
#: a status's error text is at most 2,000 characters): a bigger one is refused before parsing
STATUS_BYTES = 16 << 10
#: names not in the run's fleet (an open broker lets anyone invent them) whose bookkeeping is kept
#: (budgets, warnings, last heard, stacks); the oldest are forgotten beyond this many
MAX_STRANGERS = 256
#: devices whose statuses are kept before a run opens (its fleet is not known yet): a fleet of
#: 1,000 devices is measured (docs/deploy.md), so room for four times that
MAX_PRESENT = 4096
#: bytes a secure round's stage message may carry per client its device holds and per neighbour
#: of it (an encrypted share is 168 bytes, 224 in base64, with its receiver's number), plus a
#: fixed allowance for the envelope
SECAGG_BYTES_PER_PAIR, SECAGG_BYTES_BASE = 320, 4096
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
class Spooled:
    """Where a frame waits in the spool file: its slots in order, its length, and the spool's
    generation then (a slot freed after the spool was emptied is not freed twice)."""

    slots: tuple[int, ...]
    size: int
    generation: int


@dataclass(frozen=True)
class UpdateArrived:
    """A complete update frame for the step being collected: decoded, holding `held` bytes of
    the inbox's memory budget, or (`spooled`) waiting in its spool file, `update.deltas` empty.
    The coordinator thread gives its room back with `Inbox.release` once done with it."""

    device: str
    seq: int
    update: ClientUpdate
    held: int = 0
    spooled: Spooled | None = None


class UpdateSpool:
    """Where complete update frames wait until the coordinator thread folds them in (in client
    order: an early client's update can keep a round's others waiting): in memory up to `budget`
    bytes (always at least one frame), beyond it in a temporary file of `slot`-byte slots, read
    back when the update is checked and again when it is folded in. A frame or chunk that is
    folded in or dropped frees its slots, and the next write reuses them, so the file holds what
    waits now, never what waited once (`file_bytes`); `reset` empties it between steps. The
    network thread writes; the coordinator thread reads and frees. The coordinator's memory
    then stays flat however many updates a round brings."""

    def __init__(self, budget: int = HELD_IN_MEMORY, slot: int = CHUNK_BYTES):
        self.budget = budget
        self.slot = slot
        self.in_memory = 0
        self.spilled = 0  # frames written to the file, over the run
        self.generation = 0
        self._file: BinaryIO | None = None
        self._free: list[int] = []  # slots of the file that hold nothing now
        self._slots = 0  # slots the file has
        self._lock = threading.Lock()

    @property
    def file_bytes(self) -> int:
        """The spool file's size."""
        return self._slots * self.slot

    @property
    def used_bytes(self) -> int:
        """Bytes of slots that hold a frame or a chunk now."""
        return (self._slots - len(self._free)) * self.slot

    def hold(self, frame: memoryview) -> tuple[int, Spooled | None]:
        """(bytes of the budget it holds in memory, 0 when spooled; where it is spooled, if)."""
        with self._lock:
            if not self.in_memory or self.in_memory + len(frame) <= self.budget:
                self.in_memory += len(frame)
                return len(frame), None
            self.spilled += 1
        return 0, self.write(frame)

    def release(self, size: int) -> None:
        """`size` bytes of updates held in memory are no longer held."""
        with self._lock:
            self.in_memory -= size

    def write(self, data: memoryview) -> Spooled:
        """Write one chunk to the spool file's free slots; where it lies is the `Spooled`
        returned."""
        with self._lock:
            if self._file is None:  # closed with the inbox's process; emptied every step
                self._file = tempfile.TemporaryFile(prefix="fedseq-updates-")  # noqa: SIM115
            n = max(1, -(-len(data) // self.slot))
            slots = [self._free.pop() if self._free else self._next_slot() for _ in range(n)]
            for i, at in enumerate(slots):
                self._file.seek(at * self.slot)
                self._file.write(data[i * self.slot:(i + 1) * self.slot])
            return Spooled(tuple(slots), len(data), self.generation)

    def _next_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    def spill_chunk(self, chunk: memoryview | bytes) -> Spilled:
        """A partial frame's chunk to the file (FramePool's `spill`)."""
        at = self.write(memoryview(chunk))
        return Spilled(lambda: self.read(at), at.size, lambda: self.free(at))

    def read(self, at: Spooled) -> bytearray:
        """The bytes of a chunk written in this step (`write`'s `Spooled`)."""
        with self._lock:
            assert self._file is not None and at.generation == self.generation
            out = bytearray()
            for i, slot in enumerate(at.slots):
                self._file.seek(slot * self.slot)
                out += self._file.read(min(self.slot, at.size - i * self.slot))
            return out

    def free(self, at: Spooled) -> None:
        """`at`'s slots hold nothing now (a no-op once the spool was emptied since)."""
        with self._lock:
            if at.generation == self.generation:
                self._free.extend(at.slots)

    def reset(self) -> None:
        """A new step: every slot free, the file emptied; a `Spooled` of before reads no more."""
        with self._lock:
            self.generation += 1
            self._free.clear()
            self._slots = 0
            if self._file is not None:
                self._file.truncate(0)


@dataclass(frozen=True)
class EvalArrived:
    """A device's scores for an evaluate or finetune step (final or progress)."""

    result: EvalResult


@dataclass(frozen=True)
class SecAggArrived:
    """A device's answer to one stage of a secure round ([secagg]), with its size in bytes."""

    device: str
    message: SecAggMessage
    size: int


Event: TypeAlias = StatusArrived | UpdateArrived | EvalArrived | SecAggArrived


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
    (`collect`) from the device that owns the client (`open`).

    Everything a device login can make the coordinator hold is bounded per device: the network
    thread's bytes and CPU (budget.py; a message over its topic's size is refused unread, and a
    refused message is never parsed again), partial update frames (the frame pool's per-sender
    bytes), complete frames waiting to be folded in (`frame_cap`: memory and spool file
    together; a dropped frame gives its room back at once), queued events (`queue_share`) and
    per-name bookkeeping (names outside the fleet: MAX_STRANGERS, the oldest forgotten)."""

    def __init__(self, topics: Topics, run_id: str,
                 on_junk: Callable[[str], None] = lambda topic: None):
        self.topics = topics
        self.run_id = run_id
        self.queue: queue.Queue[Event] = queue.Queue(MAX_EVENTS)
        self.collecting = -1  # the step whose answers are being collected; others are late
        # an asynchronous run: updates answering any step from this one on are taken (each
        # answers the step that dispatched its client), whatever step is being collected
        self.async_from = -1
        self.late = 0
        self.late_evals = 0
        self.arrivals = 0  # answers (update chunks, evaluations) of the step being collected
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
        self._present: set[str] = set()  # devices whose latest status says online
        #: device -> why its latest status could not be read (an announcement out of bounds,
        #: say): the gathering of a run leaves it out at once with that line
        self.unreadable: dict[str, str] = {}
        self._lock = threading.Lock()
        self._queued: dict[tuple[str, int, object], int] = {}
        self._held: dict[str, int] = {}  # device -> its events waiting in the queue
        self._frame_bytes: dict[str, int] = {}  # device -> bytes of its complete frames waiting
        self._frames_of = -1  # the step `_frame_bytes` counts
        self._warned: dict[str, tuple[float, int]] = {}  # device -> (minute began, lines logged)
        self.budgets = LoginBudgets(time.monotonic)
        self.flooded = 0  # messages dropped unread: their device spent its bytes or CPU
        self.dropped = 0
        # device -> the distinct stacks it described (DeviceInfo), with when each was first seen
        self._stacks: dict[str, list[tuple[float, DeviceInfo]]] = {}
        self.on_junk = on_junk
        #: told of every message dropped unread for its login's spent budget (guard.py)
        self.on_flood: Callable[[str], None] = lambda device: None
        #: the train step whose secure stages are taken, and its graph's largest degree
        self.secure_seq, self.secure_degree = -1, 0
        self.open({}, 0)

    def open(self, owner: dict[int, str], update_bytes: int, update_tensors: int | None = None
             ) -> None:
        """A run opens: `owner` maps client -> the device that holds it, and an update frame is
        at most `update_bytes` bytes (every shared block's deltas). A device may then have
        (its clients + 1) frames partly arrived, and as many complete ones waiting; its budget
        grows with its clients and their updates."""
        self.owner = dict(owner)
        #: tensors an update frame holds at most (None: unchecked), checked before it is decoded
        self.update_tensors = update_tensors
        self._clients = Counter(owner.values())  # device -> clients: read for every message
        self.fleet = frozenset(self._clients)
        if self.fleet:
            with self._lock:  # only the fleet's presence matters from now on
                self._present &= self.fleet
        self.update_bytes = update_bytes
        most = max(self._clients.values(), default=0)
        #: messages one update frame takes at most
        self.update_chunks = max(1, -(-update_bytes // CHUNK_BYTES))
        self.frames = FramePool(max_frame=max(1, update_bytes),
                                per_sender=max(1, update_bytes) * (most + 1),
                                spill=self.spool.spill_chunk, budget=HELD_IN_MEMORY)
        self._allowance: dict[int, Allowance] = {}
        self.budgets = LoginBudgets(self.budgets.clock)  # every device starts with its new burst
        self._prune()

    def frame_cap(self, device: str) -> int:
        """Bytes of complete update frames `device` may have waiting to be folded in (memory and
        spool file together): one whole update per client it holds, and one more."""
        return self.update_bytes * (self._clients[device] + 1)

    def allowance(self, device: str) -> Allowance:
        """What `device` may spend of the network thread (budget.py), from its clients."""
        mine = self._clients[device]
        a = self._allowance.get(mine)
        if a is None:
            a = self._allowance[mine] = allowance(mine, self._wire_update() if mine else 0)
        return a

    def expect(self, clients: list[int] | None) -> None:
        """A step goes out that asks `clients` (None: every client) for an answer: each device
        holding some of them is granted, on top of its buckets, what those answers take (an
        update frame and an evaluation a client, at CPU_PER_UPDATE_BYTE, a status and an
        evaluation's base), so an honest device is never dropped at any round pace."""
        asked = Counter(self.owner[c] for c in (self.owner if clients is None else clients)
                        if c in self.owner)
        wire = self._wire_update()
        for device, n in asked.items():
            self.budgets.grant(device, self.allowance(device),
                               n * (wire + EVAL_BYTES_PER_CLIENT + MESSAGE_BYTES)
                               + EVAL_BYTES_BASE + STATUS_BYTES + 2 * MESSAGE_BYTES,
                               n * (wire * CPU_PER_UPDATE_BYTE + STEP_CPU_PER_CLIENT) + STEP_CPU)

    def _wire_update(self) -> int:
        """An update as its chunk messages cost a device: data, each chunk's header and
        overhead."""
        return self.update_bytes + self.update_chunks * (
            CHUNK_MESSAGE_BYTES - CHUNK_BYTES + MESSAGE_BYTES)

    def subscriptions(self) -> list[str]:
        """The topics the coordinator subscribes to: the devices' statuses, descriptions, updates,
        evaluations and secure-sum stages."""
        t = self.topics
        return [t.device_status(), t.device_info(), t.update(), t.evaluation(), t.secagg()]

    def secure(self, seq: int, degree: int = 0) -> None:
        """Take the stages of step `seq`'s secure round (-1: none), whose clients have at most
        `degree` neighbours (what bounds a stage message's size)."""
        self.secure_seq, self.secure_degree = seq, degree

    def takes_update(self, seq: int) -> bool:
        """Whether an update answering step `seq` is taken now."""
        return seq == self.collecting or 0 <= self.async_from <= seq

    def collect_async(self, seq: int) -> None:
        """An asynchronous run's updates from step `seq` on (-1: that part is over): they answer
        the step that dispatched their client, across the steps published meanwhile. Called
        again as the oldest dispatch in flight moves on: older answers are late, and their
        per-step counts go."""
        if seq < 0 or self.async_from < 0:
            self.async_from = -1
            self.collect(seq)
        self.async_from = seq
        with self._lock:
            self._queued = {k: n for k, n in self._queued.items() if k[1] >= seq}

    def collect(self, seq: int) -> None:
        """Accept answers (updates, evaluations) of step `seq` from now on (-1: none); partial
        frames and the per-step counts of other steps go (not an asynchronous run's updates,
        which answer earlier steps)."""
        self.collecting = seq
        if self.async_from >= 0:
            return
        self.frames.expire(lambda sender, tag: tag[1] == seq)
        with self._lock:
            if seq >= 0:  # the previous step's updates are all folded in or dropped
                self.spool.reset()
                self._frame_bytes.clear()
                self._frames_of = seq
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

    def in_memory(self, update: ClientUpdate, ev: UpdateArrived) -> ClientUpdate:
        """`update` (`ev`'s, or a copy of it) with its deltas in memory: read back from the spool
        file where `ev`'s frame waits there."""
        if ev.spooled is None:
            return update
        return dataclasses.replace(update, deltas=decode_tensors(
            self.spool.read(ev.spooled), copy=False, check_finite=False))

    def release(self, ev: UpdateArrived) -> None:
        """Coordinator thread: done with `ev`'s frame (folded in, refused or too late): its room in
        memory, in the spool file and in its device's share is free."""
        self.spool.release(ev.held)
        size = ev.held
        if ev.spooled is not None:
            self.spool.free(ev.spooled)
            size = ev.spooled.size
        with self._lock:
            if ev.seq == self._frames_of or self.async_from >= 0:
                # (an older step's frames were forgotten with it, not an asynchronous run's)
                left = self._frame_bytes.get(ev.device, 0) - size
                if left > 0:
                    self._frame_bytes[ev.device] = left
                else:
                    self._frame_bytes.pop(ev.device, None)

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

    def _member(self, name: str) -> bool:
        """Whether `name` is one of the run's devices (before a run opens: one that says it is
        online)."""
        return name in self.fleet if self.fleet else name in self._present

    def _room_for(self, name: str) -> bool:
        """Whether a status of `name` is kept (lock held): a run's fleet member's always, any
        other's while a run is open only for a name already waiting; before a run opens, the
        names that say online up to MAX_PRESENT (an open broker lets anyone invent names)."""
        if self.fleet:
            return name in self.fleet
        return name in self._present or len(self._present) + len(self._status) < MAX_PRESENT

    def _prune(self) -> None:
        """Forget the oldest names outside the fleet beyond MAX_STRANGERS (an open broker lets
        anyone invent device names; their bookkeeping must not grow with them)."""
        names = self.budgets.logins()
        strangers = [n for n in names if not self._member(n)]
        if len(strangers) <= MAX_STRANGERS:
            return
        with self._lock:
            for name in strangers[:len(strangers) - MAX_STRANGERS // 2]:
                self.budgets.forget(name)
                self._warned.pop(name, None)
                self.heard.pop(name, None)
                self._stacks.pop(name, None)
                if not self._held.get(name):
                    self._held.pop(name, None)

    def on_message(self, topic: str, payload: bytes) -> None:
        """Network thread: one message in, at most one event out; anything invalid is logged
        with its reason and dropped. A message is read only within its device's budget (bytes
        and this thread's CPU) and its topic's size; then its CPU time is charged. An empty
        message (a retained one cleared) is charged like any other, then ignored: it costs the
        thread as much as a small one, so a flood of them is dropped and counted alike; every
        message read is charged the thread's CPU from its arrival, an empty one too."""
        began = thread_seconds()
        ref = self.topics.parse(topic)
        device = ref.device if ref is not None else ""
        if ref is not None and device:
            if not self.budgets.known(device) and not self._member(device):
                self._prune()  # a new name: strangers' bookkeeping stays bounded
            if not self.budgets.admit(device, len(payload), self.allowance(device)):
                self.flooded += 1
                self.on_flood(device)
                a = self.allowance(device)
                self._warn(device, "dropped messages from %s unread: it sends more than a device "
                           "needs (%.0f KiB and %.0f ms of the coordinator at once, %.0f KiB/s "
                           "and %.0f ms/s)", device, a.burst_bytes / 1024, a.burst_cpu * 1e3,
                           a.rate_bytes / 1024, a.rate_cpu * 1e3)
                return
        try:
            if payload:
                self._read(ref, topic, payload)
        except FedseqError as exc:
            if ref is not None and ref.kind in ("update", "eval", "secagg"):
                self.on_junk(topic)
            if ref is not None and ref.kind == "device_status":
                with self._lock:
                    if device in self.unreadable or len(self.unreadable) < MAX_PRESENT:
                        self.unreadable[device] = printable(str(exc), 300)
            hint = (f" (it speaks protocol v{exc.version}, this coordinator v{PROTOCOL_VERSION}: "
                    "install the same fedseq version on both sides)"
                    ) if isinstance(exc, PeerVersion) else ""
            self._warn(device, "dropped message on %s: %s%s", topic, str(exc), hint)
        finally:
            if device:
                self.budgets.spent(device, thread_seconds() - began)

    def _read(self, ref: TopicRef | None, topic: str, payload: bytes) -> None:
        if ref is None:
            raise ProtocolError("not a topic the coordinator reads")
        limit = self._largest(ref.kind, ref.device)
        if len(payload) > limit:  # refused before parsing: never allocated as objects
            raise ProtocolError(f"{ref.kind} message of {len(payload)} bytes; {ref.device} may "
                                f"send at most {limit} there")
        if ref.kind == "device_status":
            status = DeviceStatus.decode(payload)
            _same_device(status.device, ref.device)
            with self._lock:  # coalesced: the latest status waits, its event only wakes up
                self.unreadable.pop(status.device, None)
                fresh = status.device not in self._status
                if fresh and not self._room_for(status.device):
                    return  # a name outside the run's fleet (or past MAX_PRESENT): not kept
                self._status[status.device] = status
                if status.state == "online":
                    self._present.add(status.device)
                else:
                    self._present.discard(status.device)
            if fresh:
                self._put(StatusArrived(status.device))
        elif ref.kind == "device_info":
            info = DeviceInfo.decode(payload)
            _same_device(info.device, ref.device)
            with self._lock:  # a new entry only when the stack changed (a reboot, an upgrade)
                seen = self._stacks.setdefault(info.device, [])
                if not seen or seen[-1][1] != info:
                    if len(seen) == STACKS_PER_DEVICE:
                        seen.pop()
                    seen.append((time.time(), info))
        elif ref.kind == "eval":
            res = EvalResult.decode(payload)
            _same_device(res.device, ref.device)
            if res.run_id != self.run_id:
                raise ProtocolError(f"evaluation for run {res.run_id}, this is {self.run_id}")
            if res.seq != self.collecting:
                self.late_evals += 1
                return  # a step that is over (or never was): nothing waits for it
            self.arrivals += 1
            self._put(EvalArrived(res), ("eval", res.seq, res.device),
                      EVALS_PER_CLIENT * (self._clients[ref.device] + 1))
        elif ref.kind == "update":
            self._on_update_chunk(ref.device, payload)
        elif ref.kind == "secagg":
            msg = SecAggMessage.decode(payload)
            _same_device(msg.device, ref.device)
            if msg.run_id != self.run_id:
                raise ProtocolError(f"secure stage for run {msg.run_id}, this is {self.run_id}")
            if msg.seq != self.secure_seq:
                return  # a secure round that is over (or never was): nothing waits for it
            self._put(SecAggArrived(ref.device, msg, len(payload)),
                      ("secagg", msg.seq, (ref.device, msg.stage)), 2)
        else:
            raise ProtocolError("not a topic the coordinator reads")
        if ref.kind != "device_info":  # a retained description says nothing of presence
            self.heard[ref.device] = time.monotonic()

    def _largest(self, kind: str, device: str) -> int:
        """The largest message `device` may send on a topic of `kind`: a status or description
        is a few hundred bytes, an evaluation a few dozen per client, an update chunk 1 MiB."""
        if kind == "update":
            if not self._clients[device]:
                raise ProtocolError(f"{device} holds no client of this run: no update expected")
            return CHUNK_MESSAGE_BYTES
        if kind == "eval":
            return EVAL_BYTES_BASE + EVAL_BYTES_PER_CLIENT * self._clients[device]
        if kind == "secagg":
            if self.secure_seq < 0 or not self._clients[device]:
                raise ProtocolError(f"no secure round is under way for {device}")
            return SECAGG_BYTES_BASE + SECAGG_BYTES_PER_PAIR * self._clients[device] * (
                self.secure_degree + 1)
        return STATUS_BYTES

    def _on_update_chunk(self, device: str, payload: bytes) -> None:
        head, data = unpack_chunk(payload, UpdateHeader)
        _same_device(head.device, device)
        if head.run_id != self.run_id:
            raise ProtocolError(f"update for run {head.run_id}, this is {self.run_id}")
        if self.owner.get(head.client) != device:
            raise ProtocolError(f"client {head.client} is not assigned to {device}")
        if not self.takes_update(head.seq):
            if head.chunk == 0:
                self.late += 1
                self._warn(device, "late update of client %d from %s dropped: step %d, "
                           "collecting step %d", head.client, device, head.seq, self.collecting)
            return
        self.arrivals += 1
        with self._lock:
            waiting = self._frame_bytes.get(device, 0)
        if head.chunks > 1 and waiting + head.size > self.frame_cap(device):
            # (checked before the frame's chunks are kept: a device with its share waiting
            # cannot make the coordinator hold more; a one-chunk frame is checked once whole)
            raise ProtocolError(f"{device} has {waiting} bytes of updates waiting to be folded "
                                f"in (limit {self.frame_cap(device)}); chunk dropped")
        frame = self.frames.add(device, (head.client, head.seq), head, data)
        if frame is None:
            return
        deltas = decode_tensors(frame, copy=False, check_finite=False,  # the contract checks values
                                max_tensors=self.update_tensors)
        with self._lock:
            waiting = self._frame_bytes.get(device, 0)
            if waiting + len(frame) > self.frame_cap(device):
                raise ProtocolError(f"{device} has {waiting} bytes of updates waiting to be "
                                    f"folded in (limit {self.frame_cap(device)}); frame dropped")
            self._frame_bytes[device] = waiting + len(frame)
        held, spooled = self.spool.hold(frame)
        if spooled is not None:  # (decoded all the same: a malformed frame is refused now)
            deltas = {}
        update = head.to_update(deltas, device, device_cost(head))
        event = UpdateArrived(device, head.seq, update, held, spooled)
        if not self._put(event, ("update", head.seq, head.client), UPDATES_PER_CLIENT):
            self.release(event)
