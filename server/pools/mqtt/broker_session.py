"""The coordinator's broker session: one connection, the retained state it owns, and presence.

The broker's retained messages are only a cache (a restarted broker may have lost them): whatever
a device needs to (re)join is kept here and published again after every (re)connect, the current
step last, once the blocks it needs are there. Presence is applied on the coordinator's thread
from the devices' retained statuses: who is online, and who said it cannot run a step and why.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeAlias

from fedseq.common.errors import TransportError
from fedseq.common.protocol.link import Link, TlsOptions, session_id
from fedseq.common.protocol.messages import DeviceStatus, ServerStatus
from fedseq.common.protocol.topics import Topics
from fedseq.common.text import printable
from fedseq.server.pools.mqtt.inbox import (
    EvalArrived,
    Inbox,
    SecAggArrived,
    StatusArrived,
    UpdateArrived,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceOffline:
    """A device went offline (its last will, or a clean stop)."""

    device: str


@dataclass(frozen=True)
class StepFailed:
    """A device said it cannot run step `seq` (-1: any step of this run), and why."""

    device: str
    seq: int | None
    reason: str


SessionEvent: TypeAlias = (UpdateArrived | EvalArrived | SecAggArrived | DeviceOffline
                            | StepFailed)


class WaitShares:
    """Each participant's share of deploy.wait_devices_s over a whole run (a device's, or a
    site's edge aggregator's), spent only while the run waits for it: one gone for good costs one
    wait, and one that goes offline before every step and comes back after it (flapping) costs
    no more."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self.left: dict[str, float] = {}

    def waitable(self, absent: Iterable[str]) -> set[str]:
        """Those of `absent` whose share is not spent."""
        return {a for a in absent if self.left.get(a, self.wait_s) > 0}

    def most(self, who: Iterable[str]) -> float:
        """The longest share left of `who`."""
        return max((self.left.get(a, self.wait_s) for a in who), default=0.0)

    def wait(self, missing: Callable[[], set[str]], enough: Callable[[], bool],
             poll: Callable[[float], object]) -> float:
        """`poll` (half a second at a time) until `enough()`, each wait charged to those
        `missing()` then; the seconds waited."""
        began = last = time.monotonic()
        while not enough():
            poll(0.5)
            now = time.monotonic()
            for a in missing():
                self.left[a] = self.left.get(a, self.wait_s) - (now - last)
            last = now
        return time.monotonic() - began


