"""The device daemon: hosts logical clients and trains them under the coordinator's steps.

Threads: paho's network thread feeds the session (session.py: run, assignment, step, weights,
outbox); one worker thread waits for a step that is ready and hands it to the executor
(executor.py: one handler per step kind). Everything the worker needs is retained on the broker,
so after a reconnect or a restart the daemon resynchronizes by itself and carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Optional

from fedseq.client.executor import StepExecutor
from fedseq.client.power import EnergyMeter
from fedseq.client.session import DeviceSession, RunState, Superseded
from fedseq.client.state import StateStore
from fedseq.common.errors import FedseqError
from fedseq.common.hardware import torch_device as choose_device
from fedseq.common.protocol.link import Link, TlsOptions
from fedseq.common.protocol.messages import HEARTBEAT_S, Step

log = logging.getLogger(__name__)


class DeviceDaemon:
    """One device: its broker session, its clients' stored state and the worker that executes
    steps. `start` connects and serves in the background; `stop` says offline and disconnects."""

    def __init__(
        self,
        device: str,
        broker: str,
        data_dir: Optional[Path],
        state_dir: Path,
        torch_device: str = "auto",
        topic_root: str = "fedseq",
        username: Optional[str] = None,
        password: Optional[str] = None,
        tls: Optional[TlsOptions] = None,
    ):
        self.device = device
        self.torch_device = choose_device(torch_device, "--torch-device")
        self.stopping = threading.Event()
        self.meter = EnergyMeter.for_this_device()  # power sensors found once, sampled in a thread
        self.session = DeviceSession(device, broker, str(self.torch_device), data_dir, topic_root,
                                     username, password, tls, meter=self.meter)
        self.executor = StepExecutor(self.session, StateStore(state_dir), self.torch_device,
                                     self._must_stop, self.meter)
        self.worker = threading.Thread(target=self._work, name="fedseq-worker", daemon=True)

    @property
    def link(self) -> Link:
        """The daemon's broker link."""
        return self.session.link

    @property
    def run(self) -> Optional[RunState]:
        """The run the device follows now, or None."""
        return self.session.run

    @property
    def step(self) -> Optional[Step]:
        """The step the device executes now, or None."""
        return self.session.step

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, attempts: Optional[int] = None, refusals: int = 3) -> None:
        """Connect (retrying an unreachable broker `attempts` times, None = until stopped; a
        refused login ends it after `refusals` tries), then serve in the background."""
        log.info("connecting to %s as %s", self.link.url, self.device)
        self.link.start(attempts=attempts, refusals=refusals)
        log.info("connected to %s; waiting for a run", self.link.url)
        self.worker.start()
        self.meter.start()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Re-publish the status every HEARTBEAT_S while connected: the coordinator's proof that
        this device is alive (a retained 'online' alone may be a dead device's)."""
        while not self.stopping.wait(HEARTBEAT_S):
            if self.link.connected.is_set():
                self.session.announce()

    def stop(self) -> None:
        """Publish offline and disconnect (what SIGTERM does)."""
        self.stopping.set()
        self.meter.stop()
        with self.session.cond:
            self.session.cond.notify_all()
        self.session.say_offline()
        self.link.stop()

    # -- worker thread ---------------------------------------------------------------------
    def _must_stop(self, step: Step) -> bool:
        """The abort signal the executor checks between clients."""
        return self.stopping.is_set() or self.session.superseded(step)

    def _work(self) -> None:
        while not self.stopping.is_set():
            with self.session.cond:
                unread = self.session.to_read()
            if unread is not None:
                self.executor.read_placed(unread)
                continue
            with self.session.cond:
                ready = self.session.next_ready()
                stalled = ready is None and self.session.weights_stalled(time.monotonic())
                if ready is None and not stalled:
                    self.session.cond.wait(timeout=1.0)
            if ready is None:
                if stalled:  # outside the lock: the network thread takes it for every message
                    self.session.resync_weights()
                continue
            run, step = ready
            log.info("step %d: %s%s", step.seq, step.kind,
                     f" round {step.round}" if step.kind in ("train", "async") else "")
            failed = True
            try:
                self.executor.execute(run, step)
                failed = False
            except Superseded as exc:
                log.info("step %d (%s) left: %s", step.seq, step.kind, exc)
                failed = False
            except FedseqError as exc:
                log.error("step %d (%s) failed: %s", step.seq, step.kind, exc)
                self.session.report_failure(run.run_id, step.seq, str(exc))
            except Exception as exc:
                log.exception("step %d (%s) failed", step.seq, step.kind)
                self.session.report_failure(run.run_id, step.seq, f"{type(exc).__name__}: {exc}")
            if step.kind != "async" or failed:  # an async step is done when nothing is owed
                run.done.add(step.seq)
