"""The device's broker session: what the coordinator has published, as state the worker can use.

The network thread parses every message the device reads (one topic parser, common/protocol/
topics.py) into the session's state under one condition variable: the run (its config), this
device's assignment, the current step, the weight blocks by version. Everything is retained on the
broker, so after a reconnect or a restart the session fills up again by itself. What the device
sent for the current step is kept in an outbox and sent again whenever either side reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

from pydantic import ValidationError

from fedseq.client.power import EnergyMeter, health
from fedseq.common import __version__
from fedseq.common.algorithms import run_model
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData
from fedseq.common.data.store import default_data_root
from fedseq.common.errors import FedseqError, ProtocolError, validation_problem
from fedseq.common.models import BlockModel, Weights, get_blocks
from fedseq.common.protocol.frames import FramePool, unpack_chunk
from fedseq.common.protocol.link import Link, TlsOptions, on_the_way, session_id
from fedseq.common.protocol.messages import (
    PROTOCOL_VERSION,
    Assignment,
    Control,
    DataReport,
    DeviceInfo,
    DeviceStatus,
    RunConfig,
    SecAggMessage,
    ServerStatus,
    Step,
    WeightsHeader,
    run_id_of,
    version_mismatch,
)
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.common.registry import DEVICE_GROUPS, REGISTRY

if TYPE_CHECKING:
    from fedseq.client.secure import SecureRound

log = logging.getLogger(__name__)

#: seconds without a weights chunk, while the current step still lacks a block, before the device
#: asks the broker for the retained blocks again (`DeviceSession.weights_stalled`); each ask
#: doubles the next silence, up to RESYNC_MAX_S
RESYNC_S, RESYNC_MAX_S = 30.0, 480.0


class Superseded(Exception):
    """The step's blocks were replaced by newer versions before the worker read them: the step is
    left (an async dispatch stays owed and is trained on the newer step), not failed."""


@dataclass
class RunState:
    """One run as this device knows it."""

    run_id: str
    cfg: ExperimentConfig
    clients: List[int] = field(default_factory=list)  # this device's, from its assignment
    done: Set[int] = field(default_factory=set)  # step seqs finished (or superseded)
    data: Optional[FederatedData] = None
    data_clients: Optional[List[int]] = None  # whose rows `data` holds
    model: Optional[BlockModel] = None
    frames: Optional[FramePool] = None  # weights frames being reassembled, bounded by the model
    # async steps: client -> the dispatch (step seq) this device last trained it for (read from
    # the state folder before the first async step here: StepExecutor._async)
    answered: Dict[int, int] = field(default_factory=dict)
    answered_read: bool = False
    # data.placement = "device": folder -> its client's rows, read once per run (None: not yet)
    placed: Optional[Dict[str, Any]] = None
    folders: Dict[int, str] = field(default_factory=dict)  # client -> its folder (assignment)


def weights_frame_pool(cfg: ExperimentConfig) -> FramePool:
    """A weights frame holds one block of the run's model: anything larger is refused before it is
    allocated; partial frames of at most two whole models are kept."""
    model = run_model(cfg)
    sizes = [len(encode_tensors(get_blocks(model, [b]))) + 4096 for b in model.spec.blocks]
    return FramePool(max_frame=max(sizes), per_sender=2 * sum(sizes))


class DeviceSession:
    """The device's connection and everything the coordinator told it (see module docstring)."""

    def __init__(self, device: str, broker: str, torch_device: str, data_dir,
                 topic_root: str = "fedseq", username: Optional[str] = None,
                 password: Optional[str] = None, tls: Optional[TlsOptions] = None,
                 meter: Optional[EnergyMeter] = None):
        self.device = device
        self.meter = meter
        self.last_round_j: Optional[float] = None  # the energy of this device's last client-round
        self.data_dir = data_dir if data_dir is not None else default_data_root()
        self.torch_device = torch_device  # reported in the status
        self.topics = t = Topics(topic_root)
        self.cond = threading.Condition()
        self.run: Optional[RunState] = None
        self.step: Optional[Step] = None
        self.next_step: Optional[Step] = None  # a step of a run whose config has not arrived yet
        # the run a newer run config replaced, with its step: a stray run config on an open broker
        # (the coordinator restores its own within seconds) must not cost the real run its step
        # or its downloaded blocks, however many come in a row; one run is kept, the one with
        # more done (_worth_keeping), so memory stays bounded
        self.parked: Optional[Tuple[RunState, Optional[Step]]] = None
        self.assignment: Optional[Assignment] = None  # the latest, applied once its run is known
        self.aborted: Set[str] = set()  # runs the coordinator aborted (Control)
        # run_id -> block -> (version, tensors)
        self.blocks: Dict[str, Dict[str, Tuple[int, Weights]]] = {}
        self.last_error: Tuple[Optional[str], Optional[int], str] = (None, None, "")
        self.data_report: Optional[DataReport] = None  # data.placement = "device": what it holds
        self._online_since = 0.0
        # What this device sent for the current step, sent again whenever it or the coordinator
        # reconnects: a message published while the other side was away is otherwise lost, and
        # the round would wait for its deadline. Duplicates are harmless (the coordinator keeps
        # the first valid update per client).
        self.outbox: Dict[str, Tuple[int, Callable[[], object]]] = {}
        # what each answer's last publish returned (its chunks' message infos): an answer still on
        # its way to the broker is not sent again when the coordinator asks (on a 2 Mbit/s link an
        # update takes longer than the coordinator's silence before it asks; sending it again
        # then only queued more behind it)
        self.sending: Dict[str, object] = {}
        # the secure round of the current train step ([secagg]; client/secure.py), if any
        self.secure: Optional[SecureRound] = None
        # when a weights chunk last arrived (or the current step, or the last resync), and the
        # silence after which a step still lacking blocks resyncs them (weights_stalled)
        self.weights_heard = time.monotonic()
        self.resync_after = RESYNC_S
        offline = DeviceStatus(device=device, state="offline").encode()
        self.link = Link(
            session_id(f"fedseq-device-{device}"), broker,
            [t.run_config, t.assignment(device), t.step, t.weights(), t.control, t.server_status,
             t.secagg_relay(device)],
            self.on_message, will=(t.device_status(device), offline),
            username=username, password=password, tls=tls,
        )
        self.link.on_connect(self._connected)
        self.link.on_connect(lambda: self.resend("reconnected"))

    # -- presence --------------------------------------------------------------------------
    def _connected(self) -> None:
        self._online_since = time.time()
        self.describe()
        self.announce()

    def describe(self) -> None:
        """Publish what this device trains with (retained DeviceInfo): torch build, threads,
        hardware; the coordinator records it with the run (devices.json)."""
        import torch

        from fedseq.client.stack import l4t_release
        from fedseq.common.hardware import compute_record

        try:
            record = compute_record(torch.device(self.torch_device))
            rel = l4t_release()
            info = DeviceInfo(device=self.device, package_version=__version__,
                              l4t=rel[1] if rel else "", **record)
        except Exception as exc:  # informational: never in the way of training
            log.warning("cannot describe this device's stack: %s", exc)
            return
        self.link.publish(self.topics.device_info(self.device), info, retain=True)

    def announce(self) -> None:
        """Publish this device's status (retained): online, versions, memory, its last error."""
        mem = 0
        with contextlib.suppress(ValueError, OSError):
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
        run_id, seq, error = self.last_error
        h = health(self.meter.root if self.meter is not None else None)
        source = None
        if self.meter is not None:
            source = (self.meter.source.name if self.meter.source is not None
                      else f"none: {self.meter.reason}"[:200])
        status = DeviceStatus(device=self.device, state="online", package_version=__version__,
                              torch_device=self.torch_device, memory_mb=mem, error=error,
                              error_seq=seq, error_run_id=run_id, since=self._online_since,
                              temp_c=h["temp_c"], throttled=h["throttled"], gpu_load=h["gpu_load"],
                              mem_available_mb=h["mem_available_mb"], energy_source=source,
                              last_round_j=self.last_round_j, data=self.data_report)
        self.link.publish(self.topics.device_status(self.device), status, retain=True)

    def report_failure(self, run_id: str, seq: int, reason: str) -> None:
        """Tell the coordinator at once that step `seq` cannot be executed here, and why
        (seq -1: no step of the run can)."""
        self.last_error = (run_id, seq, reason.splitlines()[0][:2000] if reason else "")
        self.announce()

    def say_offline(self) -> None:
        """Publish offline, waiting a little for the broker (what SIGTERM does)."""
        if self.link.connected.is_set():
            self.link.publish(self.topics.device_status(self.device),
                              DeviceStatus(device=self.device, state="offline"), retain=True,
                              wait=True, timeout=3.0)  # a broker that is gone must not hold us

    # -- network thread --------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        """Network thread: one message into the session's state; anything invalid is logged with
        its reason and dropped (a protocol mismatch is also reported to the coordinator)."""
        if not payload:
            return  # a cleared retained message
        ref = self.topics.parse(topic)
        kind = ref.kind if ref is not None else ""
        try:
            if kind == "run_config":
                self._on_run_config(RunConfig.decode(payload))
            elif kind == "assignment" and ref is not None and ref.device == self.device:
                self._on_assignment(Assignment.decode(payload))
            elif kind == "step":
                self._on_step(Step.decode(payload))
            elif kind == "weights":
                self._on_weights_chunk(payload)
            elif kind == "control":
                self._on_control(Control.decode(payload))
            elif kind == "secagg_relay" and ref is not None and ref.device == self.device:
                self._on_secagg(SecAggMessage.decode(payload))
            elif kind == "server_status":
                status = ServerStatus.decode(payload)
                run = self.run
                if status.state == "online" and run is not None and status.run_id == run.run_id:
                    self.resend("coordinator (re)connected")
            else:
                # a topic this device did not subscribe to: the embedded amqtt broker sometimes
                # routes other devices' statuses here; nothing to warn about every heartbeat
                log.debug("ignored a message on %s: not a topic the device reads", topic)
                return
        except FedseqError as exc:
            log.warning("dropped message on %s: %s", topic, exc)
            other = version_mismatch(payload) if kind in ("run_config", "step") else None
            run = self.run
            if kind == "assignment" and run is not None and version_mismatch(payload) is None \
                    and run_id_of(payload) == run.run_id:
                # its clients are unknown here: said at once, or their rounds wait out deadlines
                self.report_failure(run.run_id, -1, f"{self.device} cannot read its assignment "
                                                    f"for run {run.run_id}: {exc}")
                return
            if other is not None and run is not None and other[1] == run.run_id:
                # This run's coordinator sent its config in our protocol: a message of another
                # version under its run id is not from it (a stray client on an open broker).
                log.warning("ignored a %s of protocol v%d for run %s, whose coordinator speaks "
                            "v%d", kind, other[0], run.run_id, PROTOCOL_VERSION)
            elif other is not None and other[1] is not None and kind == "run_config":
                # (a step alone does not say so: the run config is what defines a run)
                reason = (f"protocol mismatch: the coordinator speaks v{other[0]}, this device "
                          f"v{PROTOCOL_VERSION} (fedseq {__version__}); install the same fedseq "
                          "version on both sides")
                log.error("%s", reason)
                self.report_failure(other[1], -1, reason)  # -1: no step of this run can run here

    def _current_run(self, run_id: Optional[str], what: str) -> RunState:
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
            if self.step is None or self.step.seq != step.seq:
                self.weights_heard = time.monotonic()  # a new step: its blocks may be on their way
            self.step = step
            self.aborted.discard(step.run_id)  # a resumed run's new step
            self.cond.notify_all()

    def _on_control(self, ctl: Control) -> None:
        run = self._current_run(ctl.run_id, f"control {ctl.command}")
        if ctl.command == "resend":
            self.resend_for(ctl.seq, set(ctl.clients), run.clients)
            return
        log.warning("coordinator: %s run %s: %s", ctl.command, run.run_id, ctl.reason)
        with self.cond:
            self.aborted.add(run.run_id)
            self.step = None
            self.outbox.clear()
            self.sending.clear()
            self.cond.notify_all()

    def _on_secagg(self, msg: SecAggMessage) -> None:
        """A secure round's stage relayed to this device's clients: answered at once (stage 2,
        stage 4) or kept for the worker's masking (the shares addressed to them)."""
        run = self._current_run(msg.run_id, f"secure stage {msg.stage}")
        r = self.secure
        if r is None or r.seq != msg.seq:
            log.info("ignored a %s stage of step %d: no secure round of it here", msg.stage,
                     msg.seq)
            return
        if msg.stage == "shares":
            with self.cond:
                r.take_shares(msg.items)
                self.cond.notify_all()
            return
        answer = r.share(msg.items) if msg.stage == "keys" else r.unmask(msg.items)
        if answer:
            self.send_secure("shares" if msg.stage == "keys" else "unmask", run, msg.seq, answer)

    def start_secure(self, run: RunState, step: Step, mine: List[int]) -> SecureRound:
        """Worker: the secure round of train step `step` for this device's clients `mine`, its
        first stage (their public keys) sent."""
        from fedseq.client.secure import SecureRound

        try:
            r = SecureRound(step.seq, step.secagg, mine)
        except ImportError:
            raise FedseqError("secure aggregation needs the cryptography package on this device: "
                              "pip install 'fedseq[secagg]'") from None
        with self.cond:
            self.secure = r
        self.send_secure("keys", run, step.seq, r.keys())
        return r

    def send_secure(self, stage: str, run: RunState, seq: int, items: Dict[int, Any]) -> None:
        """Publish this device's answer to a secure stage (again on every reconnect)."""
        msg = SecAggMessage(run_id=run.run_id, seq=seq, stage=stage, device=self.device,
                            items=items)
        self.send(f"secagg/{stage}", seq,
                  lambda: self.link.publish(self.topics.secagg(self.device), msg))

    def _on_run_config(self, rc: RunConfig) -> None:
        try:
            cfg = ExperimentConfig.model_validate(rc.config)
        except ValidationError as exc:
            # A config of this protocol that this device cannot follow (a model, dataset,
            # algorithm or rule not installed or not allowed here, an option it refuses): said to
            # the coordinator, which excludes this device from the run at once, with the reason.
            p = validation_problem(exc)
            reason = f"{self.device} cannot follow run {rc.run_id}: {p.where}: {p.msg}"
            self.report_failure(rc.run_id, -1, reason)  # -1: no step of this run can run here
            raise ProtocolError(reason) from exc
        why = REGISTRY.pin_problem(rc.plugins, DEVICE_GROUPS)
        if why is not None:  # another version of the lab's code: not the run's numbers
            reason = f"{self.device} cannot follow run {rc.run_id}: {why}"
            self.report_failure(rc.run_id, -1, reason)
            raise ProtocolError(reason)
        cfg.data.root = self.data_dir  # this device's files, never the coordinator's path
        with self.cond:
            if self.run is None or self.run.run_id != rc.run_id:
                log.info("joined run %s: %s on %s", rc.run_id, cfg.algorithm.name, cfg.data.dataset)
                back = self.parked if self.parked and self.parked[0].run_id == rc.run_id else None
                left, left_step = self.run, self.step
                self.run = back[0] if back else RunState(rc.run_id, cfg, frames=weights_frame_pool(cfg))
                self.step = back[1] if back else None
                leaving = None if left is None else (
                    left, left_step if left_step and left_step.run_id == left.run_id else None)
                self.parked = self._worth_keeping(None if back else self.parked, leaving)
                kept = self.parked[0].run_id if self.parked else None
                for run_id in list(self.blocks):  # this run's and the parked one's
                    if run_id not in (rc.run_id, kept):
                        del self.blocks[run_id]
                if self.next_step is not None and self.next_step.run_id == rc.run_id:
                    self.step, self.next_step = self.next_step, None
            self.cond.notify_all()
        if self.last_error[0] == rc.run_id and self.last_error[1] == -1:
            # it said it cannot follow this run (a stray message of another protocol came first)
            self.last_error = (None, None, "")
            self.announce()

    def _worth_keeping(self, a: Optional[Tuple[RunState, Optional[Step]]],
                       b: Optional[Tuple[RunState, Optional[Step]]]
                       ) -> Optional[Tuple[RunState, Optional[Step]]]:
        """Of a parked run and the run a new config just replaced, the one to park (one run is
        kept, so memory stays bounded): the one with more done (a step, downloaded blocks); so
        stray configs one after another, which bring neither, never displace the real run."""
        if a is None or b is None:
            return a or b

        def progress(p: Tuple[RunState, Optional[Step]]) -> Tuple[bool, int]:
            return p[1] is not None, len(self.blocks.get(p[0].run_id, {}))

        return b if progress(b) > progress(a) else a

    def _on_assignment(self, a: Assignment) -> None:
        if a.device != self.device:
            raise ProtocolError(f"assignment names device {a.device!r}, this is {self.device!r}")
        with self.cond:
            self.assignment = a
            self.cond.notify_all()

    def _on_weights_chunk(self, payload: bytes) -> None:
        self.weights_heard = time.monotonic()
        head, data = unpack_chunk(payload, WeightsHeader)
        parked = self.parked[0] if self.parked and self.parked[0].run_id == head.run_id else None
        run = parked or self._current_run(head.run_id, f"weights {head.block}")
        held = self.blocks.get(head.run_id, {}).get(head.block)
        if held is not None and held[0] >= head.version:
            return
        assert run.frames is not None
        frame = run.frames.add("coordinator", (head.block, head.version), head, data)
        if frame is None:
            return
        tensors = decode_tensors(frame, copy=False)
        with self.cond:
            if run is not self.run and not (self.parked and self.parked[0] is run):
                return
            self.blocks.setdefault(head.run_id, {})[head.block] = (head.version, tensors)
            run.frames.expire(lambda _, tag: tag[0] != head.block or tag[1] > head.version)
            self.cond.notify_all()

    # -- for the worker (hold `cond`) ------------------------------------------------------
    def next_ready(self) -> Optional[Tuple[RunState, Step]]:
        """The step to execute now, once its run, this device's assignment and every block
        version it needs are here; None while something is missing. A step whose blocks are
        already newer here (the coordinator moved on) is marked done and skipped."""
        run, step, a = self.run, self.step, self.assignment
        if run is None or step is None:
            return None
        if a is not None and a.run_id == run.run_id:
            run.clients = sorted(a.clients)  # the latest assignment of this run applies
            run.folders = dict(zip(a.clients, a.folders))
        verdict = self._verdict(run, step)
        if verdict == "superseded":
            run.done.add(step.seq)
        return (run, step) if verdict == "ready" else None

    def to_read(self) -> Optional[RunState]:
        """data.placement = "device": the current run, while its clients' folders are not read
        yet (the worker reads them and announces them: `announce_data`)."""
        run = self.run
        if run is None or run.cfg.data.placement != "device" or run.placed is not None:
            return None
        return None if self.last_error[:2] == (run.run_id, -1) else run

    def announce_data(self, run: RunState, report: DataReport) -> None:
        """Worker: the run's clients are read; the coordinator hears what they hold."""
        self.data_report = report
        self.announce()

    def _verdict(self, run: RunState, step: Step) -> str:
        """ready, waiting (not this run's, done already or idle), blocks (weights still
        arriving) or superseded (a block is newer here than the step needs: the coordinator
        moved on)."""
        if step.run_id != run.run_id or step.seq in run.done:
            return "waiting"
        if step.kind not in ("train", "async", "evaluate", "finetune"):
            return "waiting"
        if step.kind == "async" and not self.owed_dispatches(run, step):
            return "waiting"
        held = self.blocks.get(run.run_id, {})
        for block, version in step.versions.items():
            if block not in held or held[block][0] < version:
                return "blocks"
            if held[block][0] > version:
                return "superseded"
        return "ready"

    def owed_dispatches(self, run: RunState, step: Step) -> List[Tuple[int, int]]:
        """An async step's dispatches of this device's clients not trained yet: (client, the
        seq that dispatched it), oldest dispatch first."""
        if len(step.dispatched) != len(step.clients):
            raise ProtocolError(f"async step {step.seq} lists {len(step.clients)} clients and "
                                f"{len(step.dispatched)} dispatches")
        mine = set(run.clients)
        return sorted(((c, d) for c, d in zip(step.clients, step.dispatched)
                       if c in mine and run.answered.get(c) != d), key=lambda cd: (cd[1], cd[0]))

    def weights_stalled(self, now: float) -> bool:
        """Whether the current step lacks a block and no weights chunk has arrived for
        `resync_after` seconds: then the broker dropped chunks for this device (its queue
        overflowed, a QoS 1 message lost with a session), and a block that does not change is
        not published again, so the device would wait for good. The caller then subscribes to
        the weights again (`resync_weights`), which makes the broker deliver every retained
        block anew; each time the next silence doubles (RESYNC_MAX_S at most), and it is back to
        RESYNC_S once a step has its blocks."""
        run, step = self.run, self.step
        if run is None or step is None or self._verdict(run, step) != "blocks":
            self.resync_after = RESYNC_S
            return False
        if now - self.weights_heard < self.resync_after:
            return False
        self.weights_heard = now
        self.resync_after = min(2 * self.resync_after, RESYNC_MAX_S)
        return True

    def resync_weights(self) -> None:
        """Have the broker deliver every retained weights chunk again (MQTT 3.1.1, 3.8.4: a
        SUBSCRIBE of an existing filter re-sends its retained messages); the chunks of versions
        this device holds are ignored, the missing ones complete their frames."""
        step = self.step
        log.warning("step %s still lacks weights and none arrived for a while: asking the broker "
                    "for the retained blocks again", step.seq if step else "?")
        self.link.subscribe_again(self.topics.weights())

    def superseded(self, step: Step) -> bool:
        """Whether the coordinator has moved on from `step` (a newer step, or an abort)."""
        cur = self.step
        return cur is None or cur.seq != step.seq or step.run_id in self.aborted

    def weights(self, run: RunState, step: Step) -> Weights:
        """The held tensors of `step`'s blocks, each at the version the step names. Raises
        Superseded when a newer version has replaced one since the step was taken: in an async
        run the coordinator steps while devices train, and a client trained on the newer blocks
        would be reported on the older version (and fold, and replay, as a different update)."""
        with self.cond:
            held = self.blocks[run.run_id]
            out: Weights = {}
            for b, version in step.versions.items():
                if held[b][0] != version:
                    raise Superseded(f"step {step.seq} needs {b} version {version}, "
                                     f"version {held[b][0]} replaced it")
                out.update(held[b][1])
            return out

    def initial(self, run: RunState, blocks: List[str]) -> Weights:
        """The held tensors of blocks the coordinator never updates (personal blocks: the run's
        version 0)."""
        with self.cond:
            held = self.blocks[run.run_id]
            return {k: v for b in blocks for k, v in held[b][1].items()}

    # -- outbox ----------------------------------------------------------------------------
    def _current(self, key: str, seq: int) -> bool:
        """Whether the coordinator still takes the answer `key` to step `seq`: one of the current
        step's, or of a dispatch the current async step lists (hold `cond`)."""
        step = self.step
        if step is None:
            return False
        if seq == step.seq:
            return True
        return step.kind == "async" and key.startswith("update/") and \
            (int(key.split("/")[1]), seq) in zip(step.clients, step.dispatched)

    def send(self, key: str, seq: int, publish: Callable[[], object]) -> None:
        """Publish a result of step `seq` now and again on every reconnect while it is current
        (an async dispatch's while the current step lists it)."""
        with self.cond:
            for k, (s, _) in list(self.outbox.items()):
                if s != seq and not self._current(k, s):
                    del self.outbox[k]  # an older step's: the coordinator has moved on
                    self.sending.pop(k, None)
            self.outbox[key] = (seq, publish)
        self._publish([(key, publish)])

    def _publish(self, pending: List[Tuple[str, Callable[[], object]]]) -> None:
        for key, publish in pending:
            sent = publish()
            with self.cond:
                self.sending[key] = sent

    def resend_for(self, seq: Optional[int], clients: Set[int], mine: List[int]) -> None:
        """The coordinator lacks answers of step `seq` for `clients` (Control resend): publish
        again those of them this device has sent (its evaluation if it names one of its
        clients); nothing for a step that is not the current one or answers not sent yet."""
        with self.cond:
            step = self.step
            if step is None or seq != step.seq:
                return
            pending = [(k, p) for k, (s, p) in self.outbox.items() if self._current(k, s) and (
                k == "eval" and bool(clients & set(mine))
                or k.startswith("update/") and int(k.split("/")[1]) in clients)]
            pending = [(k, p) for k, p in pending if not on_the_way(self.sending.get(k))]
        if pending:
            log.info("the coordinator lacks %d of this device's answers to step %d: sending them "
                     "again", len(pending), seq)
        self._publish(pending)

    def resend(self, why: str) -> None:
        """Send the current step's results again (after a reconnect): what the broker may have
        lost."""
        with self.cond:
            pending = [(k, p) for k, (s, p) in self.outbox.items() if self._current(k, s)]
        if pending:
            log.info("%s: sending the current step's %d results again", why, len(pending))
        self._publish(pending)
