"""The MQTT client pool: the coordinator's side of the wire.

Per step it publishes the blocks that changed (retained, versioned, chunked), then the step itself
(retained), and collects what devices send back until everyone answered, the deadline passed, or
the devices that were still owing went offline (their last will).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fedseq.common import __version__
from fedseq.common.algorithms import Algorithm
from fedseq.common.algorithms.aggregate import ClientUpdate, block_of
from fedseq.common.algorithms.plan import ClientPlan, plan_to_dict
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData
from fedseq.common.errors import FedseqError, ProtocolError, TransportError
from fedseq.common.evaluation import EvalReport, evaluate
from fedseq.common.models import BlockModel, Weights
from fedseq.common.protocol.frames import FramePool, unpack_chunk
from fedseq.common.protocol.link import Link, TlsOptions
from fedseq.common.protocol.messages import (
    PROTOCOL_VERSION,
    Assignment,
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
from fedseq.server.pool import UpdateCheck

log = logging.getLogger(__name__)


RESUME_SEQ_GAP = 1000


def _same_device(claimed: str, topic_device: str) -> None:
    if claimed != topic_device:
        raise ProtocolError(f"body names device {claimed!r} but was sent on {topic_device!r}'s topic")


def assign_clients(devices: list[str], num_clients: int) -> dict[str, list[int]]:
    """Balanced and stable: devices sorted by name, clients dealt round-robin."""
    names = sorted(devices)
    return {d: [c for c in range(num_clients) if c % len(names) == i] for i, d in enumerate(names)}


class MqttPool:
    """Connects first (start), so a broker problem is known before the dataset is loaded; the
    run's algorithm, model and data are bound afterwards (bind)."""

    alg: Algorithm
    model: BlockModel
    data: FederatedData

    def __init__(self, cfg: ExperimentConfig, url: str, run_id: str,
                 username: str | None = None, password: str | None = None,
                 tls: TlsOptions | None = None):
        self.cfg = cfg
        self.run_id = run_id
        self.topics = t = Topics(cfg.deploy.topic_root)
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.online: dict[str, DeviceStatus] = {}
        self.assignment: dict[str, list[int]] = {}
        self.owner: dict[int, str] = {}
        self.published: dict[str, tuple[int, str]] = {}
        self.failures: dict[str, str] = {}  # device -> the last reason it gave for a failed step
        self.incompatible: dict[str, str] = {}  # device -> why it cannot run any step of this run
        self.pace: dict[str, float] = {}  # device -> seconds per client in its last full round
        self.round_info: dict[str, Any] = {}  # what the coordinator adds to the round's row
        #: called with (clients done, clients in all) while devices report (fine-tuning progress)
        self.progress: Callable[[int, int], None] = lambda done, total: None
        self.seq = 0
        self.late = 0
        self.train_seq = -1  # the step whose updates are being collected; others are late
        self.frames = FramePool(max_frame=1, per_sender=1)  # sized in begin()
        self._down = self._up = 0
        # What the broker must hold for a device to (re)join; re-published on every reconnect,
        # because the broker's retained messages are only a cache (it may lose them).
        self._state_lock = threading.Lock()
        self._retained: dict[str, bytes] = {}
        self._weight_frames: dict[str, tuple[int, bytes, str]] = {}  # block: version, frame, sha256
        # the tensors each block was last encoded from (and their in-place edit counters): an
        # unchanged block is not encoded and hashed again every round
        self._encoded: dict[str, list[tuple[torch.Tensor, int]]] = {}
        will = ServerStatus(state="offline", run_id=run_id).encode()
        self.link = Link(f"fedseq-server-{run_id}", url,
                         [t.device_status(), t.update(), t.evaluation()], self._on_message,
                         will=(t.server_status, will), username=username, password=password,
                         tls=tls)
        self.link.on_connect(self._republish)

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        self.link.start(attempts=3)

    def bind(self, alg: Algorithm, model: BlockModel, data: FederatedData) -> None:
        self.alg, self.model, self.data = alg, model, data

    def _retain(self, topic: str, payload: bytes) -> None:
        with self._state_lock:
            self._retained[topic] = payload
        self.link.publish(topic, payload, retain=True)

    def _republish(self) -> None:
        """Network thread, after every (re)connect: server status, run config, assignments, the
        current version of every block and the current step, all retained."""
        status = ServerStatus(state="online", run_id=self.run_id, broker=self.link.url).encode()
        self.link.publish(self.topics.server_status, status, retain=True)
        with self._state_lock:
            retained = dict(self._retained)
            frames = dict(self._weight_frames)
        for topic, payload in retained.items():
            if topic != self.topics.step:
                self.link.publish(topic, payload, retain=True)
        for block, (version, frame, digest) in frames.items():
            self._publish_block(block, version, frame, digest)
        if self.topics.step in retained:  # last: a device acts on it once it holds the weights
            self.link.publish(self.topics.step, retained[self.topics.step], retain=True)
        if retained:
            log.info("re-published the run's state (%d blocks) after connecting", len(frames))

    def _publish_block(self, block: str, version: int, frame: bytes, digest: str) -> None:
        self.link.publish_frame(
            lambda i: self.topics.weights(block, i),
            lambda **kw: WeightsHeader(run_id=self.run_id, block=block, version=version, **kw),
            frame, retain=True, digest=digest)

    def _await_quorum(self) -> None:
        """Before a step: after a broker restart or a network drop, devices come back within
        seconds; wait for deploy.min_devices of the assigned ones instead of failing the step."""
        assigned = set(self.assignment)
        self._drain(0.0)
        if len(assigned & set(self.online)) >= min(self.cfg.deploy.min_devices, len(assigned)):
            return
        log.warning("waiting for devices: %d of %d assigned online",
                    len(assigned & set(self.online)), len(assigned))
        deadline = time.monotonic() + self.cfg.deploy.wait_devices_s
        while time.monotonic() < deadline:
            self._drain(0.5)
            if len(assigned & set(self.online)) >= min(self.cfg.deploy.min_devices, len(assigned)):
                time.sleep(0.5)  # let the others that reconnect together announce themselves
                self._drain(0.0)
                return
        log.warning("continuing with %d devices online", len(assigned & set(self.online)))

    def wait_for_devices(self, minimum: int, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.online) < minimum:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(
                    f"only {len(self.online)} of deploy.min_devices={minimum} devices came online "
                    f"within {timeout:.0f} s ({', '.join(sorted(self.online)) or 'none'}); start "
                    "fedseq-client on the devices with this broker URL, or lower deploy.min_devices"
                )
            self._drain(min(left, 0.5))
        time.sleep(0.5)  # let devices that connect together all announce themselves
        self._drain(0.01)
        return sorted(self.online)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "seq": self.seq, "assignment": self.assignment,
                "published": {b: list(v) for b, v in self.published.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        """A resumed run: same block versions and assignment as before. Step numbers jump 1000
        past the checkpoint's: the crashed coordinator may have published a step or two after its
        last checkpoint, and devices skip a step number they have already executed."""
        self.seq = int(state["seq"]) + RESUME_SEQ_GAP
        self.assignment = {d: list(cs) for d, cs in state["assignment"].items()}
        self.published = {b: (int(v[0]), str(v[1])) for b, v in state["published"].items()}

    def begin(self, devices: list[str], weights: Weights) -> None:
        """Publish the run config, the assignment and the current version of every block."""
        resumed = bool(self.assignment)
        if not resumed:
            self.assignment = assign_clients(devices, self.cfg.data.num_clients)
        self.owner = {c: d for d, cs in self.assignment.items() for c in cs}
        for d in devices:
            theirs = self.online[d].package_version if d in self.online else ""
            if theirs and theirs != __version__:
                log.warning("%s runs fedseq %s, this coordinator %s: results may differ; install the "
                            "same version everywhere", d, theirs, __version__)
        # An update frame holds at most every shared block's deltas; one device has at most
        # (its clients + 1) frames in flight. Bound: that many bytes per assigned device.
        shared = set(self.alg.shared_blocks())
        biggest = len(encode_tensors({k: v for k, v in weights.items() if block_of(k) in shared}))
        per_device = max(len(cs) for cs in self.assignment.values()) + 1
        self.frames = FramePool(max_frame=biggest + 4096, per_sender=(biggest + 4096) * per_device)
        rc = RunConfig(run_id=self.run_id, config=self.cfg.model_dump(mode="json"))
        self._retain(self.topics.run_config, rc.encode())
        for d, clients in self.assignment.items():
            self._retain(self.topics.assignment(d),
                         Assignment(run_id=self.run_id, device=d, clients=clients).encode())
        self._sync(weights, force=resumed)
        log.info("run %s: %d devices, assignment %s", self.run_id, len(devices), self.assignment)

    def finish(self, reason: str = "run finished") -> None:
        """Say idle and offline if still connected, then disconnect; never raises (it runs in a
        `finally` and must not mask the error that ended the run)."""
        try:
            if self.link.connected.is_set():
                self.seq += 1
                self._retain(self.topics.step,
                             Step(run_id=self.run_id, seq=self.seq, kind="idle").encode())
                self.link.publish(self.topics.server_status,
                                  ServerStatus(state="offline", run_id=self.run_id), retain=True,
                                  wait=True)
        except Exception as exc:  # best effort on the way out
            log.warning("could not say goodbye to the broker: %s", exc)
        finally:
            self.link.stop()

    # -- network thread --------------------------------------------------------------------
    def _on_message(self, topic: str, payload: bytes) -> None:
        """Network thread: parse and check what can be checked without the round's state. The
        sender is the device its topic names (the broker's ACL binds topics to logins); a body
        that claims another device is rejected."""
        t = self.topics
        if not payload:
            return
        try:
            parts = topic[len(t.root) + 1:].split("/") if topic.startswith(t.root + "/") else []
            if len(parts) == 3 and parts[0] == "device" and parts[2] == "status":
                status = DeviceStatus.decode(payload)
                _same_device(status.device, parts[1])
                self.events.put(("status", status))
            elif len(parts) == 2 and parts[0] == "eval":
                res = EvalResult.decode(payload)
                self._up += len(payload)
                _same_device(res.device, parts[1])
                if res.run_id != self.run_id:
                    raise ProtocolError(f"evaluation for run {res.run_id}, this is {self.run_id}")
                self.events.put(("eval", res))
            elif len(parts) == 4 and parts[0] == "update":
                self._on_update_chunk(parts[1], parts[2], parts[3], payload)
            else:
                raise ProtocolError("not a topic the coordinator reads")
        except FedseqError as exc:
            other = version_mismatch(payload)
            hint = (f" (it speaks protocol v{other[0]}, this coordinator v{PROTOCOL_VERSION}: install "
                    "the same fedseq version on both sides)") if other else ""
            log.warning("dropped message on %s: %s%s", topic, exc, hint)

    def _on_update_chunk(self, device: str, client: str, chunk: str, payload: bytes) -> None:
        head, data = unpack_chunk(payload, UpdateHeader)
        self._up += len(payload)
        _same_device(head.device, device)
        if str(head.client) != client or str(head.chunk) != chunk:
            raise ProtocolError(f"header says client {head.client} chunk {head.chunk}, topic "
                                f"says {client}/{chunk}")
        if head.run_id != self.run_id:
            raise ProtocolError(f"update for run {head.run_id}, this is {self.run_id}")
        if self.owner.get(head.client) != device:
            raise ProtocolError(f"client {head.client} is not assigned to {device}")
        if head.seq != self.train_seq:
            if head.chunk == 0:
                self.late += 1
                log.warning("late update of client %d from %s dropped: step %d, collecting step %d",
                            head.client, device, head.seq, self.train_seq)
            return
        frame = self.frames.add(device, (head.client, head.seq), head, data)
        if frame is None:
            return
        deltas = decode_tensors(frame, copy=False, check_finite=False)  # the contract checks values
        update = ClientUpdate(client=head.client, round=head.round, deltas=deltas,
                              num_samples=head.num_samples, effective_samples=head.effective_samples,
                              train_seconds=head.train_seconds,
                              bytes_up=len(frame),
                              local_score=None if head.local_correct is None or head.local_total is
                              None else (head.local_correct, head.local_total))
        self.events.put(("update", (device, head.seq, update)))

    # -- coordinator thread ----------------------------------------------------------------
    def _drain(self, timeout: float) -> list[tuple[str, Any]]:
        """Apply status events; return the others that arrived within `timeout`."""
        out: list[tuple[str, Any]] = []
        try:
            kind, ev = self.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return out
        while True:
            if kind == "status":
                if ev.state == "online":
                    known = self.online.get(ev.device)
                    self.online[ev.device] = ev
                    fresh = known is None or (known.error_seq, known.error) != (ev.error_seq, ev.error)
                    if ev.error and ev.error_run_id == self.run_id and fresh:
                        self.failures[ev.device] = ev.error
                        if ev.error_seq == -1:  # it cannot run any step of this run
                            self.incompatible[ev.device] = ev.error
                        out.append(("failed", (ev.device, ev.error_seq, ev.error)))
                else:
                    self.online.pop(ev.device, None)
                    out.append(("offline", ev.device))
            else:
                out.append((kind, ev))
            try:
                kind, ev = self.events.get_nowait()
            except queue.Empty:
                return out

    def _sync(self, weights: Weights, force: bool = False) -> dict[str, int]:
        """Publish the blocks whose content changed (all of them with force, same versions where
        unchanged); return {block: version} for all of them."""
        versions = {}
        for block in dict.fromkeys(block_of(k) for k in weights):
            tensors = {k: v for k, v in weights.items() if block_of(k) == block}
            seen = [(v, v._version) for v in tensors.values()]
            old = self.published.get(block)
            last = self._encoded.get(block, [])
            if old is not None and not force and len(seen) == len(last) and all(
                    a is b and n == m for (a, n), (b, m) in zip(seen, last, strict=True)):
                versions[block] = old[0]  # the very tensors published last time, unmodified
                continue
            frame = encode_tensors(tensors)
            digest = hashlib.sha256(frame).hexdigest()
            self._encoded[block] = seen
            if old is None or old[1] != digest or force:
                version = 0 if old is None else old[0] + (old[1] != digest)
                with self._state_lock:
                    self._weight_frames[block] = (version, frame, digest)
                self._publish_block(block, version, frame, digest)
                self._down += len(frame) * max(1, len(self.online))
                self.published[block] = (version, digest)
            versions[block] = self.published[block][0]
        return versions

    def _publish_step(self, **fields: Any) -> Step:
        self.seq += 1
        step = Step(run_id=self.run_id, seq=self.seq, **fields)
        payload = step.encode()
        self._retain(self.topics.step, payload)
        self._down += len(payload) * max(1, len(self.online))
        return step

    def round_bytes(self) -> tuple[int, int]:
        """Bytes to and from devices since the last call (weights fan out to every device)."""
        down, up = self._down, self._up
        self._down = self._up = 0
        return down, up

    def train(self, round: int, clients: list[int], plan: ClientPlan,
              weights: Weights, check: UpdateCheck) -> Iterator[ClientUpdate]:
        # What the coordinator does per update (validation, aggregation) is memory-bound; a team
        # of OpenMP threads only spins between those small ops, on the cores the broker and the
        # network thread need (bench/mqtt_round.py: coordinator CPU per round 140 -> 70 ms).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield from self._train(round, clients, plan, weights, check)
        finally:
            torch.set_num_threads(threads)

    def _train(self, round: int, clients: list[int], plan: ClientPlan,
               weights: Weights, check: UpdateCheck) -> Iterator[ClientUpdate]:
        self._await_quorum()
        versions = self._sync(weights)
        self.train_seq = self.seq + 1  # before the step goes out: its updates may come fast
        self.frames.expire(lambda sender, tag: tag[1] == self.train_seq)
        step = self._publish_step(kind="train", round=round, clients=clients,
                                  plan=plan_to_dict(plan), versions=versions)
        failed_devices: dict[str, str] = {}
        for device, reason in self.incompatible.items():
            if any(self.owner.get(c) == device for c in clients):
                failed_devices[device] = reason
                log.warning("round %d: %s cannot train (%s)", round, device, reason)
        owing = {c for c in clients if self.owner.get(c) in self.online
                 and self.owner.get(c) not in failed_devices}
        got: dict[int, ClientUpdate] = {}
        reporters: dict[int, str] = {}
        late_before = self.late
        timeout = self.round_deadline(clients)
        started = time.monotonic()
        deadline = started + timeout
        last_arrival: dict[str, float] = {}
        order = sorted(clients)
        yielded = 0

        def ready() -> Iterator[ClientUpdate]:
            """The updates that are next in client order: aggregation folds each one in while
            the rest are still arriving, in the same order as the simulation (bitwise parity)."""
            nonlocal yielded
            while yielded < len(order):
                c = order[yielded]
                if c in got:
                    yielded += 1
                    yield got[c]
                elif c not in owing:  # failed, offline or not assigned: never coming
                    yielded += 1
                else:
                    return

        while owing and time.monotonic() < deadline:
            for kind, ev in self._drain(min(1.0, deadline - time.monotonic())):
                if kind == "offline":
                    lost = {c for c in owing if self.owner.get(c) == ev}
                    if lost:
                        log.warning("round %d: device %s went offline; clients %s fail", round, ev,
                                    sorted(lost))
                    owing -= lost
                elif kind == "failed" and ev[1] in (step.seq, -1):
                    device, _, reason = ev
                    lost = {c for c in owing if self.owner.get(c) == device}
                    log.warning("round %d: %s cannot train (%s); clients %s fail", round, device,
                                reason, sorted(lost))
                    owing -= lost
                    failed_devices[device] = reason
                elif kind == "update":
                    device, seq, update = ev
                    if seq != step.seq:
                        continue  # a frame completed just as the step changed
                    # Validation comes first: an invalid update never displaces a valid one.
                    if check(update) is not None:
                        continue
                    if update.client in got:
                        log.info("round %d: duplicate update of client %d from %s ignored", round,
                                 update.client, device)
                        continue
                    got[update.client] = update
                    reporters[update.client] = device
                    last_arrival[device] = time.monotonic()
                    owing.discard(update.client)
            yield from ready()
        self.train_seq = -1
        self.frames.expire(lambda sender, tag: False)
        for device, at in last_arrival.items():
            mine = [c for c in clients if self.owner.get(c) == device]
            if all(c in got for c in mine):
                self.pace[device] = (at - started) / len(mine)
        self.round_info = {
            "deadline_s": float(f"{timeout:.1f}"),
            "reporters": {str(c): d for c, d in sorted(reporters.items())},
            "device_failures": failed_devices,
            "late_updates": self.late - late_before,
        }
        if owing:
            log.warning("round %d: no update from clients %s before the deadline", round, sorted(owing))
        owners = {self.owner.get(c) for c in clients}
        if not got and failed_devices and owners <= set(failed_devices):
            raise TransportError("no device can train: " + "; ".join(
                f"{d}: {r}" for d, r in sorted(failed_devices.items())) + " (fix it on the devices, "
                "check with fedseq-client doctor, then start the run again)")
        if len(got) < self.cfg.deploy.min_updates:  # the coordinator then discards the round
            reason = f"{len(got)} valid updates < deploy.min_updates={self.cfg.deploy.min_updates}"
            log.warning("round %d failed: %s", round, reason)
            self.round_info.update(quorum_failed=reason, received=sorted(got))
        owing.clear()
        yield from ready()  # those that waited for a client that never came

    def round_deadline(self, clients: list[int]) -> float:
        """deploy.round_timeout_s if set, else factor x the slowest device's recent pace times
        its clients this round, clamped to [min, max] (max while a device is unmeasured)."""
        d = self.cfg.deploy
        if d.round_timeout_s is not None:
            return d.round_timeout_s
        load: dict[str, int] = {}
        for c in clients:
            owner = self.owner.get(c)
            if owner is not None:
                load[owner] = load.get(owner, 0) + 1
        if not load or any(dev not in self.pace for dev in load):
            return d.round_timeout_max_s
        slowest = max(self.pace[dev] * n for dev, n in load.items())
        return min(max(d.round_timeout_factor * slowest, d.round_timeout_min_s), d.round_timeout_max_s)

    def _collect_evals(self, step: Step, timeout: float) -> dict[int, tuple[int, int]]:
        owing = {d for d, cs in self.assignment.items()
                 if cs and d in self.online and d not in self.incompatible}
        results: dict[int, tuple[int, int]] = {}
        progress: dict[str, int] = {}
        total = sum(len(self.assignment[d]) for d in owing)
        deadline = time.monotonic() + timeout
        while owing and time.monotonic() < deadline:
            for kind, ev in self._drain(min(1.0, deadline - time.monotonic())):
                if kind == "offline":
                    owing.discard(ev)
                elif kind == "failed" and ev[1] in (step.seq, -1):
                    log.warning("step %d: %s cannot evaluate (%s)", step.seq, ev[0], ev[2])
                    owing.discard(ev[0])
                elif kind == "eval" and ev.seq == step.seq and ev.device in owing:
                    reason = self._check_eval(ev)
                    if reason is not None:
                        log.warning("step %d: rejected evaluation from %s: %s", step.seq, ev.device,
                                    reason)
                        continue
                    if not ev.final:  # fine-tuning progress: counted, replaced by the final one
                        progress[ev.device] = len(ev.results)
                        self.progress(sum(progress.values()) + len(results), total)
                        continue
                    results.update({c: (int(r[0]), int(r[1])) for c, r in ev.results.items()})
                    progress.pop(ev.device, None)
                    owing.discard(ev.device)
                    self.progress(sum(progress.values()) + len(results), total)
        if owing:
            log.warning("step %d: no evaluation from %s", step.seq, sorted(owing))
        return results

    def _check_eval(self, ev: EvalResult) -> str | None:
        """Only the device's own clients, each with its exact test-set size as total."""
        mine = set(self.assignment.get(ev.device, []))
        for c, (correct, total) in ev.results.items():
            if c not in mine:
                return f"client {c} is not assigned to {ev.device}"
            expected = len(self.data.clients[c].test)
            if total != expected or not 0 <= correct <= total:
                return f"client {c}: {correct}/{total} correct, its test set has {expected} rows"
        return None

    def evaluate(self, weights: Weights, eval_heads: tuple[str, ...]) -> EvalReport:
        self._await_quorum()
        versions = self._sync(weights)
        step = self._publish_step(kind="evaluate", versions=versions, eval_heads=list(eval_heads))
        per_client = self._collect_evals(step, self.cfg.deploy.eval_timeout_s)
        glob = evaluate(self.model, self.data, weights, {}, (self.model.spec.head,),
                        batch=self.cfg.train.eval_batch_size)
        return EvalReport(glob.global_correct, glob.global_total, per_client)

    def finetune(self, plan: ClientPlan, weights: Weights, eval_heads: tuple[str, ...]) -> EvalReport:
        self._await_quorum()
        versions = self._sync(weights)
        step = self._publish_step(kind="finetune", plan=plan_to_dict(plan), versions=versions,
                                  eval_heads=list(eval_heads))
        per_client = self._collect_evals(step, self.cfg.deploy.finetune_timeout_s)
        return EvalReport(None, None, per_client)
