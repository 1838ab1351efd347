"""What a driver is: the maker of a run's rounds on its ledger. `Rounds` (coordinator.py, train.mode
= "sync") and `BufferedAsync` (buffered.py, "async") implement it; the `Coordinator` calls only
this."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fedseq.server.rounds.ledger import Ledger
from fedseq.server.rounds.pool_api import PoolState
from fedseq.server.rounds.records import RoundRecord


class Driver(Protocol):
    """What makes a run's rounds: `Rounds` (synchronous) or `BufferedAsync` (buffered.py),
    each built on the run's Ledger (`DriverFactory`)."""

    def run_round(self, t: int) -> RoundRecord:
        """Round (or server step) t: train, fold, step the server (ledger.apply), evaluate when
        due (ledger.evaluate_if_due), and return its row (ledger.row)."""
        ...

    def rounds_done(self) -> None:
        """After the last round, before the fine-tuning: what the driver settles."""
        ...

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the driver (None: nothing, a synchronous run)."""
        ...

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from a checkpoint's `state` (a ConfigError where it is another driver's)."""
        ...

    def pool_state(self, state: PoolState) -> PoolState:
        """The pool's state as a checkpoint keeps it (a driver may undo work not yet counted)."""
        ...


DriverFactory = Callable[[Ledger], Driver]
