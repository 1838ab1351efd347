"""A stop that signal handlers set (a device daemon's and an edge aggregator's SIGTERM/SIGINT).

threading.Event.set takes a lock that is not re-entrant, and Python runs a signal's handler in
the main thread between two bytecodes, so a second signal that lands while the first one's
handler is inside `set` waits on that lock forever in the same thread: a daemon signalled twice
in a row (its parent's death signal and a stop, Ctrl-C twice) never exited. `SignalStop.handler`
acts on the first signal alone; later ones return at once."""

from __future__ import annotations

import threading
from typing import Callable, Optional


class SignalStop:
    """`handler` for signal.signal; `event` is what the serving loop waits on; `then` (if set)
    runs once after it is set (e.g. cancelling a connection attempt)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.then: Optional[Callable[[], None]] = None
        self._fired = False

    def handler(self, *_: object) -> None:
        """The first signal sets `event` and runs `then`; a later one (even one that interrupts
        this handler) does nothing."""
        if self._fired:
            return
        self._fired = True
        self.event.set()
        if self.then is not None:
            self.then()
