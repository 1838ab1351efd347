"""MqttPool: the ClientPool over an MQTT fleet.

Per step it publishes the blocks that changed (retained, versioned, chunked), then the step itself
(retained), and collects what the devices send back (collect.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Collection
from typing import Any

import torch

from fedseq.common import __version__
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan, plan_to_dict
from fedseq.common.codecs import decode, expected
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.placed import ClientData, announcement_problem, bounded, roster
from fedseq.common.errors import TransportError
from fedseq.common.evaluation import EvalReport
from fedseq.common.models import Weights, block_of, in_blocks
from fedseq.common.protocol.link import TlsOptions
from fedseq.common.protocol.messages import Assignment, Control, DeviceStatus, RunConfig, Step
from fedseq.common.protocol.tensors import frame_size
from fedseq.common.protocol.topics import Topics
from fedseq.common.registry import REGISTRY
from fedseq.common.secagg import MASKED, setup_to_dict
from fedseq.common.text import printable
from fedseq.server.pools.mqtt.blocks import BlockPublisher
from fedseq.server.pools.mqtt.broker_session import ServerSession, SessionEvent
from fedseq.server.pools.mqtt.collect import (
    DeadlinePolicy,
    Resender,
    collect_scores,
    collect_updates,
)
from fedseq.server.pools.mqtt.guard import FloodGuard, guard_password
from fedseq.server.pools.mqtt.inbox import UpdateArrived
from fedseq.server.pools.mqtt.secure_relay import SecureStages
from fedseq.server.privacy.secure_sum import SecureSum
from fedseq.server.rounds.pool_api import (
    AsyncPool,
    EvalOutcome,
    FinetuneOutcome,
    PoolState,
    Progress,
    ScoreCheck,
    TrainRound,
    UpdateCheck,
)
from fedseq.server.rounds.sites import assign_clients

log = logging.getLogger(__name__)

#: step numbers and block versions of a resumed run start this far past the checkpoint's
RESUME_GAP = 1000


def warn_other_versions(online: dict[str, DeviceStatus]) -> None:
    """A warning per device that runs another fedseq than this coordinator; its version is the
    device's words, logged as one plain line (it cannot forge a line of the log)."""
    for d, status in online.items():
        theirs = status.package_version
        if theirs and theirs != __version__:
            log.warning("%s runs fedseq %s, this coordinator %s: results may differ; install the "
                        "same version everywhere", printable(d, 80), printable(theirs, 100),
                        __version__)


def fleet_run_id(state: PoolState | None) -> str:
    """A fleet run's id: its checkpoint's pool state's (a resumed run keeps it: the devices
    hold their personal state under it), else a new one (the time, then 6 random hex digits)."""
    if state is not None and state.state:
        return str(state.state["run_id"])
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def restored_roster(state: PoolState | None) -> list[tuple[str, ClientData]]:
    """The clients a data.placement = "device" run numbered, from its checkpoint's pool state."""
    s = (state.state if state is not None else None) or {}
    return [(str(d), ClientData.from_dict(c)) for d, c in s.get("roster", [])]


