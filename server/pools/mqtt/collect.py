"""Collecting a step's answers from the fleet, and how long to wait for them."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Generator, Iterator

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.config import DeployConfig
from fedseq.common.protocol.messages import HEARTBEAT_S, Control, EvalResult
from fedseq.server.pools.mqtt.broker_session import DeviceOffline, ServerSession, StepFailed
from fedseq.server.pools.mqtt.inbox import HELD_IN_MEMORY, EvalArrived, UpdateArrived, plausible
from fedseq.server.pools.mqtt.secure_relay import SecureStages
from fedseq.server.rounds.pool_api import (
    FinetuneOutcome,
    Progress,
    RoundOutcome,
    ScoreCheck,
    UpdateCheck,
)

log = logging.getLogger(__name__)

#: the most power a device can draw (a desktop GPU and its host): what a device says its
#: clients' work cost in joules is kept only while its step's claims stay below this many watts
#: times the seconds since the step went out (informational figures; one device's made-up
#: joules must not dominate the fleet's totals)
MAX_DEVICE_W = 1000.0


#: nothing of a step's answers arrived for this many seconds while some are owed: the
#: coordinator asks their devices to send what they have sent already again (Control resend):
#: a broker drops QoS 1 messages beyond a client's queue silently, and a burst of a large fleet's
#: updates can overflow the coordinator's. The wait doubles after each ask that brought nothing,
#: up to RESEND_MAX_S; a device still working ignores an ask.
RESEND_QUIET_S, RESEND_MAX_S = 2.0, 60.0
#: once an ask has brought answers back (they had been lost, not late), the next batch is asked
#: for after this much silence
RESEND_LOSSY_S = 0.5
#: messages one ask may bring back at once, well inside a broker's queue for one client
#: (broker.conf: max_queued_messages 1000): the owed clients are asked for in batches
RESEND_MESSAGES = 400


class Resender:
    """When and for whom a step's collection asks for answers again (see RESEND_QUIET_S)."""

    def __init__(self, session: ServerSession, seq: int, messages_per_client: int):
        self.session, self.seq = session, seq
        self.batch = max(1, RESEND_MESSAGES // max(1, messages_per_client))
        self.wait = RESEND_QUIET_S
        self.last = time.monotonic()  # the last arrival or ask
        self.seen = session.inbox.arrivals
        self.asked_at = -1e9
        self.lossy = False  # an ask of this step brought lost answers back

    def poll(self, owed: list[int]) -> None:
        """After each drain: note arrivals; ask for the first `batch` of `owed` (in client order)
        once nothing has arrived for `wait` seconds."""
        now = time.monotonic()
        arrivals = self.session.inbox.arrivals
        if arrivals != self.seen:
            if now - self.asked_at < 1.0:
                # answers right after an ask that followed silence: they had been lost, not
                # late, and heartbeats may have been lost with them (ServerSession._silent)
                self.session.lossy_until = now + 3 * HEARTBEAT_S
                self.lossy = True
            self.wait = RESEND_LOSSY_S if self.lossy else RESEND_QUIET_S
            self.seen, self.last = arrivals, now
            return
        if not owed or now - self.last < self.wait:
            return
        ask = owed[:self.batch]
        self.session.link.publish(self.session.topics.control, Control(
            run_id=self.session.run_id, command="resend", seq=self.seq, clients=ask))
        log.info("step %d: nothing arrived for %.0f s; asked the devices of %d clients (of %d "
                 "owed) to send their answers again", self.seq, now - self.last, len(ask),
                 len(owed))
        self.asked_at = now
        self.last, self.wait = now, min(2 * self.wait, RESEND_MAX_S)


def few(items: list, shown: int = 20) -> str:
    """The first `shown` items and how many more: a log line stays short in a fleet of 1,000."""
    more = f" (+{len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(str(i) for i in items[:shown]) + more


def plausible_joules(claimed: dict[str, float], device: str, joules: float, seconds: float) -> bool:
    """Whether `device` may add `joules` to what it `claimed` in this step, `seconds` after the
    step went out (and if so, it is added)."""
    if claimed.get(device, 0.0) + joules > MAX_DEVICE_W * max(seconds, 1.0):
        return False
    claimed[device] = claimed.get(device, 0.0) + joules
    return True


class DeadlinePolicy:
    """deploy.round_timeout_s if set; else factor x the time the round's slowest device needs at
    its measured pace (seconds per client x its clients this round), clamped to [min, max], and
    max while a device of the round is unmeasured.

    One device cannot stretch or lock it: with three or more devices in a round the slowest one
    is left out (a device that answers just before every deadline would otherwise grow it to the
    ceiling; a genuinely slow one then misses rounds, which the round's row records), and every
    device is re-measured every round, also one that missed the deadline: its (m+1)-th client was
    not done after the deadline, so its pace is at least deadline / (m+1)."""

    def __init__(self, cfg: DeployConfig):
        self.cfg = cfg
        self.pace: dict[str, float] = {}  # device -> seconds per client, last round measured

    def deadline(self, load: dict[str, int]) -> float:
        """Seconds to wait for a round whose devices hold `load` (device -> clients) clients."""
        d = self.cfg
        if d.round_timeout_s is not None:
            return d.round_timeout_s
        if not load or any(dev not in self.pace for dev in load):
            return d.round_timeout_max_s
        needs = sorted(self.pace[dev] * n for dev, n in load.items())
        if len(needs) >= 3:
            needs.pop()  # the slowest device does not set everyone's deadline
        return min(max(d.round_timeout_factor * needs[-1], d.round_timeout_min_s),
                   d.round_timeout_max_s)

    def measured(self, device: str, clients: int, seconds: float) -> None:
        """A device delivered all its `clients` updates `seconds` after the step went out."""
        self.pace[device] = seconds / clients

    def missed(self, device: str, delivered: int, deadline: float) -> None:
        """A device delivered `delivered` of its clients before the deadline, not all."""
        self.pace[device] = max(self.pace.get(device, 0.0), deadline / (delivered + 1))


def device_load(clients: list[int], owner: dict[int, str]) -> dict[str, int]:
    """Device -> how many of `clients` it holds (what its deadline is measured against)."""
    load: dict[str, int] = {}
    for c in clients:
        if c in owner:
            load[owner[c]] = load.get(owner[c], 0) + 1
    return load


def collect_updates(session: ServerSession, seq: int, round: int, clients: list[int],
                    owner: dict[int, str], check: UpdateCheck, policy: DeadlinePolicy,
                    chunks: int = 1, enough: int | None = None, stages: SecureStages | None = None
                    ) -> Generator[ClientUpdate, None, RoundOutcome]:
    """The valid updates of step `seq`, in client order as soon as they can be folded in (the
    same order as the simulation: bitwise parity), until every selected client answered, failed
    or went offline with its device, or the deadline passed, or (over-selection) `enough` valid
    updates came: the clients still owing one are then cancelled (their updates will be late).
    `chunks`: messages per update (what one client's resend costs the broker's queue).
    `stages`: a secure round's, whose key stages run first (within the round's deadline)."""
    if stages is not None:
        stages.share_keys(policy.deadline(device_load(clients, owner)))
    step = _TrainStep(session, seq, round, clients, owner, check, policy)
    if stages is not None:
        for ev in stages.held:  # a device that failed meanwhile
            step.take(ev)
        step.owing &= stages.sharing()  # a client out of the secure round sends no input
    again = Resender(session, seq, chunks)
    while step.owing and time.monotonic() < step.deadline and \
            (enough is None or len(step.arrived) < enough):
        for ev in session.drain(min(1.0, step.deadline - time.monotonic())):
            step.take(ev)
        again.poll(sorted(step.owing))
        yield from step.ready()
    if enough is not None and len(step.arrived) >= enough and step.owing:
        step.outcome.cancelled = sorted(step.owing)
        step.owing.clear()  # not late for the deadline: not waited for
    outcome = step.close()
    yield from step.ready()  # those that waited for a client that never came
    return outcome


class _TrainStep:
    """One training step's collection: who still owes an update, the valid updates not yet
    handed on in client order, and what the step's outcome records."""

    def __init__(self, session: ServerSession, seq: int, round: int, clients: list[int],
                 owner: dict[int, str], check: UpdateCheck, policy: DeadlinePolicy):
        self.session, self.seq, self.round, self.check = session, seq, round, check
        self.clients, self.owner, self.policy = clients, owner, policy
        self.outcome = RoundOutcome()
        for device, reason in session.incompatible.items():
            if any(owner.get(c) == device for c in clients):
                self._device_failed(device, reason)
                log.warning("round %d: %s cannot train (%s)", round, device, reason)
        self.owing = {c for c in clients if owner.get(c) in session.online
                      and owner.get(c) not in self.outcome.device_failures}
        self.arrived: set[int] = set()  # clients whose valid update came
        # those of them not handed on yet: (update, bytes held in memory, where it is spooled)
        self.got: dict[int, tuple[ClientUpdate, UpdateArrived]] = {}
        self.spilled_before = session.inbox.spool.spilled
        #: device -> its clients in this step
        self.load = device_load(clients, owner)
        self.outcome.deadline_s = self.timeout = policy.deadline(self.load)
        self.late_before = session.inbox.late
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout
        self.last_arrival: dict[str, float] = {}
        self.claimed: dict[str, float] = {}  # device -> joules its accepted updates claim
        self.order = sorted(clients)
        self.handed = 0  # updates handed on (or skipped) in client order

    def _device_failed(self, device: str, reason: str) -> None:
        self.outcome.device_failures[device] = reason
        self.outcome.blocked |= {c for c in self.clients if self.owner.get(c) == device}

    def _lost(self, device: str) -> set[int]:
        """The clients of `device` that owed an update: none will come."""
        lost = {c for c in self.owing if self.owner.get(c) == device}
        self.owing -= lost
        return lost

    def take(self, ev: object) -> None:
        """One event of the session: a device offline or failing, or an update."""
        if isinstance(ev, DeviceOffline):
            lost = self._lost(ev.device)
            if lost:
                log.warning("round %d: device %s went offline; clients %s fail", self.round,
                            ev.device, sorted(lost))
        elif isinstance(ev, StepFailed) and ev.seq in (self.seq, -1):
            log.warning("round %d: %s cannot train (%s); clients %s fail", self.round, ev.device,
                        ev.reason, sorted(self._lost(ev.device)))
            self._device_failed(ev.device, ev.reason)
        elif isinstance(ev, UpdateArrived) and (ev.seq != self.seq or not self._update(ev)):
            # a frame that completed just as the step changed, or one refused: its memory is free
            self.session.inbox.release(ev)

    def _update(self, ev: UpdateArrived) -> bool:
        """Whether the update counts (it then waits in `got` for its turn)."""
        device = ev.device
        update = self.session.inbox.in_memory(ev.update, ev)  # checked from the spool, left there
        # Validation comes first: an invalid update never displaces a valid one.
        if self.check(update) is not None:
            if update.diverged_at is not None and self.owner.get(update.client) == device:
                self.owing.discard(update.client)  # its own device says training diverged
            return False
        if update.client in self.arrived:
            log.info("round %d: duplicate update of client %d from %s ignored", self.round,
                     update.client, device)
            return False
        joules = update.cost.energy_j if update.cost is not None else None
        if joules is not None and not plausible_joules(
                self.claimed, device, joules, time.monotonic() - self.started):
            log.warning("round %d: %s claims %.0f J for client %d, more than %.0f W since the "
                        "step went out: its energy figures are dropped", self.round, device,
                        joules, update.client, MAX_DEVICE_W)
            update.cost = dataclasses.replace(update.cost, energy_j=None, energy_w=None,
                                              energy_rails=None)
        self.arrived.add(update.client)
        if ev.spooled is not None:
            update = dataclasses.replace(update, deltas={})
        self.got[update.client] = (update, ev)
        self.outcome.reporters[update.client] = device
        self.last_arrival[device] = time.monotonic()
        self.owing.discard(update.client)
        return True

    def _take(self, c: int) -> ClientUpdate:
        """Client c's update, its deltas back in memory if they waited in the spool."""
        update, ev = self.got.pop(c)
        update = self.session.inbox.in_memory(update, ev)
        self.session.inbox.release(ev)
        return update

    def ready(self) -> Iterator[ClientUpdate]:
        """The updates that are next in client order."""
        while self.handed < len(self.order):
            c = self.order[self.handed]
            if c in self.got:
                self.handed += 1
                yield self._take(c)
            elif c not in self.owing:  # failed, offline or not assigned: never coming
                self.handed += 1
            else:
                return

    def close(self) -> RoundOutcome:
        """The step is over (all answered, or the deadline passed): measure the devices' pace,
        record who missed the deadline and the slowest device; nobody owes anything now."""
        session, outcome = self.session, self.outcome
        session.inbox.collect(-1)
        spilled = session.inbox.spool.spilled - self.spilled_before
        if spilled:
            log.info("round %d: %d updates waited in a file to be folded in client order (%d MB "
                     "of them in memory at most)", self.round, spilled, HELD_IN_MEMORY >> 20)
        finished: dict[str, float] = {}  # device -> seconds until its last update, if it sent all
        theirs: dict[str, list[int]] = {}
        for c in self.clients:
            theirs.setdefault(self.owner.get(c, ""), []).append(c)
        for device in self.load:
            mine = theirs[device]
            if all(c in self.arrived for c in mine):
                finished[device] = self.last_arrival[device] - self.started
                self.policy.measured(device, len(mine), finished[device])
            elif device not in outcome.device_failures and any(c in self.owing for c in mine):
                outcome.missed_deadline.append(device)  # still training when the deadline passed
                self.policy.missed(device, sum(c in self.arrived for c in mine), self.timeout)
        if len(finished) >= 2:  # what the slowest device cost the round
            by_time = sorted(finished, key=finished.__getitem__)
            outcome.slowest = (by_time[-1], finished[by_time[-1]] - finished[by_time[-2]])
        outcome.late_updates = session.inbox.late - self.late_before
        outcome.wire = session.wire_bytes()
        outcome.able_devices = sum(1 for d in set(self.owner.values()) if d in session.online
                                   and d not in session.incompatible
                                   and d not in outcome.device_failures)
        if self.owing:
            log.warning("round %d: no update from %d clients before the deadline: %s", self.round,
                        len(self.owing), few(sorted(self.owing)))
        self.owing.clear()
        return outcome


def collect_scores(session: ServerSession, seq: int, assignment: dict[str, list[int]],
                   check: ScoreCheck, timeout: float, progress: Progress) -> FinetuneOutcome:
    """Every online device's clients' scores for step `seq` (evaluate or finetune), until all
    came, their devices failed or went offline, or `timeout` passed; with the joules and the
    diverged clients the final messages report (fine-tuning). A device's message counts whole or
    not at all: one false score rejects it."""
    owing = {d for d, cs in assignment.items()
             if cs and d in session.online and d not in session.incompatible}
    energy: dict[int, float] = {}
    out = FinetuneOutcome({}, energy=energy)
    partial: dict[str, int] = {}
    total = sum(len(assignment[d]) for d in owing)
    started = time.monotonic()
    deadline = started + timeout
    claimed: dict[str, float] = {}
    again = Resender(session, seq, 1)
    while owing and time.monotonic() < deadline:
        again.poll([c for d in sorted(owing) for c in assignment[d][:1]])
        for ev in session.drain(min(1.0, deadline - time.monotonic())):
            if isinstance(ev, DeviceOffline):
                owing.discard(ev.device)
                session.set_aside([ev])  # an asynchronous run's flights on it are lost
            elif isinstance(ev, UpdateArrived):  # an async run's (taken after this step) or late
                session.set_aside([ev])
            elif isinstance(ev, StepFailed) and ev.seq in (seq, -1):
                log.warning("step %d: %s cannot evaluate (%s)", seq, ev.device, ev.reason)
                owing.discard(ev.device)
            elif isinstance(ev, EvalArrived) and ev.result.seq == seq and ev.result.device in owing:
                res = ev.result
                reason = _score_problem(res, assignment, check)
                if reason is not None:
                    log.warning("step %d: rejected evaluation from %s: %s", seq, res.device, reason)
                    continue
                if not res.final:  # fine-tuning progress: counted, replaced by the final one
                    partial[res.device] = len(res.results)
                    progress(sum(partial.values()) + len(out.scores), total)
                    continue
                out.scores.update({c: (int(r[0]), int(r[1])) for c, r in res.results.items()})
                if res.global_score is not None:
                    out.global_scores[res.device] = (int(res.global_score[0]),
                                                     int(res.global_score[1]))
                joules = {c: j for c, j in (res.energy_j or {}).items()
                          if c in res.results and plausible(j, 0.0, 1e7) is not None}
                if plausible_joules(  # informational: only plausible figures, own clients
                        claimed, res.device, sum(joules.values()), time.monotonic() - started):
                    energy.update(joules)
                out.diverged.update({c: k for c, k in (res.diverged or {}).items()
                                     if c in res.results})
                partial.pop(res.device, None)
                owing.discard(res.device)
                progress(sum(partial.values()) + len(out.scores), total)
    session.inbox.collect(-1)
    if owing:
        log.warning("step %d: no evaluation from %s", seq, sorted(owing))
    return out


def _score_problem(res: EvalResult, assignment: dict[str, list[int]], check: ScoreCheck
                   ) -> str | None:
    """Only the device's own clients, each with a score the round loop accepts."""
    mine = set(assignment.get(res.device, []))
    if res.global_score is not None:  # the global model on the same test rows, together
        correct, total = res.global_score
        if total != sum(t for _, t in res.results.values()) or not 0 <= correct <= total:
            return (f"a global score {correct}/{total}, but its clients' scores have "
                    f"{sum(t for _, t in res.results.values())} test rows")
    for c, (correct, total) in res.results.items():
        if c not in mine:
            return f"client {c} is not assigned to {res.device}"
        reason = check(c, correct, total)
        if reason is not None:
            return reason
    return None
