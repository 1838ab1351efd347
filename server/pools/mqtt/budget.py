"""What one device login may spend of the coordinator's network thread: bytes and CPU time.

The broker's ACL binds a login to its own topics, but every message a login publishes there is
read by the coordinator's one network thread. Counting messages bounds nothing (a 2 MiB status
costs a thousand times a heartbeat), so each login has two token buckets: the bytes it sends and
the thread's CPU time its messages take. A message is read only while both hold something; past
that it is dropped unread, and the login waits for its buckets to refill. So a flood from one
login delays another login's messages by at most its bursts (docs/security.md states the bound,
bench/flood.py measures it); what it sends beyond them costs only the MQTT client's read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: what a message costs besides its payload, in bytes: the MQTT client's and the parser's fixed
#: work, so a flood of tiny messages is bounded like one of big ones
MESSAGE_BYTES = 1024
#: bytes any device may send at once and per second, and per client it holds (statuses,
#: evaluations, an update's header): about a hundred small messages at once and twenty a second
BURST_BYTES_BASE, BURST_BYTES_PER_CLIENT = 256 << 10, 32 << 10
RATE_BYTES_BASE, RATE_BYTES_PER_CLIENT = 40 << 10, 4 << 10
#: network-thread CPU seconds any device may spend at once and per second, and per client
BURST_CPU_BASE, BURST_CPU_PER_CLIENT = 0.05, 0.005
RATE_CPU_BASE, RATE_CPU_PER_CLIENT = 0.01, 0.001
#: CPU seconds per byte of update an honest device's chunks may take (checksum, copies, decoding
#: the frame: about 1-2 ms per MB measured, bench/update_cost.py), with room for a slower machine
CPU_PER_UPDATE_BYTE = 5e-9
#: a device may send two whole updates of every client it holds at once (its answers and a resend
#: of them), and one a client every UPDATE_SPACING_S seconds, sustained (rounds of a fast fleet)
UPDATES_AT_ONCE, UPDATE_SPACING_S = 2, 1.0
#: network-thread CPU seconds a step grants the devices it asks (budget.grant): its status and
#: evaluation messages, and per client its update's header and evaluation (beside the update's
#: bytes at CPU_PER_UPDATE_BYTE)
STEP_CPU, STEP_CPU_PER_CLIENT = 0.005, 0.002


@dataclass(frozen=True)
class Allowance:
    """One login's buckets: bytes and CPU seconds at once (burst) and per second (rate)."""

    burst_bytes: float
    rate_bytes: float
    burst_cpu: float
    rate_cpu: float


def allowance(clients: int, update_bytes: int) -> Allowance:
    """What a device holding `clients` clients may spend, in a run whose update frames are at
    most `update_bytes` on the wire: its share grows with its clients and their updates."""
    update_cpu = update_bytes * CPU_PER_UPDATE_BYTE
    return Allowance(
        burst_bytes=BURST_BYTES_BASE + clients * (BURST_BYTES_PER_CLIENT
                                                  + UPDATES_AT_ONCE * update_bytes),
        rate_bytes=RATE_BYTES_BASE + clients * (RATE_BYTES_PER_CLIENT
                                                + update_bytes / UPDATE_SPACING_S),
        burst_cpu=BURST_CPU_BASE + clients * (BURST_CPU_PER_CLIENT + UPDATES_AT_ONCE * update_cpu),
        rate_cpu=RATE_CPU_BASE + clients * (RATE_CPU_PER_CLIENT + update_cpu / UPDATE_SPACING_S),
    )


class LoginBudgets:
    """Token buckets per login, refilled with time (`clock`, monotonic seconds). Network thread
    only: `admit` before a message is read, `spent` after, with the thread time it took."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._left: dict[str, tuple[float, float, float]] = {}  # login -> (bytes, cpu, when)
        self._lock = threading.Lock()  # (`grant` comes from the coordinator's thread)

    def admit(self, login: str, size: int, a: Allowance) -> bool:
        """Whether `login` may have a message of `size` payload bytes read now; if so, its
        bytes are spent."""
        with self._lock:
            nbytes, cpu, now = self._refilled(login, a)
            cost = size + MESSAGE_BYTES
            ok = nbytes >= cost and cpu > 0
            self._left[login] = (nbytes - cost if ok else nbytes, cpu, now)
            return ok

    def grant(self, login: str, a: Allowance, nbytes: float, cpu: float) -> None:
        """`login` is asked for answers that take `nbytes` and `cpu` (a step went out): both
        are added to what it holds, refilled to now, up to its burst plus the grant. Its
        budget follows the pace of the run, however fast its rounds."""
        with self._lock:
            have, held, now = self._refilled(login, a)
            self._left[login] = (min(a.burst_bytes + nbytes, have + nbytes),
                                 min(a.burst_cpu + cpu, held + cpu), now)

    def _refilled(self, login: str, a: Allowance) -> tuple[float, float, float]:
        """(bytes, cpu) `login` holds now, its buckets refilled since it was last charged, and
        now (under the lock)."""
        now = self.clock()
        nbytes, cpu, when = self._left.get(login, (a.burst_bytes, a.burst_cpu, now))
        return (min(a.burst_bytes, nbytes + (now - when) * a.rate_bytes),
                min(a.burst_cpu, cpu + (now - when) * a.rate_cpu), now)

    def spent(self, login: str, seconds: float) -> None:
        """`login`'s message took `seconds` of the thread's CPU (the bucket may go below zero:
        the login then waits until it has refilled)."""
        with self._lock:
            left = self._left.get(login)
            if left is not None:
                self._left[login] = (left[0], left[1] - seconds, left[2])

    def known(self, login: str) -> bool:
        """Whether `login` has a budget here."""
        return login in self._left

    def logins(self) -> list[str]:
        """The logins that have a budget."""
        return list(self._left)

    def forget(self, login: str) -> None:
        """Drop `login`'s budget."""
        self._left.pop(login, None)


def thread_seconds() -> float:
    """CPU seconds of the calling thread (what a message cost it, whatever else runs)."""
    return time.thread_time()
