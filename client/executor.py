"""Executing a step on this device: one handler per step kind.

The worker thread hands a ready step to `StepExecutor.execute`; the handler runs each of the
device's clients in the step and publishes its results through the session's outbox. Between
clients it checks the abort signal (the daemon stopping, a newer step, or the coordinator's
abort) and stops early instead of finishing work nobody will collect.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fedseq.client.power import EnergyMeter, Mark, health
from fedseq.client.secure import MASKED, SecureRound, to_signed
from fedseq.client.session import DeviceSession, RunState
from fedseq.client.state import StateStore
from fedseq.common.algorithms import make_algorithm, run_model
from fedseq.common.algorithms.aggregate import ClientUpdate, DeviceCost
from fedseq.common.algorithms.hooks import UnknownAlgorithm, client_side
from fedseq.common.algorithms.plan import ClientPlan, plan_from_dict
from fedseq.common.data.federated import FederatedData, load_federated, placed_data
from fedseq.common.data.placed import announce, client_folders, read_client
from fedseq.common.errors import FedseqError, ProtocolError
from fedseq.common.execution import ClientExecutor, PersonalState
from fedseq.common.models import BlockModel, Weights
from fedseq.common.protocol.messages import ClientSizes, DataReport, EvalResult, Step, UpdateHeader
from fedseq.common.protocol.tensors import encode_tensors

log = logging.getLogger(__name__)


class StepExecutor:
    """Runs train, evaluate and finetune steps for this device's clients."""

    def __init__(self, session: DeviceSession, store: StateStore, torch_device: torch.device,
                 abort: Callable[[Step], bool], meter: Optional[EnergyMeter] = None):
        self.session = session
        self.store = store
        self.torch_device = torch_device
        self.abort = abort  # true once the step must not go on
        self.meter = meter or EnergyMeter(None, reason="not measured")
        self.handlers: Dict[str, Callable[[RunState, Step, List[int]], None]] = {
            "train": self._train, "async": self._async, "evaluate": self._evaluate,
            "finetune": self._finetune}

    def execute(self, run: RunState, step: Step) -> None:
        """Run `step` for those of its clients this device hosts (all of them without a list)."""
        mine = [c for c in step.clients if c in run.clients] if step.clients else run.clients
        if mine:
            self.handlers[step.kind](run, step, mine)

    # -- what every step needs -------------------------------------------------------------
    def prepare(self, run: RunState) -> Tuple[FederatedData, BlockModel]:
        """This device's clients' rows (as uint8: a Nano has 4 GB for CPU and GPU) and the run's
        model, built once per run (and the data again when the assignment changes)."""
        cfg = run.cfg
        if run.data is None or run.data_clients != run.clients:
            run.data = None
            run.data = self._placed(run) if cfg.data.placement == "device" else load_federated(
                cfg.data, cfg.seed_for("data"), only=run.clients)
            run.data_clients = list(run.clients)
        if run.model is None:
            run.model = run_model(cfg, run.data.input_shape,
                                  run.data.num_classes).to(self.torch_device)
        return run.data, run.model

    def read_placed(self, run: RunState) -> None:
        """data.placement = "device": read this device's clients (its data folder) for `run`
        and announce them; a folder it cannot read is said to the coordinator (this device
        then takes no part in the run)."""
        try:
            found = client_folders(Path(run.cfg.data.root))
            rows = {name: read_client(run.cfg.data, folder) for name, folder in found}
        except Exception as exc:  # whatever reading fails with, the worker goes on (next run)
            if not isinstance(exc, FedseqError):
                log.exception("reading %s", run.cfg.data.root)
            said = str(exc).splitlines()[0] if str(exc) else ""
            reason = (f"{self.session.device} cannot follow run {run.run_id}: its data folder: "
                      f"{said if isinstance(exc, FedseqError) else f'{type(exc).__name__}: {said}'}")
            log.error("%s", reason)
            self.session.report_failure(run.run_id, -1, reason)
            return
        run.placed = rows
        report = DataReport(run_id=run.run_id, clients=[
            ClientSizes(**announce(raw, name).to_dict()) for name, raw in rows.items()])
        log.info("run %s: %d clients in %s (%s training rows)", run.run_id, len(rows),
                 run.cfg.data.root, ", ".join(str(c.train) for c in report.clients))
        self.session.announce_data(run, report)

    def _placed(self, run: RunState) -> FederatedData:
        """This device's clients' rows, by the folders its assignment names."""
        assert run.placed is not None
        missing = [c for c in run.clients if run.folders.get(c) not in run.placed]
        if missing:
            raise FedseqError(f"the assignment names client {missing[0]}'s folder "
                              f"{run.folders.get(missing[0])!r}, which this device did not announce")
        parts = {c: run.placed[run.folders[c]] for c in run.clients}
        return placed_data(run.cfg.data, parts, max(run.clients, default=-1) + 1)

    def clients(self, run: RunState) -> ClientExecutor:
        """The run's clients of this device, their personal blocks on this device's disk."""
        data, model = self.prepare(run)
        return ClientExecutor(model, data, run.cfg.seed_for("training"),
                              run.cfg.train.eval_batch_size, OnDisk(self, run),
                              run.cfg.algorithm.name)

    # -- handlers --------------------------------------------------------------------------
    def _train(self, run: RunState, step: Step, mine: List[int]) -> None:
        clients = self.clients(run)
        plan = _plan(step)
        shared = self.session.weights(run, step)
        secure = None
        if step.secagg is not None:  # [secagg]: keys first, each update masked
            secure = self.session.start_secure(run, step, mine)
        for c in mine:
            if self.abort(step):
                return
            self._train_client(run, step, clients, plan, shared, c, step.seq, secure)

    def _async(self, run: RunState, step: Step, mine: List[int]) -> None:
        """One dispatch of an async step: the oldest of this device's clients' dispatches not
        trained yet, on this step's model (the newest here); the worker then takes the newest
        step again, so every client starts on the newest model this device holds."""
        if not run.answered_read:  # a restarted daemon: what it answered before
            run.answered.update(self.store.answered(run.run_id))
            run.answered_read = True
        owed = self.session.owed_dispatches(run, step)
        if not owed or self.abort(step):
            return
        c, dispatched = owed[0]
        clients = self.clients(run)
        self._train_client(run, step, clients, _plan(step),
                           self.session.weights(run, step), c, dispatched)
        run.answered[c] = dispatched
        self.store.answer(run.run_id, run.answered)

    def _train_client(self, run: RunState, step: Step, clients: ClientExecutor, plan: ClientPlan,
                      shared: Weights, c: int, seq: int, secure: Optional[SecureRound] = None
                      ) -> None:
        """Train client `c` on round `step.round`'s model and send its update as an answer to
        step `seq` (masked, in a secure round)."""
        mark = self.meter.mark()
        update = clients.train(c, step.round, plan, shared)
        cost = self._cost(mark)
        if update.diverged_at is not None:  # refused by the coordinator; blocks kept as they were
            log.warning("round %d: client %d's training diverged (NaN or Inf loss at batch %d)",
                        step.round, c, update.diverged_at)
        meta = dict(run_id=run.run_id, seq=seq, device=self.session.device,
                    **UpdateHeader.fields_of(update, cost))
        deltas = update.deltas
        if secure is not None:
            deltas = self._masked(run, step, secure, update)
            if deltas is None:
                return  # the client dropped out of the secure round (logged)
        frame = encode_tensors(deltas)
        self.session.send(f"update/{c}", seq, functools.partial(self._publish_update, meta, frame))

    def _masked(self, run: RunState, step: Step, secure: SecureRound, update: ClientUpdate
                ) -> Optional[Weights]:
        """A secure round's upload: the update masked once the shares addressed to its client
        came (None: the client dropped out, or the step ended first)."""
        if update.diverged_at is not None:  # refused in any case: nothing to wait for
            return None
        with self.session.cond:
            while not secure.ready(update.client) and not self.abort(step):
                self.session.cond.wait(timeout=1.0)
        assert run.model is not None
        weights = make_algorithm(run.cfg, run.model.spec).aggregation_weights(update)
        y = secure.masked(update.client, update.deltas, weights)
        if y is None:
            return None
        return {MASKED: torch.from_numpy(to_signed(y).copy())}

    def _evaluate(self, run: RunState, step: Step, mine: List[int]) -> None:
        clients = self.clients(run)
        shared = self.session.weights(run, step)
        # the stored state even without personal blocks: FedBN's normalization layers are in it
        placed = run.cfg.data.placement == "device"  # the test rows are here only
        rep = clients.evaluate(shared, step.personal, tuple(step.eval_heads), clients=mine,
                               with_global=placed)
        glob = (rep.global_correct, rep.global_total) if placed else None
        self._send_scores(run, step, rep.per_client, global_score=glob)

    def _finetune(self, run: RunState, step: Step, mine: List[int]) -> None:
        clients = self.clients(run)
        plan = _plan(step)
        shared = self.session.weights(run, step)
        results: Dict[int, Tuple[int, int]] = {}
        energy: Dict[int, float] = {}
        diverged: Dict[int, int] = {}
        for c in mine:
            if self.abort(step):
                return
            mark = self.meter.mark()
            results[c], at = clients.finetune(c, plan, shared, step.personal,
                                              tuple(step.eval_heads))
            if at is not None:
                diverged[c] = at
                log.warning("step %d: client %d's fine-tuning diverged (NaN or Inf loss at batch "
                            "%d)", step.seq, c, at)
            spent = self.meter.since(mark)
            if spent is not None:
                energy[c] = round(spent.joules, 3)
            log.info("step %d: fine-tuned client %d (%d of %d)", step.seq, c, len(results),
                     len(mine))
            if len(results) < len(mine):  # progress for the operator; the final result follows
                partial = EvalResult(run_id=run.run_id, seq=step.seq, device=self.session.device,
                                     results=dict(results), final=False,
                                     energy_j=dict(energy) or None)
                self.session.link.publish(self.session.topics.evaluation(self.session.device),
                                          partial)
        self._send_scores(run, step, results, energy or None, diverged or None)

    def _cost(self, mark: Mark) -> DeviceCost:
        """A client-round's energy and the device's health after it, the update header's cost
        fields (energy None, never 0, where no power source is readable; the coordinator reads
        them back into a DeviceCost, server/pools/mqtt/inbox.py); the status reports the last one."""
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize()  # the GPU's work belongs to this client
        energy = self.meter.since(mark)
        h = health(self.meter.root)
        measured: Dict[str, Any] = energy.fields() if energy is not None else {
            "max_temp_c": h["temp_c"], "throttled": h["throttled"]}
        self.session.last_round_j = energy.joules if energy is not None else None
        return DeviceCost(**measured, gpu_load=h["gpu_load"],
                          mem_available_mb=h["mem_available_mb"])

    # -- results ---------------------------------------------------------------------------
    def _send_scores(self, run: RunState, step: Step, results: Dict[int, Tuple[int, int]],
                     energy: Optional[Dict[int, float]] = None,
                     diverged: Optional[Dict[int, int]] = None,
                     global_score: Optional[Tuple[Any, Any]] = None) -> None:
        s = self.session
        msg = EvalResult(run_id=run.run_id, seq=step.seq, device=s.device, results=results,
                         energy_j=energy, diverged=diverged, global_score=global_score)
        s.send("eval", step.seq, lambda: s.link.publish(s.topics.evaluation(s.device), msg))

    def _publish_update(self, meta: dict, frame: bytes) -> object:
        s = self.session
        return s.link.publish_frame(lambda i: s.topics.update(s.device),
                                    lambda **kw: UpdateHeader(**meta, **kw), frame)


def _plan(step: Step) -> ClientPlan:
    """The step's plan, refused in one line where it is malformed or names an algorithm this
    device's fedseq lacks."""
    if step.plan is None:
        raise ProtocolError(f"step {step.seq} ({step.kind}) carries no plan")
    try:
        plan = plan_from_dict(step.plan)
        client_side(plan)
    except UnknownAlgorithm as exc:
        raise ProtocolError(f"step {step.seq}: {exc}") from None
    return plan


class OnDisk(PersonalState):
    """A device's clients' personal blocks: the newest this device stored (client/state.py);
    a client that never trained here starts from the run's published version 0."""

    def __init__(self, executor: StepExecutor, run: RunState):
        self.store = executor.store
        self.session = executor.session
        self.run = run

    def load(self, client: int, names: Sequence[str], before: Optional[int] = None) -> Weights:
        stored = self.store.load(self.run.run_id, client, before)
        if stored is not None:
            return stored
        return self.session.initial(self.run, list(names))

    def save(self, client: int, blocks: Weights, round: int) -> None:
        if blocks:  # the plan's personal blocks, FedBN's normalization layers
            self.store.save(self.run.run_id, client, blocks, round)