class MqttPool(AsyncPool):
    """The logical clients hosted by the devices online on one broker.

    Set-up order (fedseq-server start): `start` (connect), `wait_for_devices`, then the round
    loop calls `restore` (resuming) and `open`; `close` says goodbye."""

    #: [secagg]: the devices mask their updates; this pool relays their stages (secure_relay.py)
    masks_on_devices = True

    def __init__(self, cfg: ExperimentConfig, url: str, run_id: str,
                 username: str | None = None, password: str | None = None,
                 tls: TlsOptions | None = None):
        self.cfg = cfg
        self.run_id = run_id
        self.personal: tuple[str, ...] = ()  # the algorithm's personal blocks (open)
        self.topics = Topics(cfg.deploy.topic_root)
        self.session = ServerSession(self.topics, run_id, url, username, password, tls)
        self.inbox = self.session.inbox
        self.guard: FloodGuard | None = None
        if cfg.deploy.guard_username:
            self.guard = FloodGuard(url, cfg.deploy.guard_username,
                                    guard_password(cfg.deploy.guard_password_file), tls)
        elif cfg.deploy.broker is not None:  # an external broker (Mosquitto) without the guard
            log.warning("no flood guard on %s: one device login flooding tiny messages can delay "
                        "every device's rounds by minutes; turn it on with deploy.guard_username "
                        "= \"fedseq-guard\" and deploy.guard_password_file (broker.conf's "
                        "dynamic-security plugin, the ansible roles' guard password; "
                        "docs/security.md)", printable(cfg.deploy.broker, 120))
        self.blocks = BlockPublisher(self.session.link, self.topics, run_id)
        self.session.republish_blocks_with(self.blocks.republish)
        self.deadlines = DeadlinePolicy(cfg.deploy)
        self.devices: list[str] = []
        #: data.placement = "device": (device, its client) in client-id order
        self.roster: list[tuple[str, ClientData]] = []
        self.assignment: dict[str, list[int]] = {}
        self.owner: dict[int, str] = {}
        self.seq = 0
        self.update_chunks = 1

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to the broker (three attempts), before anything slow happens; then the flood
        guard, where one is configured."""
        self.session.start()
        if self.guard is not None:
            self.guard.start()
            self.inbox.on_flood = self.guard.dropped

    def __enter__(self) -> MqttPool:
        """Connected (`start`); closed at the end of the block (`close`): a run that ends early
        tells its devices why (Control abort) before the error ends the process."""
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        ended = None
        if isinstance(exc, KeyboardInterrupt):
            ended = "the coordinator was stopped (Ctrl-C or SIGTERM); it may be resumed"
        elif exc is not None:
            ended = (str(exc).splitlines() or [type(exc).__name__])[0]
        self.close(abort=ended)

    def wait_for_devices(self, minimum: int, timeout: float) -> list[str]:
        """The devices online once at least `minimum` are (TransportError after `timeout`)."""
        self.devices = self.session.wait_for_devices(minimum, timeout)
        return self.devices

    def run_config(self) -> RunConfig:
        """The run config devices follow: the config less the coordinator's own keys, and the
        installed version of every plugin it uses (a device with another refuses the run)."""
        return RunConfig(run_id=self.run_id, config=self.cfg.for_devices(),
                         plugins=REGISTRY.pins(self.cfg.registered_names(),
                                               self.cfg.deploy.pin_plugin_code))

    def gather_clients(self, timeout: float) -> list[tuple[str, ClientData]]:
        """data.placement = "device": publish the run config, then wait (at most `timeout` s)
        until every online device has announced the clients in its data folder or said why it
        cannot follow the run; the clients are numbered by device name, then folder name. A
        device that said nothing, or announced what cannot be true, is left out, in one line."""
        self.session.retain(self.topics.run_config, self.run_config().encode())
        online = self.session.online
        deadline = time.monotonic() + timeout
        while (any(self.announcement(d) == (None, None) for d in online)
               and time.monotonic() < deadline):
            self.session.set_aside(self.session.drain(0.5))
        found: dict[str, list[ClientData]] = {}
        for d in sorted(online):
            clients, why = self.announcement(d)
            if clients is not None:
                found[d] = clients
            elif why is not None:
                log.warning("%s", why)
            else:
                log.warning("%s announced no clients within %.0f s (deploy.wait_devices_s): it "
                            "takes no part in run %s", d, timeout, self.run_id)
        if not found:
            raise TransportError(f"no device announced clients for run {self.run_id} (data."
                                 "placement = \"device\": each reads its fedseq-client --data-dir; "
                                 "the lines above say why)")
        found = bounded(self.cfg.data, found)
        self.roster = roster(found)
        self.devices = sorted(found)
        return self.roster

    def announcement(self, device: str) -> tuple[list[ClientData] | None, str | None]:
        """data.placement = "device": what `device` (online) said of this run: (its clients,
        None) when it announced clients that can be true (`announcement_problem`), (None, a
        line saying why) when it cannot follow the run, (None, None) while it has said nothing
        of it."""
        if device in self.session.incompatible:  # the device's own line
            return None, self.session.incompatible[device]
        unreadable = self.session.inbox.unreadable.get(device)
        if unreadable is not None:  # (its announcement out of bounds, say)
            return None, f"{device} cannot follow run {self.run_id}: its status: {unreadable}"
        report = self.session.online[device].data if device in self.session.online else None
        if report is None or report.run_id != self.run_id:
            return None, None
        clients = [ClientData.of(c) for c in report.clients]
        why = announcement_problem(self.cfg.data, clients)
        if why is not None:
            return None, f"{device} cannot follow run {self.run_id}: {printable(why, 300)}"
        return clients, None

    def open(self, weights: Weights, personal: tuple[str, ...]) -> None:
        """Publish the run config, the assignment and the current version of every block."""
        self.personal = personal
        resumed = bool(self.assignment)
        if not resumed and self.roster:  # data.placement = "device": where each client is
            self.assignment = {d: [c for c, (dd, _) in enumerate(self.roster) if dd == d]
                               for d in self.devices}
        elif not resumed:
            self.assignment = assign_clients(self.devices, self.cfg.data.num_clients)
        self.owner = {c: d for d, cs in self.assignment.items() for c in cs}
        warn_other_versions({d: self.session.online[d] for d in self.devices
                             if d in self.session.online})
        # An update frame holds at most every shared block's deltas: what bounds what each
        # device may make the inbox hold (its frames, its budget: Inbox.open).
        # (float32 as decoded, or in the updates' codec where that is larger: top-k near 1)
        shared = decode(in_blocks(weights, {block_of(k) for k in weights} - set(personal)))
        coded = {k: torch.empty(shape, dtype=dtype)  # sized, never filled
                 for k, (dtype, shape) in expected(shared, self.cfg.wire.codec("up")).items()}
        biggest = max(frame_size(shared), frame_size(coded)) + 4096
        if self.cfg.secagg.enabled:  # a masked input: a ring element per value and per tensor,
            # twice over (SCAFFOLD's control variates beside the deltas)
            n = 2 * sum(v.numel() + 1 for v in shared.values())
            biggest = max(biggest, frame_size({MASKED: torch.empty(n, dtype=torch.int32)}) + 4096)
        per_device = max(len(cs) for cs in self.assignment.values()) + 1
        # at most every shared tensor, coded, twice (SCAFFOLD's control variates beside them)
        self.inbox.open(self.owner, biggest, 2 * max(len(shared), len(coded)))
        self.update_chunks = self.inbox.update_chunks  # messages per update, at most
        self.session.retain(self.topics.run_config, self.run_config().encode())
        for d, clients in self.assignment.items():
            folders = [self.roster[c][1].folder for c in clients] if self.roster else []
            self.session.retain(self.topics.assignment(d), Assignment(
                run_id=self.run_id, device=d, clients=clients, folders=folders).encode())
        self.blocks.sync(weights, force=resumed)
        log.info("run %s: %d devices, %d clients each at most", self.run_id, len(self.devices),
                 per_device - 1)

    def snapshot(self) -> PoolState:
        state = {"run_id": self.run_id, "seq": self.seq, "assignment": self.assignment,
                 "published": self.blocks.state()}
        if self.roster:
            state["roster"] = [[d, c.to_dict()] for d, c in self.roster]
        return PoolState(state)

    def restore(self, state: PoolState) -> None:
        """A resumed run: the same assignment as before. Step numbers and block versions jump
        1000 past the checkpoint's: the crashed coordinator may have published a step or a new
        aggregate after its last checkpoint, and devices skip a step number they have already
        executed and a block version older than one they hold."""
        s = state.state or {}
        self.seq = int(s["seq"]) + RESUME_GAP
        self.assignment = {d: list(cs) for d, cs in s["assignment"].items()}
        self.roster = restored_roster(state)
        self.blocks.restore(s["published"], RESUME_GAP)

    def close(self, abort: str | None = None) -> None:
        """Say the run is over (idle step; first an abort naming `abort` when the run ended
        abnormally, so devices drop work nobody will collect), then disconnect. Never raises."""

        def goodbye() -> None:
            if abort is not None:
                self.session.link.publish(self.topics.control, Control(
                    run_id=self.run_id, command="abort", reason=abort))
            self._publish_step(kind="idle")
            self.blocks.clear()  # (a resumed run publishes everything again)
            self.session.clear_retained()

        try:
            self.session.close(goodbye)
        finally:
            if self.guard is not None:
                self.guard.stop()

    # -- steps -----------------------------------------------------------------------------
    def _prepare_step(self, weights: Weights) -> dict[str, int]:
        self.session.await_devices(set(self.assignment), self.cfg.deploy.min_devices,
                                   self.cfg.deploy.wait_devices_s)
        return self.blocks.sync(weights)

    def _publish_step(self, **fields: Any) -> Step:
        self.inbox.collect(self.seq + 1)  # before the step goes out: its answers may come fast
        if "secagg" not in fields:
            self.inbox.secure(-1)  # a secure round's stages end with its step
        self.seq += 1
        step = Step(run_id=self.run_id, seq=self.seq, **fields)
        if step.kind != "idle":  # what its answers take is granted to the devices it asks
            self.inbox.expect(step.clients if step.kind in ("train", "async") else None)
        self.session.retain(self.topics.step, step.encode())
        return step

    def train(self, round: int, clients: list[int], plan: ClientPlan, weights: Weights,
              check: UpdateCheck, enough: int | None = None,
              secure: SecureSum | None = None) -> TrainRound:
        versions = self._prepare_step(weights)
        extra: dict[str, Any] = {}
        if secure is not None:  # the devices mask; the coordinator relays their stages
            extra["secagg"] = setup_to_dict(secure.setup, secure.layout, secure.unweighted)
            self.inbox.secure(self.seq + 1, max(map(len, secure.setup.graph.values()),
                                                default=0))
        step = self._publish_step(kind="train", round=round, clients=clients,
                                  plan=plan_to_dict(plan), versions=versions, **extra)
        stages = None
        if secure is not None:
            stages = SecureStages(self.session, step.seq, secure, self.owner,
                                  self.cfg.deploy.round_timeout_min_s)
            secure.ask_unmask = stages.unmask
        return TrainRound(collect_updates(self.session, step.seq, round, clients, self.owner,
                                          check, self.deadlines, self.update_chunks, enough,
                                          stages))

    # -- an asynchronous run (server/pools/mqtt/arrivals.py; pool.AsyncPool) -------------------
    def device_of(self, client: int) -> str | None:
        """The device hosting `client` (None: none yet)."""
        return self.owner.get(client)

    def can_train(self, client: int, failing: Collection[str] = ()) -> bool:
        """`client`'s device is online, can run this run's steps, and is not in `failing`."""
        device = self.owner.get(client)
        return device in self.session.online and device not in self.session.incompatible \
            and device not in failing

    def online_devices(self) -> set[str]:
        """The devices online that host a client."""
        return {d for d in self.owner.values() if d in self.session.online}

    def cannot_run(self) -> dict[str, str]:
        """Devices that said they cannot run any step of this run -> why."""
        return dict(self.session.incompatible)

    def await_devices(self) -> None:
        """Wait for the assigned devices as a round does before its step (each has
        deploy.wait_devices_s for the run)."""
        self.session.await_devices(set(self.assignment), self.cfg.deploy.min_devices,
                                   self.cfg.deploy.wait_devices_s)

    def asker(self) -> Asker:
        """Asks again, after a silence, for the answers of the current step's clients that the
        broker's queue may have lost (as a round's collection does)."""
        return Asker(self)

    def wire_bytes(self) -> tuple[int, int]:
        """The (sent, received) bytes on the coordinator's connection since the last call."""
        return self.session.wire_bytes()

    def dispatch(self, round: int, flights: dict[int, int | None], plan: ClientPlan,
                 weights: Weights) -> int:
        """Publish an async step: model version `round` (its plan and blocks) and the clients in
        flight, each with the step that dispatched it (None: this one). Returns the step's seq:
        what the update of a client it dispatches answers."""
        versions = self._prepare_step(weights)
        seq = self.seq + 1
        table = {c: seq if d is None else d for c, d in flights.items()}
        self.inbox.collect_async(min(table.values(), default=seq))
        clients = sorted(table)
        self._publish_step(kind="async", round=round, clients=clients,
                           dispatched=[table[c] for c in clients], plan=plan_to_dict(plan),
                           versions=versions)
        return seq

    def async_events(self, timeout: float) -> list[SessionEvent]:
        """What the fleet sent within `timeout` seconds: updates (first those that came while an
        evaluation was collected), devices gone offline or failing."""
        if self.session.stashed:
            out: list[SessionEvent] = list(self.session.stashed)
            self.session.stashed.clear()
            return out
        return self.session.drain(timeout)

    def take(self, ev: UpdateArrived) -> ClientUpdate:
        """An arrived update, its deltas in memory (read back if they were spooled); its room in
        the inbox is free."""
        update = self.inbox.in_memory(ev.update, ev)
        self.inbox.release(ev)
        return update

    def release(self, ev: UpdateArrived) -> None:
        """An arrived update nobody takes (late, or refused before its deltas were read)."""
        self.inbox.release(ev)

    def end_async(self) -> None:
        """The asynchronous part is over: late updates are dropped from now on."""
        self.inbox.collect_async(-1)
        for ev in self.session.stashed:
            self.inbox.release(ev)
        self.session.stashed.clear()

    def evaluate(self, weights: Weights, eval_heads: tuple[str, ...], check: ScoreCheck
                 ) -> EvalOutcome:
        versions = self._prepare_step(weights)
        step = self._publish_step(kind="evaluate", versions=versions, eval_heads=list(eval_heads),
                                  personal=list(self.personal))
        scores = collect_scores(self.session, step.seq, self.assignment, check,
                                self.cfg.deploy.eval_timeout_s, lambda done, total: None)
        glob: tuple[int | None, int | None] = (None, None)
        if self.roster:  # the devices scored the global model on their clients' test rows
            g = scores.global_scores.values()
            glob = (sum(c for c, _ in g), sum(t for _, t in g)) if g else (None, None)
        return EvalOutcome(EvalReport(*glob, scores.scores), self.session.wire_bytes())

    def finetune(self, plan: ClientPlan, weights: Weights, eval_heads: tuple[str, ...],
                 check: ScoreCheck, progress: Progress) -> FinetuneOutcome:
        versions = self._prepare_step(weights)
        step = self._publish_step(kind="finetune", plan=plan_to_dict(plan), versions=versions,
                                  eval_heads=list(eval_heads), personal=list(self.personal))
        return collect_scores(self.session, step.seq, self.assignment, check,
                              self.cfg.deploy.finetune_timeout_s, progress)


class Asker:
    """`MqttPool.asker`: a Resender that follows the pool's current step."""

    def __init__(self, pool: MqttPool):
        self.pool = pool
        self.resender = Resender(pool.session, pool.seq, pool.update_chunks)

    def poll(self, owed: list[int]) -> None:
        """After each drain: ask again for `owed` clients' answers after a silence."""
        self.resender.seq = self.pool.seq  # a device answers an ask of its current step
        self.resender.poll(owed)
