"""One run, whatever reaches its clients: `run_experiment` sets a run up and tears it down for
every transport, the in-process pool (fedseq-sim), the `--workers` process group and the MQTT
fleet (fedseq-server start).

A `Transport` says how the clients are reached; `run_experiment` calls it in a fixed order inside
one ExitStack, so whatever a step opened is closed in reverse, on success, error or Ctrl-C:

    ckpt   = the run directory's checkpoint              (mode "resume")
    transport.connect(stack, ckpt)                       a broker, before minutes of data loading
    transport.announced(ckpt)                            data.placement = "device" on a fleet:
                                                         the clients its devices hold
    exp    = load_experiment(cfg)                        test images only where clients train
                                                         elsewhere (`remote`)
    pool   = transport.open_pool(stack, exp, ckpt)       a ClientPool, closed by the stack
    run_dir = RunDir(out, ..., info + transport.info())
    transport.started(stack, run_dir)                    what the transport records beside it
    Coordinator(..., driver).run(ckpt)                   the run loop (coordinator.py)

The driver makes the rounds on the run's ledger: the synchronous one (`Rounds`), or with
train.mode = "async" buffered asynchronous aggregation (`BufferedAsync`, buffered.py) with
its arrivals' order from the simulated fleet, a real one (`MqttArrivals`) or a run's log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fedseq.common.config import ExperimentConfig
from fedseq.common.data.placed import ClientData
from fedseq.server.rounds.checkpoint import Checkpoint, load_checkpoint
from fedseq.server.rounds.coordinator import Coordinator, RunResult
from fedseq.server.rounds.driver import DriverFactory
from fedseq.server.rounds.experiment import Experiment, load_experiment
from fedseq.server.rounds.pool_api import ClientPool
from fedseq.server.rounds.records import RoundRecord
from fedseq.server.rounds.rundir import RunDir, recorded


class Transport(Protocol):
    """How a run's clients are reached (module docstring: when each method is called)."""

    #: the clients train outside this process: the coordinator loads test images only
    remote: bool
    #: torch threads while updates are collected (Coordinator's collect_threads)
    collect_threads: int | None

    def connect(self, stack: contextlib.ExitStack, ckpt: Checkpoint | None) -> None:
        """Before the experiment loads: what can fail fast (a broker's address or password)."""
        ...

    def announced(self, ckpt: Checkpoint | None) -> list[tuple[str, ClientData]] | None:
        """data.placement = "device": (device, client) as its devices announced them, in
        client-id order (a resumed run's, from its checkpoint); None where the clients' rows are
        read in this machine's processes (a simulation reads --devices-data)."""
        ...

    def open_pool(self, stack: contextlib.ExitStack, exp: Experiment, ckpt: Checkpoint | None
                  ) -> ClientPool:
        """The run's pool; what it needs closed is pushed on `stack`."""
        ...

    def info(self) -> dict[str, Any]:
        """What the run directory records of this transport (threads, workers, device, run id)."""
        ...

    def started(self, stack: contextlib.ExitStack, run_dir: RunDir) -> None:
        """The run directory exists (the fleet records its devices' stacks there)."""
        ...


def run_experiment(
    cfg: ExperimentConfig,
    out: Path | None,
    transport: Transport,
    mode: str = "new",
    info: dict[str, Any] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    pause_after: int | None = None,
    driver: DriverFactory | None = None,
) -> RunResult:
    """Run `cfg` over `transport` into the run directory `out` (None: write nothing); mode
    "resume" continues `out` after its checkpoint's last complete round. `pause_after`: stop
    (resumably) once that many rounds are complete; `driver`: the rounds' driver (None: the one
    train.mode names, on the simulated fleet where it is asynchronous)."""
    ckpt = load_checkpoint(out) if mode == "resume" and out is not None else None
    with contextlib.ExitStack() as stack:
        transport.connect(stack, ckpt)
        announced = transport.announced(ckpt) if cfg.data.placement == "device" else None
        if announced is not None:  # the run has the clients its devices hold
            cfg = cfg.with_clients(len(announced))
        exp = load_experiment(cfg, test_images_only=transport.remote, announced=announced)
        pool = transport.open_pool(stack, exp, ckpt)
        run_dir = None
        if out is not None:
            run_dir = RunDir(out, cfg, mode, ckpt.next_round if ckpt else 0,
                             {**(info or {}), **transport.info()})
            transport.started(stack, run_dir)
        loop = Coordinator(cfg, exp.algorithm, exp.model, exp.data, pool, run_dir, on_round,
                           on_progress, collect_threads=transport.collect_threads,
                           pause_after=pause_after, driver=driver)
        with recorded(run_dir):
            return loop.run(ckpt)
