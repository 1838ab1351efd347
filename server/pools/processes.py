"""Child processes of a coordinator or a simulation's rank 0: local device daemons, simulation
workers. They die with their parent and are stopped politely, then firmly."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time


def die_with_parent() -> None:
    """In a child process (Popen's preexec_fn): SIGTERM it when its parent dies, even by kill -9
    (Linux PR_SET_PDEATHSIG), so no orphan fights a resumed run for the same names or ports."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def stop_children(procs: list[subprocess.Popen], timeout: float = 15) -> None:
    """SIGTERM the processes, kill those still up after `timeout` seconds."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
