"""A signal handler's stop (common/stopping.py)."""

from __future__ import annotations

import threading

from fedseq.common.stopping import SignalStop


def test_a_second_signal_inside_the_first_handler_returns_at_once():
    """A second signal that lands while the first one's handler holds the event's lock (inside
    Event.set) returns at once; the event is set and `then` ran once. (A plain Event.set as the
    handler waits on that lock forever in the same thread: a device daemon and an edge
    aggregator signalled twice never exited.)"""
    stop, calls = SignalStop(), []
    stop.then = lambda: calls.append(1)
    cond = stop.event._cond
    notify_all = cond.notify_all

    def notify_all_then_a_second_signal() -> None:
        stop.handler()  # as a signal landing here: the event's lock is held
        notify_all()

    cond.notify_all = notify_all_then_a_second_signal
    first = threading.Thread(target=stop.handler, daemon=True)
    first.start()
    first.join(10)
    assert not first.is_alive(), "the second signal's handler waits on the event's lock"
    assert stop.event.is_set() and calls == [1]
    stop.handler()  # later ones do nothing
    assert calls == [1]
