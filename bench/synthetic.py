"""Synthetic devices: many protocol-complete fleet members in one process, for measuring what the
coordinator and the broker cost per device (bench/fleet.py, tests/server/test_fleet.py). A tool
of the benchmarks and tests, not of the coordinator: installs do not carry it.

Each synthetic device is what the coordinator sees of a real one: its own broker login and
session (a `Link`, with its last will), a retained DeviceInfo and an online DeviceStatus that it
re-publishes every heartbeat, the run config, its assignment, the steps and every weight chunk it
reads. It answers a train step once it holds the block versions the step needs, one client every
`pace` seconds (with `spread` > 0, each device's own pace, between pace and pace x (1 + spread):
a fleet of unequal devices whose answers come over a while, not in one burst), with an update
that passes the round contract (its clients' real sample counts
and test-set sizes from the partition, the plan's upload blocks with the model's names, dtypes and
shapes, in the plan's wire codec) and deterministic deltas instead of training; evaluate and
finetune steps get scores of the right totals. With `fail_rate` > 0 a device reports a step
failure (as a daemon whose step raised) for that fraction of steps, deterministically by (seed,
device, step). It resends the current step's answers after either side reconnects, as a daemon
does.

What it skips is the device's own work: no training, no sha256 of the weight frames (their chunks
are counted, not kept). Real daemons stay the reference for correctness; these are for cost.

    python bench/synthetic.py --broker URL --prefix synth --first 1 --count 250 \\
        --password-file PW --data-dir DATA [--pace 0.05] [--spread 0] [--fail-rate 0] \\
        [--topic-root fedseq]

prints `ready N` once all N devices are connected, and serves until SIGTERM or stdin closes.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import heapq
import itertools
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedseq.common import __version__
from fedseq.common.algorithms import run_model
from fedseq.common.codecs import Codec, encode
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import load_federated
from fedseq.common.data.rebalance import rebalanced_size
from fedseq.common.errors import FedseqError
from fedseq.common.models import Weights, block_of, shared_tensors
from fedseq.common.protocol.frames import CHUNK_BYTES, pack_chunk, split_frame, unpack_chunk
from fedseq.common.protocol.link import Link, session_id
from fedseq.common.protocol.messages import (
    HEARTBEAT_S,
    Assignment,
    Control,
    DeviceInfo,
    DeviceStatus,
    EvalResult,
    RunConfig,
    ServerStatus,
    Step,
    UpdateHeader,
    WeightsHeader,
)
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.common.stopping import SignalStop

log = logging.getLogger(__name__)


@dataclass
class RunFacts:
    """What every synthetic device of a process needs to know of one run, derived once from its
    config as a device derives it: per client its training and test rows and label counts, and
    the model's tensors (zeros) by name."""

    cfg: ExperimentConfig
    train: list[int]
    test: list[int]
    class_counts: list[torch.Tensor]
    reference: Weights


