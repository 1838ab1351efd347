"""The device daemon: hosts logical clients, trains them under the coordinator's steps.

Threads: paho's network thread parses messages and updates state under a lock; one worker
thread executes steps (train / evaluate / finetune). Everything the worker needs is retained on
the broker (run config, assignment, current step, versioned weights), so after a reconnect or a
restart the daemon resynchronizes by itself and carries on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError

from fedseq.client.state import StateStore
from fedseq.common import __version__
from fedseq.common.algorithms import algorithm_class
from fedseq.common.algorithms.plan import plan_from_dict
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData, load_federated
from fedseq.common.data.readers import INPUT_SHAPES, NUM_CLASSES
from fedseq.common.errors import FedseqError, ProtocolError
from fedseq.common.evaluation import evaluate
from fedseq.common.models import BlockModel, Weights, build_model, get_blocks
from fedseq.common.protocol.frames import FramePool, unpack_chunk
from fedseq.common.protocol.link import Link, TlsOptions
from fedseq.common.protocol.messages import (
    PROTOCOL_VERSION,
    Assignment,
    Control,
    DeviceStatus,
    EvalResult,
    RunConfig,
    ServerStatus,
    Step,
    UpdateHeader,
    WeightsHeader,
    version_mismatch,
)
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.common.seeding import derive_seed
from fedseq.common.training import finetune_and_score, run_client_round

log = logging.getLogger(__name__)


@dataclass
class RunState:
    run_id: str
    cfg: ExperimentConfig
    clients: list[int] = field(default_factory=list)
    done: set[int] = field(default_factory=set)  # step seqs finished
    data: FederatedData | None = None
    data_clients: list[int] | None = None  # whose rows `data` holds
    model: BlockModel | None = None
    frames: FramePool | None = None  # weights frames being reassembled, bounded by the model


def weights_frame_pool(cfg: ExperimentConfig) -> FramePool:
    """A weights frame holds one block of the run's model: anything larger is refused before it is
    allocated; partial frames of at most two whole models are kept."""
    two = algorithm_class(cfg.algorithm.name).two_heads
    model = build_model(cfg.model.name, INPUT_SHAPES[cfg.data.dataset],
                        NUM_CLASSES[cfg.data.dataset], two)
    sizes = [len(encode_tensors(get_blocks(model, [b]))) + 4096 for b in model.spec.blocks]
    return FramePool(max_frame=max(sizes), per_sender=2 * sum(sizes))


def pick_torch_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise FedseqError("--torch-device cuda: CUDA is not available on this device")
    return torch.device(choice)


class DeviceDaemon:
    def __init__(
        self,
        device: str,
        broker: str,
        data_dir: Path,
        state_dir: Path,
        torch_device: str = "auto",
        topic_root: str = "fedseq",
        username: str | None = None,
        password: str | None = None,
        tls: TlsOptions | None = None,
    ):
        self.device = device
        self.data_dir = data_dir
        self.store = StateStore(state_dir)
        self.torch_device = pick_torch_device(torch_device)
        self.topics = Topics(topic_root)
        t = self.topics
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.run: RunState | None = None
        self.step: Step | None = None
        self.next_step: Step | None = None  # a step of a run whose config has not arrived yet
        self.last_error: tuple[str | None, int | None, str] = (None, None, "")
        self._online_since = 0.0
        # What this device sent for the current step, sent again whenever it or the coordinator
        # reconnects: a message published while the other side was away is otherwise lost, and
        # the round would wait for its deadline. Duplicates are harmless (the coordinator keeps
        # the first valid update per client).
        self.outbox: dict[str, tuple[int, Callable[[], None]]] = {}
        self.assignment: Assignment | None = None  # the latest, applied once its run is known
        # run_id -> block -> (version, tensors); chunks being reassembled
        self.blocks: dict[str, dict[str, tuple[int, Weights]]] = {}
        offline = DeviceStatus(device=device, state="offline").encode()
        self.link = Link(
            f"fedseq-device-{device}", broker,
            [t.run_config, t.assignment(device), t.step, t.weights(), t.control, t.server_status],
            self._on_message, will=(t.device_status(device), offline),
            username=username, password=password, tls=tls,
        )
        self.link.on_connect(self._connected)
        self.link.on_connect(lambda: self._resend("reconnected"))
        self.worker = threading.Thread(target=self._work, name="fedseq-worker", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, attempts: int | None = None, refusals: int = 3) -> None:
        """Connect (retrying an unreachable broker `attempts` times, None = until stopped; a
        refused login ends it after `refusals` tries), then serve in the background."""
        log.info("connecting to %s as %s", self.link.url, self.device)
        self.link.start(attempts=attempts, refusals=refusals)
        log.info("connected to %s; waiting for a run", self.link.url)
        self.worker.start()

    def stop(self) -> None:
        """Publish offline and disconnect (what SIGTERM does)."""
        self.stopping.set()
        with self.cond:
            self.cond.notify_all()
        if self.link.connected.is_set():
            self.link.publish(self.topics.device_status(self.device),
                              DeviceStatus(device=self.device, state="offline"), retain=True,
                              wait=True, timeout=3.0)  # a broker that is gone must not hold us
        self.link.stop()

    def _connected(self) -> None:
        self._online_since = time.time()
        self._announce()

    def _announce(self) -> None:
        mem = 0
        with contextlib.suppress(ValueError, OSError):
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
        run_id, seq, error = self.last_error
        status = DeviceStatus(device=self.device, state="online", package_version=__version__,
                              torch_device=str(self.torch_device), memory_mb=mem, error=error,
                              error_seq=seq, error_run_id=run_id, since=self._online_since)
        self.link.publish(self.topics.device_status(self.device), status, retain=True)

    # -- network thread --------------------------------------------------------------------
    def _on_message(self, topic: str, payload: bytes) -> None:
        t = self.topics
        if not payload:
            return  # a cleared retained message
        try:
            if topic == t.run_config:
                self._on_run_config(RunConfig.decode(payload))
            elif topic == t.assignment(self.device):
                self._on_assignment(Assignment.decode(payload))
            elif topic == t.step:
                self._on_step(Step.decode(payload))
            elif topic.startswith(f"{t.root}/weights/"):
                self._on_weights_chunk(payload)
            elif topic == t.control:
                self._on_control(Control.decode(payload))
            elif topic == t.server_status:
                status = ServerStatus.decode(payload)
                if status.state == "online" and self.run is not None and status.run_id == self.run.run_id:
                    self._resend("coordinator (re)connected")
        except FedseqError as exc:
            log.warning("dropped message on %s: %s", topic, exc)
            other = version_mismatch(payload) if topic in (t.run_config, t.step) else None
            if other is not None and other[1] is not None:
                reason = (f"protocol mismatch: the coordinator speaks v{other[0]}, this device "
                          f"v{PROTOCOL_VERSION} (fedseq {__version__}); install the same fedseq "
                          "version on both sides")
                log.error("%s", reason)
                self.last_error = (other[1], -1, reason)  # -1: no step of this run can run here
                self._announce()

    def _current_run(self, run_id: str | None, what: str) -> RunState:
        """The run a coordinator message must belong to (ProtocolError otherwise)."""
        run = self.run
        if run is None or run_id != run.run_id:
            raise ProtocolError(f"{what} for run {run_id}, but the current run is "
                                f"{run.run_id if run else 'none yet'}")
        return run

    def _on_step(self, step: Step) -> None:
        with self.cond:
            if self.run is None or step.run_id != self.run.run_id:
                self.next_step = step  # applied if its run config follows; never aborts this run
                return
            self.step = step
            self.cond.notify_all()

    def _on_control(self, ctl: Control) -> None:
        self._current_run(ctl.run_id, f"control {ctl.command}")
        log.warning("coordinator: %s %s", ctl.command, ctl.reason)
        with self.cond:
            self.step = None

    def _on_run_config(self, rc: RunConfig) -> None:
        try:
            cfg = ExperimentConfig.model_validate(rc.config)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ProtocolError(f"run config {rc.run_id}: {where}: {err['msg']}") from exc
        cfg.data.root = self.data_dir  # this device's files, never the coordinator's path
        with self.cond:
            if self.run is None or self.run.run_id != rc.run_id:
                log.info("joined run %s: %s on %s", rc.run_id, cfg.algorithm.name, cfg.data.dataset)
                self.run = RunState(rc.run_id, cfg, frames=weights_frame_pool(cfg))
                for run_id in list(self.blocks):
                    if run_id != rc.run_id:
                        del self.blocks[run_id]
                if self.step is not None and self.step.run_id != rc.run_id:
                    self.step = None
                if self.next_step is not None and self.next_step.run_id == rc.run_id:
                    self.step, self.next_step = self.next_step, None
            self.cond.notify_all()

    def _on_assignment(self, a: Assignment) -> None:
        if a.device != self.device:
            raise ProtocolError(f"assignment names device {a.device!r}, this is {self.device!r}")
        with self.cond:
            self.assignment = a
            self.cond.notify_all()

    def _on_weights_chunk(self, payload: bytes) -> None:
        head, data = unpack_chunk(payload, WeightsHeader)
        run = self._current_run(head.run_id, f"weights {head.block}")
        held = self.blocks.get(head.run_id, {}).get(head.block)
        if held is not None and held[0] >= head.version:
            return
        assert run.frames is not None
        frame = run.frames.add("coordinator", (head.block, head.version), head, data)
        if frame is None:
            return
        tensors = decode_tensors(frame, copy=False)
        with self.cond:
            if self.run is not run:
                return
            self.blocks.setdefault(head.run_id, {})[head.block] = (head.version, tensors)
            run.frames.expire(lambda _, tag: tag[0] != head.block or tag[1] > head.version)
            self.cond.notify_all()

    # -- worker thread ---------------------------------------------------------------------
    def _ready(self) -> tuple[RunState, Step] | None:
        run, step = self.run, self.step
        a = self.assignment
        if run is not None and a is not None and a.run_id == run.run_id:
            run.clients = sorted(a.clients)
        if run is None or step is None or step.run_id != run.run_id or step.seq in run.done:
            return None
        if step.kind not in ("train", "evaluate", "finetune"):
            return None
        held = self.blocks.get(run.run_id, {})
        for block, version in step.versions.items():
            if block not in held or held[block][0] < version:
                return None  # weights still arriving
            if held[block][0] > version:
                run.done.add(step.seq)  # the coordinator has moved on
                return None
        return run, step

    def _work(self) -> None:
        while not self.stopping.is_set():
            with self.cond:
                ready = self._ready()
                if ready is None:
                    self.cond.wait(timeout=1.0)
                    continue
            run, step = ready
            log.info("step %d: %s%s", step.seq, step.kind,
                     f" round {step.round}" if step.kind == "train" else "")
            try:
                self._execute(run, step)
            except FedseqError as exc:
                log.error("step %d (%s) failed: %s", step.seq, step.kind, exc)
                self._report_failure(run, step, str(exc))
            except Exception as exc:
                log.exception("step %d (%s) failed", step.seq, step.kind)
                self._report_failure(run, step, f"{type(exc).__name__}: {exc}")
            run.done.add(step.seq)

    def _report_failure(self, run: RunState, step: Step, reason: str) -> None:
        """Tell the coordinator at once that this step cannot be executed here, and why."""
        self.last_error = (run.run_id, step.seq, reason.splitlines()[0][:2000] if reason else "")
        self._announce()

    def _prepare(self, run: RunState) -> tuple[FederatedData, BlockModel]:
        cfg = run.cfg
        if run.data is None or run.data_clients != run.clients:
            # only this device's clients' rows, as uint8 (a Nano has 4 GB for CPU and GPU)
            run.data = None
            run.data = load_federated(cfg.data, cfg.seed, only=run.clients)
            run.data_clients = list(run.clients)
        if run.model is None:
            two = algorithm_class(cfg.algorithm.name).two_heads
            run.model = build_model(cfg.model.name, run.data.input_shape, run.data.num_classes, two,
                                    generator_seed=derive_seed(cfg.seed, "init")
                                    ).to(self.torch_device)
        return run.data, run.model

    def _global(self, run: RunState, blocks: list[str]) -> Weights:
        held = self.blocks[run.run_id]
        out: Weights = {}
        for b in blocks:
            out.update(held[b][1])
        return out

    def _personal(self, run: RunState, client: int, personal: tuple[str, ...],
                  before: int | None = None) -> Weights:
        stored = self.store.load(run.run_id, client, before)
        if stored is not None:
            return stored
        return self._global(run, list(personal))  # version 0: the initial model's blocks

    def _stale(self, step: Step) -> bool:
        cur = self.step
        return self.stopping.is_set() or cur is None or cur.seq != step.seq

    def _execute(self, run: RunState, step: Step) -> None:
        data, model = self._prepare(run)
        mine = [c for c in step.clients if c in run.clients] if step.clients else run.clients
        if not mine:
            return
        plan = plan_from_dict(step.plan) if step.plan else None
        shared = self._global(run, list(step.versions))
        if step.kind == "train":
            assert plan is not None
            for c in mine:
                if self._stale(step):
                    return
                start = {**shared, **self._personal(run, c, plan.personal, before=step.round)}
                update, personal = run_client_round(model, start, plan, data, data.clients[c],
                                                    run.cfg.seed, step.round)
                if plan.personal:
                    self.store.save(run.run_id, c, personal, step.round)
                frame = encode_tensors(update.deltas)

                meta = dict(run_id=run.run_id, seq=step.seq, round=step.round, client=c,
                            device=self.device, num_samples=update.num_samples,
                            effective_samples=update.effective_samples,
                            train_seconds=update.train_seconds,
                            local_correct=update.local_score[0] if update.local_score else None,
                            local_total=update.local_score[1] if update.local_score else None)
                self._send(f"update/{c}", step.seq, functools.partial(self._publish_update, c, meta, frame))
        elif step.kind == "evaluate":
            alg_personal = self._personal_names(run)
            personal = {c: self._personal(run, c, alg_personal) for c in mine}
            rep = evaluate(model, data, shared, personal if alg_personal else {},
                           tuple(step.eval_heads), clients=mine, with_global=False,
                           batch=run.cfg.train.eval_batch_size)
            self._send_eval(run, step, rep.per_client)
        elif step.kind == "finetune":
            assert plan is not None
            alg_personal = self._personal_names(run)
            results = {}
            for c in mine:
                if self._stale(step):
                    return
                start = {**shared, **self._personal(run, c, alg_personal)}
                results[c] = finetune_and_score(model, start, plan, data, data.clients[c],
                                                run.cfg.seed, tuple(step.eval_heads),
                                                run.cfg.train.eval_batch_size)
                log.info("step %d: fine-tuned client %d (%d of %d)", step.seq, c, len(results),
                         len(mine))
                if len(results) < len(mine):  # progress for the operator; the final result follows
                    partial = EvalResult(run_id=run.run_id, seq=step.seq, device=self.device,
                                         results=dict(results), final=False)
                    self.link.publish(self.topics.evaluation(self.device), partial)
            self._send_eval(run, step, results)

    def _personal_names(self, run: RunState) -> tuple[str, ...]:
        from fedseq.common.algorithms import make_algorithm

        _, model = self._prepare(run)
        return make_algorithm(run.cfg, model.spec).personal_blocks()

    def _send_eval(self, run: RunState, step: Step, results: dict[int, tuple[int, int]]) -> None:
        msg = EvalResult(run_id=run.run_id, seq=step.seq, device=self.device, results=results)
        self._send("eval", step.seq, lambda: self.link.publish(self.topics.evaluation(self.device), msg))

    def _publish_update(self, client: int, meta: dict, frame: bytes) -> None:
        self.link.publish_frame(lambda i: self.topics.update(self.device, client, i),
                                lambda **kw: UpdateHeader(**meta, **kw), frame)

    def _send(self, key: str, seq: int, publish: Callable[[], None]) -> None:
        with self.cond:
            for k, (s, _) in list(self.outbox.items()):
                if s != seq:
                    del self.outbox[k]  # an older step's: the coordinator has moved on
            self.outbox[key] = (seq, publish)
        publish()

    def _resend(self, why: str) -> None:
        with self.cond:
            step = self.step
            pending = [p for s, p in self.outbox.values() if step is not None and s == step.seq]
        if pending:
            log.info("%s: sending the current step's %d results again", why, len(pending))
        for publish in pending:
            publish()