class ServerSession:
    """Connects first (`start`), so a broker problem is known before the dataset is loaded."""

    def __init__(self, topics: Topics, run_id: str, url: str,
                 username: str | None = None, password: str | None = None,
                 tls: TlsOptions | None = None):
        self.topics = topics
        self.run_id = run_id
        # what the devices write, as typed events; an invalid message on a device-written topic
        # is cleared here in case it was retained
        self.inbox = inbox = Inbox(topics, run_id, on_junk=self._clear)
        self.online: dict[str, DeviceStatus] = {}
        self.incompatible: dict[str, str] = {}  # device -> why it cannot run any step of this run
        # each device's share of deploy.wait_devices_s over the whole run (await_devices)
        self.shares = WaitShares(0.0)
        self._lock = threading.Lock()
        self._retained: dict[str, bytes] = {}
        self._republish_blocks: Callable[[], int] = lambda: 0
        will = ServerStatus(state="offline", run_id=run_id).encode()
        owned = [topics.run_config, topics.assignment(), topics.step]
        self.link = Link(session_id("fedseq-server"), url, inbox.subscriptions() + owned,
                         self._on_message,
                         will=(topics.server_status, will), username=username, password=password,
                         tls=tls, on_retained=self._retained_seen)
        self.link.on_connect(self._republish)
        self.cleared = 0  # retained messages removed from device-written topics
        self._wire_seen = (0, 0)
        # What this session published on the topics it owns (a digest per payload, the last few
        # per topic): anything else seen there is a stray publisher's, and is overwritten.
        self._mine: dict[str, list[bytes]] = {}
        # until then (monotonic), silence proves nothing: answers went missing on the broker's
        # queue to this coordinator (collect.Resender asked again), and heartbeats with them
        self.lossy_until = 0.0
        self._restored_at: dict[str, list[float]] = {}
        # an asynchronous run's updates that arrived while an evaluation was collected: the
        # driver takes them first when it collects updates again (MqttPool.async_events)
        self.stashed: list[SessionEvent] = []

    def start(self) -> None:
        """Connect to the broker (three attempts) and start the network thread."""
        self.link.start(attempts=3)

    def republish_blocks_with(self, publish: Callable[[], int]) -> None:
        """Who re-publishes the weight blocks after a reconnect (returns how many)."""
        self._republish_blocks = publish

    def retain(self, topic: str, payload: bytes) -> None:
        """Publish retained and keep it for every reconnect."""
        with self._lock:
            self._retained[topic] = payload
            mine = self._mine.setdefault(topic, [])
            mine.append(hashlib.sha256(payload).digest())
            del mine[:-8]
        self.link.publish(topic, payload, retain=True)

    def clear_retained(self) -> None:
        """The run is over: remove what this session retained (run config, assignments, step)
        from the broker, so a daemon started later finds no finished run to follow."""
        with self._lock:
            topics = list(self._retained)
            self._retained.clear()
        for topic in topics:
            self.link.publish(topic, b"", retain=True)

    def _retained_seen(self, topic: str) -> None:
        """Network thread: devices never publish updates or evaluations retained; one that did
        (junk the broker would keep, persist and replay on every subscribe) is removed."""
        ref = self.topics.parse(topic)
        if ref is not None and ref.kind in ("update", "eval", "secagg"):
            self._clear(topic)

    def _clear(self, topic: str) -> None:
        """Remove whatever the broker retains on a device-written update or evaluation topic (an
        empty retained message; nothing happens where nothing is retained)."""
        self.cleared += 1
        if self.cleared in (1, 10, 100, 1000) or self.cleared % 10000 == 0:
            log.warning("cleared %d retained or invalid messages on device topics (latest %s)",
                        self.cleared, topic)
        self.link.publish(topic, b"", retain=True)

    def _on_message(self, topic: str, payload: bytes) -> None:
        """Network thread: the devices' topics go to the inbox; on the topics this session owns
        (run config, assignments, step) a message it did not publish is a stray client's on an
        open broker (or another coordinator on the same topic root): its own retained copy is
        published again (at most 10 times a minute per topic: two coordinators on one
        topic root must not flood the broker), so a device that (re)connects reads the
        run's real state."""
        ref = self.topics.parse(topic)
        if ref is not None and ref.kind in ("weights", "server_status", "campaign", "control"):
            # topics this session writes and never subscribes to: amqtt 0.12 replays the retained
            # messages of every client's subscriptions to each client that connects (its
            # broker.py, after CONNACK), e.g. the blocks of the run before on a campaign's broker
            return
        if ref is None or ref.kind not in ("run_config", "assignment", "step"):
            self.inbox.on_message(topic, payload)
            return
        with self._lock:
            ours = self._retained.get(topic)
            known = hashlib.sha256(payload).digest() in self._mine.get(topic, ())
            now = time.monotonic()
            recent = [t for t in self._restored_at.get(topic, []) if now - t < 60.0]
            if ours is None or known or len(recent) >= 10:
                return
            self._restored_at[topic] = recent + [now]
        log.warning("a message on %s was not published by this coordinator (a stray client, or "
                    "another coordinator with deploy.topic_root=%r); re-publishing the run's own",
                    topic, self.topics.root)
        self.link.publish(topic, ours, retain=True)

    def _republish(self) -> None:
        """Network thread, after every (re)connect: server status, run config, assignments, the
        current version of every block and the current step, all retained."""
        status = ServerStatus(state="online", run_id=self.run_id, broker=self.link.url).encode()
        self.link.publish(self.topics.server_status, status, retain=True)
        with self._lock:
            retained = dict(self._retained)
        for topic, payload in retained.items():
            if topic != self.topics.step:
                self.link.publish(topic, payload, retain=True)
        blocks = self._republish_blocks()
        if self.topics.step in retained:  # last: a device acts on it once it holds the weights
            self.link.publish(self.topics.step, retained[self.topics.step], retain=True)
        if retained:
            log.info("re-published the run's state (%d blocks) after connecting", blocks)

    def wire_bytes(self) -> tuple[int, int]:
        """Payload bytes this connection published and received since the last call."""
        out, got = self.link.bytes_out, self.link.bytes_in
        before = self._wire_seen
        self._wire_seen = (out, got)
        return out - before[0], got - before[1]

    # -- presence (coordinator thread) -----------------------------------------------------
    def drain(self, timeout: float) -> list[SessionEvent]:
        """Apply status events to presence; return the events that arrived within `timeout`
        (a device going offline or failing a step among them)."""
        out: list[SessionEvent] = []
        ev = self.inbox.next_event(timeout)
        while ev is not None:
            if isinstance(ev, StatusArrived):
                for status in self.inbox.take_statuses():
                    out.extend(self._presence(status))
            elif isinstance(ev, UpdateArrived) and not self.inbox.takes_update(ev.seq):
                self.inbox.release(ev)  # of a step that is over: nobody will take it
            else:
                out.append(ev)
            ev = self.inbox.next_event(0.0)
        for status in self.inbox.take_statuses():  # one whose wake-up found the queue full
            out.extend(self._presence(status))
        out.extend(self._silent())
        return out

    def _silent(self) -> list[SessionEvent]:
        """Devices not heard from for three heartbeats: gone, whatever their retained status says
        (a device that died while the broker was down never had its last will published); not
        while messages to this coordinator are being lost (`lossy_until`): a storm of a large
        fleet's updates overflowing the broker's queue drops heartbeats too."""
        now = time.monotonic()
        gone: list[SessionEvent] = []
        if now < self.lossy_until:
            return gone
        for device, st in list(self.online.items()):
            quiet = now - self.inbox.heard.get(device, now)
            if quiet > 3 * st.heartbeat_s:
                log.warning("no message from %s for %.0f s (3 heartbeats): treating it as offline "
                            "until it speaks again", device, quiet)
                del self.online[device]
                gone.append(DeviceOffline(device))
        return gone

    def _presence(self, st: DeviceStatus) -> list[SessionEvent]:
        if self.inbox.fleet and st.device not in self.inbox.fleet:
            return []  # a run is open: only its devices' presence matters (and is kept)
        if st.state != "online":
            self.online.pop(st.device, None)
            return [DeviceOffline(st.device)]
        known = self.online.get(st.device)
        self.online[st.device] = st
        if not (st.error_seq == -1 and st.error_run_id == self.run_id):
            self.incompatible.pop(st.device, None)  # it could follow the run after all
        fresh = known is None or (known.error_seq, known.error) != (st.error_seq, st.error)
        if not (st.error and st.error_run_id == self.run_id and fresh):
            return []
        reason = printable(st.error, 300)  # a device's words: one plain line in logs and rows
        if st.error_seq == -1:  # it cannot run any step of this run
            self.incompatible[st.device] = reason
        return [StepFailed(st.device, st.error_seq, reason)]

    def wait_for_devices(self, minimum: int, timeout: float) -> list[str]:
        """Block until `minimum` devices are online (TransportError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while len(self.online) < minimum:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(
                    f"only {len(self.online)} of deploy.min_devices={minimum} devices came online "
                    f"within {timeout:.0f} s ({', '.join(sorted(self.online)) or 'none'}); start "
                    "fedseq-client on the devices with this broker URL, or lower deploy.min_devices"
                )
            self.drain(min(left, 0.5))
        time.sleep(0.5)  # let devices that connect together all announce themselves
        self.drain(0.01)
        return sorted(self.online)

    def await_devices(self, assigned: set[str], minimum: int, wait_s: float) -> None:
        """Before a step: after a broker restart or a network drop, devices come back within
        seconds; wait for `minimum` of the assigned ones instead of failing the step (their
        events while waiting only update presence), each within its share of `wait_s`
        (`WaitShares`: a device whose share is spent is not waited for again)."""
        self.set_aside(self.drain(0.0))
        self.shares.wait_s = wait_s

        def missing() -> set[str]:
            return self.shares.waitable(assigned - set(self.online))

        def enough() -> bool:
            waitable = len(assigned & set(self.online)) + len(missing())
            return len(assigned & set(self.online)) >= min(minimum, waitable)

        if enough():
            return
        log.warning("waiting up to %.0f s for devices: %d of %d assigned online (%s missing)",
                    self.shares.most(missing()), len(assigned & set(self.online)), len(assigned),
                    ", ".join(sorted(missing())))
        took = self.shares.wait(missing, enough, lambda s: self.set_aside(self.drain(s)))
        spent = sorted(assigned - set(self.online) - missing())
        if not spent:
            time.sleep(0.5)  # let the others that reconnect together announce themselves
            self.set_aside(self.drain(0.0))
        log.warning("waited %.1f s for devices; continuing with %d online%s", took,
                    len(assigned & set(self.online)),
                    f"; not waiting again this run for {', '.join(spent)} (its share of "
                    f"deploy.wait_devices_s={wait_s:.0f} is spent)" if spent else "")

    def set_aside(self, events: list[SessionEvent]) -> None:
        """Events that came while something else was awaited (presence, an evaluation): an
        asynchronous run's updates and lost devices wait in `stashed` for its driver; otherwise
        an update is late (dropped)."""
        for ev in events:
            if self.inbox.async_from >= 0 and not isinstance(ev, EvalArrived):
                self.stashed.append(ev)
            elif isinstance(ev, UpdateArrived):
                self.inbox.release(ev)

    def close(self, goodbye: Callable[[], None]) -> None:
        """Run `goodbye` (the last retained messages) if still connected, say offline, then
        disconnect; never raises (it runs in a `finally` and must not mask the run's error)."""
        try:
            if self.link.connected.is_set():
                goodbye()
                self.link.publish(self.topics.server_status,
                                  ServerStatus(state="offline", run_id=self.run_id), retain=True,
                                  wait=True)
        except Exception as exc:  # best effort on the way out
            log.warning("could not say goodbye to the broker: %s", exc)
        finally:
            self.link.stop()