class Scheduler:
    """One thread that runs callbacks at their due time (the devices' paced answers and their
    heartbeats): N devices cost one thread here, not N."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        threading.Thread(target=self._run, name="synthetic-scheduler", daemon=True).start()

    def at(self, due: float, call: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._order), call))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._stopped:
                    return
                _, _, call = heapq.heappop(self._heap)
            try:
                call()
            except Exception:  # one device's bad moment must not stop the others' answers
                log.exception("synthetic device callback failed")


class Fleet:
    """The synthetic devices of one process, with what they share: the scheduler and the facts
    of each run (computed once, by the first device that reads its config)."""

    def __init__(self, data_dir: Path, pace: float = 0.05, fail_rate: float = 0.0, seed: int = 0,
                 spread: float = 0.0):
        self.data_dir = data_dir
        self.pace = pace
        self.spread = spread
        self.fail_rate = fail_rate
        self.seed = seed
        self.scheduler = Scheduler()
        self.devices: list[SyntheticDevice] = []
        self._facts: dict[str, RunFacts] = {}
        self._lock = threading.Lock()

    def facts(self, run_id: str, cfg: ExperimentConfig) -> RunFacts:
        with self._lock:
            if run_id not in self._facts:
                cfg.data.root = self.data_dir
                data = load_federated(cfg.data, cfg.seed_for("data"), only=[])  # labels only
                model = run_model(cfg, data.input_shape, data.num_classes)
                ref = {k: torch.zeros_like(v) for k, v in
                       shared_tensors(model, model.spec.blocks).items()}
                self._facts = {run_id: RunFacts(
                    cfg, [len(c.train) for c in data.clients], [len(c.test) for c in data.clients],
                    [c.train_class_counts(data.y, data.num_classes) for c in data.clients], ref)}
            return self._facts[run_id]

    def pace_of(self, device: str) -> float:
        return device_pace(self.pace, self.spread, self.seed, device)

    def fails(self, device: str, run_id: str, seq: int) -> bool:
        """Whether `device` reports step `seq` as failed (deterministic, rate `fail_rate`)."""
        if self.fail_rate <= 0:
            return False
        h = hashlib.sha256(f"{self.seed}/{device}/{run_id}/{seq}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64 < self.fail_rate

    def stop(self) -> None:
        """Say offline and disconnect, every device at once (a daemon's SIGTERM, N times)."""
        self.scheduler.stop()
        for d in self.devices:
            d._stopping = True
            d.link.publish(d.topics.device_status(d.name),
                           DeviceStatus(device=d.name, state="offline"), retain=True)
        time.sleep(1.0)
        for d in self.devices:
            d.link.client.disconnect()
        for d in self.devices:
            d.link.client.loop_stop()


def device_pace(pace: float, spread: float, seed: int, device: str) -> float:
    """A synthetic device's seconds per client: `pace` x (1 + spread x u), u in [0, 1) fixed by
    (seed, device)."""
    if spread <= 0:
        return pace
    h = hashlib.sha256(f"{seed}/pace/{device}".encode()).digest()
    return pace * (1.0 + spread * int.from_bytes(h[:8], "big") / 2**64)


def delta_value(client: int, round: int) -> float:
    """The synthetic update's value (every element): small, deterministic, per client and round,
    within a factor 2 of the others (none is an outlier of the round)."""
    return (1 + (client * 31 + round * 7) % 13 / 13) * 1e-4


@dataclass
class _Held:
    """The weight blocks a device holds (version per block) and the chunks of those arriving."""

    versions: dict[str, int] = field(default_factory=dict)
    arriving: dict[tuple[str, int], set[int]] = field(default_factory=dict)


class SyntheticDevice:
    """One fleet member on its own login (see the module docstring)."""

    def __init__(self, fleet: Fleet, name: str, url: str, password: str | None,
                 topic_root: str = "fedseq"):
        self.fleet, self.name = fleet, name
        self.pace = fleet.pace_of(name)  # seconds per client and step
        self.topics = t = Topics(topic_root)
        self.lock = threading.Lock()
        self.run: RunConfig | None = None
        self.facts: RunFacts | None = None  # the run's, derived once per process
        self.clients: list[int] = []
        self.step: Step | None = None
        self.held = _Held()
        self.done: set[int] = set()
        # the current step's answers (client, or -1 for an evaluation; topic; payload), sent again
        # after a reconnect and when the coordinator asks (Control resend)
        self.outbox: list[tuple[int, str, bytes]] = []
        self.outbox_seq = -1
        self.since = 0.0
        self.answered = 0  # client answers published (updates and scores)
        self._stopping = False
        offline = DeviceStatus(device=name, state="offline").encode()
        self.link = Link(session_id(f"fedseq-synthetic-{name}"), url,
                         [t.run_config, t.assignment(name), t.step, t.weights(), t.control,
                          t.server_status],
                         self.on_message, will=(t.device_status(name), offline),
                         username=name, password=password)
        self.link.on_connect(self._connected)

    # -- presence --------------------------------------------------------------------------
    def start(self) -> None:
        self.link.start(attempts=5)
        self.fleet.scheduler.at(time.monotonic() + HEARTBEAT_S, self._heartbeat)

    def _connected(self) -> None:
        self.since = time.time()
        info = DeviceInfo(device=self.name, package_version=__version__,
                          python=sys.version.split()[0], torch=torch.__version__,
                          machine="synthetic", threads=1)
        self.link.publish(self.topics.device_info(self.name), info, retain=True)
        self.announce()
        self._resend()

    def announce(self, error: str = "", seq: int | None = None, run_id: str | None = None) -> None:
        st = DeviceStatus(device=self.name, state="online", package_version=__version__,
                          since=self.since, error=error, error_seq=seq, error_run_id=run_id)
        self.link.publish(self.topics.device_status(self.name), st, retain=True)

    def _heartbeat(self) -> None:
        if self._stopping:
            return
        if self.link.connected.is_set():
            self.announce()
        self.fleet.scheduler.at(time.monotonic() + HEARTBEAT_S, self._heartbeat)

    # -- network thread --------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        ref = self.topics.parse(topic)
        kind = ref.kind if ref is not None else ""
        try:
            if kind == "weights":
                self._on_chunk(payload)
            elif kind == "run_config":
                rc = RunConfig.decode(payload)
                facts = self.fleet.facts(rc.run_id, ExperimentConfig.model_validate(rc.config))
                with self.lock:
                    if self.run is None or self.run.run_id != rc.run_id:
                        self.run, self.held, self.done = rc, _Held(), set()
                        self.facts = facts
            elif kind == "assignment":
                a = Assignment.decode(payload)
                with self.lock:
                    if a.device == self.name:
                        self.clients = sorted(a.clients)
            elif kind == "step":
                with self.lock:
                    self.step = Step.decode(payload)
            elif kind == "control":
                ctl = Control.decode(payload)
                if ctl.command == "resend":
                    self._resend(ctl.seq, set(ctl.clients))
                    return
                with self.lock:
                    if self.run is not None and ctl.run_id == self.run.run_id:
                        self.step, self.outbox = None, []
            elif kind == "server_status":
                if ServerStatus.decode(payload).state == "online":
                    self._resend()
                return
            else:
                return
        except (FedseqError, ValueError) as exc:
            log.warning("%s dropped a message on %s: %s", self.name, topic, exc)
            return
        self._maybe_start()

    def _on_chunk(self, payload: bytes) -> None:
        head, data = unpack_chunk(payload, WeightsHeader)
        with self.lock:
            if self.run is None or head.run_id != self.run.run_id:
                return
            if self.held.versions.get(head.block, -1) >= head.version:
                return
            key = (head.block, head.version)
            seen = self.held.arriving.setdefault(key, set())
            seen.add(head.chunk)
            if len(seen) == head.chunks:
                self.held.versions[head.block] = head.version
                self.held.arriving = {k: v for k, v in self.held.arriving.items()
                                      if k[0] != head.block or k[1] > head.version}

    def _maybe_start(self) -> None:
        """Network thread: schedule the current step's answers once it is ready here."""
        with self.lock:
            run, step, facts = self.run, self.step, self.facts
            if (run is None or facts is None or step is None or step.run_id != run.run_id
                    or step.seq in self.done):
                return
            if step.kind not in ("train", "evaluate", "finetune"):
                return
            for block, version in step.versions.items():
                if self.held.versions.get(block, -1) < version:
                    return  # still arriving
            self.done.add(step.seq)
            mine = [c for c in step.clients if c in self.clients] if step.clients else self.clients
            self.outbox, self.outbox_seq = [], step.seq
        if not mine:
            return
        if self.fleet.fails(self.name, run.run_id, step.seq):
            self.fleet.scheduler.at(time.monotonic() + self.pace, lambda: self.announce(
                f"synthetic failure of step {step.seq}", step.seq, run.run_id))
            return
        now = time.monotonic()
        if step.kind == "train":
            for i, c in enumerate(mine):
                self.fleet.scheduler.at(now + (i + 1) * self.pace,
                                        functools.partial(self._send_update, facts, step, c))
        else:
            self.fleet.scheduler.at(now + len(mine) * self.pace,
                                    lambda: self._send_scores(facts, step, mine))

    # -- answers (scheduler thread) --------------------------------------------------------
    def _current(self, step: Step) -> bool:
        cur = self.step
        return not self._stopping and cur is not None and cur.seq == step.seq

    def _send(self, client: int, topic: str, payload: bytes, step: Step) -> None:
        with self.lock:
            if self.outbox_seq == step.seq:
                self.outbox.append((client, topic, payload))
        self.link.publish(topic, payload)
        self.answered += 1

    def _resend(self, seq: int | None = None, clients: set[int] | None = None) -> None:
        """The current step's answers again: all of them (a reconnect), or those of step `seq`
        for `clients` (the coordinator asked; an evaluation if it names one of ours)."""
        with self.lock:
            current = self.step is not None and self.step.seq == self.outbox_seq
            if not current or (seq is not None and seq != self.outbox_seq):
                return
            pending = [(t, p) for c, t, p in self.outbox if clients is None or c in clients
                       or c == -1 and bool(clients & set(self.clients))]
        for topic, payload in pending:
            self.link.publish(topic, payload)

    def _send_update(self, facts: RunFacts, step: Step, c: int) -> None:
        if not self._current(step) or step.plan is None:
            return
        plan = step.plan
        v = delta_value(c, step.round)
        deltas = {k: torch.full_like(t, v) for k, t in facts.reference.items()
                  if block_of(k) in plan["upload"]}
        deltas = encode(deltas, Codec.parse(plan.get("codec", "none")))[0]  # wire.up
        threshold = (plan.get("params") or {}).get("threshold")  # FedReG's
        effective = (rebalanced_size(facts.class_counts[c], threshold)[1]
                     if threshold is not None else None)
        frame = encode_tensors(deltas)
        digest = hashlib.sha256(frame).hexdigest()
        meta = dict(run_id=step.run_id, seq=step.seq, round=step.round, client=c, device=self.name,
                    num_samples=facts.train[c], effective_samples=effective,
                    train_seconds=self.pace, local_correct=facts.test[c] // 2,
                    local_total=facts.test[c])
        topic = self.topics.update(self.name)
        parts = split_frame(frame, CHUNK_BYTES)
        for i, part in enumerate(parts):
            head = UpdateHeader(**meta, chunk=i, chunks=len(parts), size=len(frame), sha256=digest)
            self._send(c, topic, pack_chunk(head, part), step)

    def _send_scores(self, facts: RunFacts, step: Step, mine: list[int]) -> None:
        if not self._current(step):
            return
        msg = EvalResult(run_id=step.run_id, seq=step.seq, device=self.name,
                         results={c: (facts.test[c] // 2, facts.test[c]) for c in mine})
        self._send(-1, self.topics.evaluation(self.name), msg.encode(), step)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--broker", required=True)
    ap.add_argument("--prefix", default="synth")
    ap.add_argument("--first", type=int, default=1)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--password-file", type=Path)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--pace", type=float, default=0.05, help="seconds per client and step")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="each device's pace is between pace and pace x (1 + spread)")
    ap.add_argument("--fail-rate", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topic-root", default="fedseq")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    password = args.password_file.read_text().strip() if args.password_file else None
    fleet = Fleet(args.data_dir, args.pace, args.fail_rate, args.seed, args.spread)
    stop = SignalStop()  # its handler is re-entrant (a second SIGTERM, common/stopping.py)
    signal.signal(signal.SIGTERM, stop.handler)
    for i in range(args.first, args.first + args.count):
        dev = SyntheticDevice(fleet, device_name(args.prefix, i), args.broker, password,
                              args.topic_root)
        dev.start()
        fleet.devices.append(dev)
    print(f"ready {len(fleet.devices)}", flush=True)

    def parent_gone() -> None:  # stdin closes when the process that started us ends
        sys.stdin.read()
        stop.event.set()

    threading.Thread(target=parent_gone, daemon=True).start()
    stop.event.wait()
    fleet.stop()


def device_name(prefix: str, i: int) -> str:
    return f"{prefix}{i:04d}"


if __name__ == "__main__":
    main()
