"""EdgePool: [hierarchy] on a fleet, the coordinator's side of the sites' edge aggregators.

Each site runs its own broker, its devices and one edge aggregator (`fedseq-server edge`,
server/ops/edge.py). The coordinator's broker carries only what crosses between the tiers, on
`<root>/site/<name>/...`: the run (`run`, retained: the run's whole config, which the edge needs
to fold as the coordinator would), the coordinator's tasks (`task`: a train step's k site rounds,
an evaluation, a fine-tuning, the end of the run; the frame holds the global model), the edge's
answers (`result`: one partial aggregate per round, or its clients' scores) and its presence
(`status`, retained, last will). The round loop admits every partial (the round contract's `admit`)
before it is folded; a site whose edge is offline or silent past the deadline costs its clients
that round, recorded with why.

With data.placement = "device" the run is published twice: first without a roster, and each
edge publishes it to its devices and says in its status what they announce; the coordinator
numbers every site's clients as a flat fleet's (`gather_clients`) and publishes the run again
with the roster, from which each edge loads its run (every client's sizes: the algorithm and the
round contract are the coordinator's). The roster is in the coordinator's checkpoint.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from fedseq.common.algorithms.plan import ClientPlan, plan_to_dict
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.placed import ClientData, announcement_problem, bounded, roster
from fedseq.common.errors import ConfigError, ProtocolError, TransportError
from fedseq.common.evaluation import EvalReport
from fedseq.common.models import Weights
from fedseq.common.protocol.frames import FramePool, unpack_chunk
from fedseq.common.protocol.link import Link, TlsOptions, session_id
from fedseq.common.protocol.messages import (
    RosterClient,
    ServerStatus,
    SiteResultHeader,
    SiteRun,
    SiteStatus,
    SiteTaskHeader,
)
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors, frame_size
from fedseq.common.protocol.topics import DEVICE_NAME, Topics
from fedseq.common.registry import REGISTRY
from fedseq.common.text import printable
from fedseq.server.pools.mqtt.broker_session import WaitShares
from fedseq.server.pools.mqtt.budget import Allowance, LoginBudgets, allowance, thread_seconds
from fedseq.server.pools.mqtt.guard import FloodGuard, guard_password
from fedseq.server.pools.mqtt.inbox import STATUS_BYTES
from fedseq.server.rounds.contract import RoundContract
from fedseq.server.rounds.pool_api import (
    EvalOutcome,
    FinetuneOutcome,
    PoolState,
    Progress,
    RoundOutcome,
    ScoreCheck,
    SiteRounds,
    TrainRound,
    UpdateCheck,
)
from fedseq.server.rounds.sites import Site, site_tree

log = logging.getLogger(__name__)

#: seconds past the sites' own deadlines (k site rounds) the coordinator waits for a partial
SLACK_S = 60.0
#: events (statuses, complete results) waiting for the coordinator's thread, at most
EVENTS = 4096


#: the coordinator's own accounts, files and paths: an edge aggregator uses its own (its
#: command line's logins, its --data-dir), never a path of another host
NOT_FOR_SITES = {
    "deploy": ("host", "broker", "username", "password_file", "ca_file", "cert_file", "key_file",
               "guard_username", "guard_password_file", "broker_password_file"),
    "data": ("root", "devices_root", "validation"),
    "seeds": ("noise",),  # the privacy noise's pinned seed: the coordinator's secret alone
}


def site_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """The run's config as an edge aggregator gets it: whole, since it folds as the coordinator
    does (the aggregation rule, the bounds, the clip norm, the sites), less NOT_FOR_SITES."""
    out = cfg.model_dump(mode="json")
    for section, keys in NOT_FOR_SITES.items():
        for key in keys:
            out.get(section, {}).pop(key, None)
    return out


class EdgePool:
    """The coordinator's ClientPool over the sites' edge aggregators (module docstring): a
    `SiteAggregators` pool. Set-up order as MqttPool's: `start`, `wait_for_sites`, `open`."""

    def __init__(self, cfg: ExperimentConfig, url: str, run_id: str,
                 username: str | None = None, password: str | None = None,
                 tls: TlsOptions | None = None):
        self.cfg, self.run_id = cfg, run_id
        self.topics = Topics(cfg.deploy.topic_root)
        self.sites = {s.name: s for s in site_tree(cfg)}
        #: data.placement = "device": (device, its client) in client-id order (`use_roster`)
        self.roster: list[tuple[str, ClientData]] = []
        self.k = cfg.hierarchy.edge_rounds
        self.personal: tuple[str, ...] = ()
        self.seq = 0
        self.status: dict[str, SiteStatus] = {}
        #: what the network thread hands over; bounded (a site's login that floods its status
        #: topic loses its own excess, nothing else)
        self.events: queue.Queue[tuple[str, str, Any]] = queue.Queue(maxsize=EVENTS)
        #: the task whose results are collected now (-1: none): a result of any other is dropped
        #: on arrival, before its frame is held or decoded
        self.awaiting = -1
        self.frames = FramePool(max_frame=1, per_sender=1)  # sized by open()
        self.reference: Weights = {}
        self.late = 0
        #: site -> the last task whose answer it began to send (a task sent again after this
        #: connection was down is answered again: the repeat is neither counted nor late)
        self.heard: dict[str, int] = {}
        #: each site's edge aggregator's share of deploy.wait_devices_s over the whole run
        self.shares = WaitShares(cfg.deploy.wait_devices_s)
        will = ServerStatus(state="offline", run_id=run_id).encode()
        self.link = Link(session_id("fedseq-server"), url,
                         [self.topics.site("+", "status"), self.topics.site("+", "result")],
                         self._on_message, will=(self.topics.server_status, will),
                         username=username, password=password, tls=tls)
        self.link.on_connect(self._republish)
        self._run: bytes | None = None
        self._task: tuple[str, dict[str, Any], bytes] = ("idle", {}, b"")  # `_send`'s last
        self._wire_seen = (0, 0)
        #: each site login's bytes and CPU of the network thread (budget.py, as a device's)
        self.budgets = LoginBudgets()
        self.flooded = 0  # messages dropped unread: their site spent its budget
        self._flooding: set[str] = set()
        self._named: set[str] = set()  # sites whose refusal of the run was logged
        #: the coordinator broker's flood guard (deploy.guard_username): a site login that keeps
        #: flooding past its budget is disabled at the broker, as a device login is
        self.guard = FloodGuard(url, cfg.deploy.guard_username,
                                guard_password(cfg.deploy.guard_password_file), tls
                                ) if cfg.deploy.guard_username else None

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to the coordinator's broker (three attempts), then the flood guard where
        one is configured."""
        self.link.start(attempts=3)
        if self.guard is not None:
            self.guard.start()

    def __enter__(self) -> EdgePool:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        self.close()

    def _republish(self) -> None:
        """Network thread, after every (re)connect: the coordinator's status and the run, and
        (on the coordinator's thread) the task being collected."""
        self.link.publish(self.topics.server_status, ServerStatus(
            state="online", run_id=self.run_id, broker=self.link.url).encode(), retain=True)
        if self._run is not None:
            for name in self.sites:
                self.link.publish(self.topics.site(name, "run"), self._run, retain=True)
        # the task being collected goes again to the sites yet to answer (`_collect`): what they
        # sent while this connection was down may be lost with a broker that restarted
        self._hand_over(("connected", "", None))

    def _on_message(self, topic: str, payload: bytes) -> None:
        """Network thread: the edges' statuses and results, as events (a malformed one is
        logged in a line and dropped)."""
        ref = self.topics.parse(topic)
        if ref is None or ref.device not in self.sites:
            return
        site = self.sites[ref.device]
        if not self.budgets.admit(site.name, len(payload), self._allowance(site)):
            self.flooded += 1
            if self.guard is not None:
                self.guard.dropped(site.name)  # (a site's login is its name)
            if site.name not in self._flooding:
                self._flooding.add(site.name)
                log.warning("dropped messages from site %s unread: its edge aggregator sends "
                            "more than its site's clients need", site.name)
            return
        self._flooding.discard(site.name)
        began = thread_seconds()
        try:
            if ref.kind == "site_status":
                if len(payload) > STATUS_BYTES * (1 + len(site.devices)):
                    raise ProtocolError(f"a status of {len(payload)} bytes")
                if payload:
                    st = SiteStatus.decode(payload)
                    if st.site != ref.device:
                        raise ProtocolError(f"a status of site {printable(st.site, 64)}")
                    self._hand_over(("status", ref.device, st))
            elif ref.kind == "site_result":
                head, data = unpack_chunk(payload, SiteResultHeader)
                if head.site != ref.device or head.run_id != self.run_id:
                    return  # another run's, or another site's words on this site's topic
                again = head.chunk == 0 and self.heard.get(ref.device) == head.seq
                if head.chunk == 0:
                    self.heard[ref.device] = head.seq
                if head.seq != self.awaiting:
                    # a task's answer after its collection ended (an answer sent again is not)
                    self.late += head.chunk == 0 and not again
                    return
                frame = self.frames.add(ref.device, head.seq, head, data)
                if frame is not None:
                    deltas = decode_tensors(frame, max_tensors=4 * len(self.reference) + 16)
                    self._hand_over(("result", ref.device, (head, deltas)))
        except ProtocolError as exc:
            log.warning("site %s sent an invalid message on %s: %s", ref.device, topic,
                        printable(exc, 300))
            if ref.kind == "site_result" and self.awaiting >= 0:  # it costs its own clients
                self._hand_over(("invalid", ref.device, printable(exc, 200)))
        finally:
            self.budgets.spent(site.name, thread_seconds() - began)

    def _allowance(self, site: Site) -> Allowance:
        """What a site's edge login may spend of the network thread: a device's allowance for
        its site's clients and devices (statuses, announcements), each answer a whole partial."""
        return allowance(len(site.clients) + len(site.devices), self.frames.max_frame)

    def _hand_over(self, event: tuple[str, str, Any]) -> None:
        """Network thread: queue an event for the coordinator's thread (dropped, with a line,
        when EVENTS wait already)."""
        try:
            self.events.put_nowait(event)
        except queue.Full:
            log.warning("site %s: event dropped, %d wait already", event[1], EVENTS)

    def _take(self, timeout: float) -> tuple[str, str, Any] | None:
        """The next event within `timeout` seconds (a status is applied here, and returned)."""
        try:
            ev = self.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if ev[0] == "status":
            self.status[ev[1]] = ev[2]
        return ev

    def online(self) -> dict[str, list[str]]:
        """The sites whose edge aggregator is online and follows the run -> their devices
        online."""
        return {s: list(st.devices) for s, st in self.status.items()
                if st.state == "online" and s not in self.refusing()}

    def refusing(self) -> dict[str, str]:
        """The sites whose edge aggregator said it cannot follow this run -> its line."""
        return {s: f"site {s} cannot follow run {self.run_id}: {printable(st.error, 500)}"
                for s, st in self.status.items()
                if st.state == "online" and st.error and st.error_run_id == self.run_id}

    def _refused_sites(self) -> None:
        """Each site that cannot follow the run named once, in its line; a TransportError
        where none of them can."""
        said = self.refusing()
        for s in sorted(set(said) - self._named):
            log.warning("%s", said[s])
        self._named |= set(said)
        if said and set(said) >= set(self.sites):
            raise TransportError("no site can follow run " + self.run_id + ": "
                                 + "; ".join(said[s] for s in sorted(said)))

    def wait_for_sites(self, minimum_devices: int, timeout: float) -> list[str]:
        """The devices online at every site once each site's edge aggregator is online with at
        least one device, and `minimum_devices` devices are online over all sites
        (deploy.min_devices counts devices wherever they are); after `timeout` seconds, what
        is online if that is enough, else a TransportError naming what is missing."""
        self._publish_run()  # the edges join the run and open their sites' pools
        deadline = time.monotonic() + timeout

        def devices() -> list[str]:
            return sorted(d for ds in self.online().values() for d in ds)

        while time.monotonic() < deadline:
            self._refused_sites()
            up, refusing = self.online(), self.refusing()
            if (all(up.get(s) or s in refusing for s in self.sites)
                    and len(devices()) >= minimum_devices):
                return devices()
            self._take(min(0.5, deadline - time.monotonic()))
        up = self.online()
        if up and len(devices()) >= max(1, minimum_devices):
            missing = sorted(set(self.sites) - set(up))
            if missing:
                log.warning("no edge aggregator online for site(s) %s: their clients miss every "
                            "round until one is", ", ".join(missing))
            return devices()
        raise TransportError(
            f"{len(devices())} devices online at {len(up)} of {len(self.sites)} sites after "
            f"{timeout:.0f} s (deploy.min_devices = {minimum_devices}): start each site's "
            "broker, its devices and its edge aggregator (fedseq-server edge --site NAME "
            f"--broker mqtt://SITE_BROKER --upstream {self.link.url}; docs/how-to/edge-sites.md)")

    def _publish_run(self, gathering: bool = False) -> None:
        """The run to every site (retained; again after a reconnect): with data.placement =
        "device" its roster, or none while `gathering` the sites' announcements."""
        listed = None
        if self.cfg.data.placement == "device" and not gathering:
            listed = [RosterClient(device=d, folder=c.folder, train=c.train, test=c.test,
                                   counts=list(c.counts)) for d, c in self.roster]
        self._run = SiteRun(run_id=self.run_id, config=site_config(self.cfg),
                            plugins=REGISTRY.pins(self.cfg.registered_names(),
                                               self.cfg.deploy.pin_plugin_code),
                            roster=listed).encode()
        for name in self.sites:
            self.link.publish(self.topics.site(name, "run"), self._run, retain=True)

    def gather_clients(self, minimum_devices: int, timeout: float
                       ) -> list[tuple[str, ClientData]]:
        """data.placement = "device": publish the run without a roster, then wait (at most
        `timeout` s) until every site's edge aggregator is online, `minimum_devices` devices are
        online over all sites, and each site has said what every device of it online announced
        (or why it cannot follow the run); the clients numbered as a flat fleet's (device name,
        then folder: `roster`). A device's announcement is checked here again; one that cannot
        be true, or comes from a device of another site, is left out in one line."""
        self._publish_run(gathering=True)
        deadline = time.monotonic() + timeout

        def told(site: str) -> bool:
            st = self.status.get(site)
            return site in self.refusing() or (
                st is not None and st.state == "online" and st.run_id == self.run_id
                and all(d in st.clients or d in st.refused for d in st.devices))

        def devices() -> int:
            return sum(len(ds) for ds in self.online().values())

        while time.monotonic() < deadline and not (
                all(told(s) for s in self.sites) and devices() >= minimum_devices):
            self._refused_sites()
            self._take(min(0.5, deadline - time.monotonic()))
        self._refused_sites()
        found: dict[str, list[ClientData]] = {}
        for name, site in self.sites.items():
            found.update(self._announced(name, site, told(name), timeout))
        found = bounded(self.cfg.data, found)
        if not found or devices() < minimum_devices:
            raise TransportError(
                f"{len(found)} devices announced clients for run {self.run_id} at "
                f"{len(self.online())} of {len(self.sites)} sites after {timeout:.0f} s "
                f"(deploy.min_devices = {minimum_devices}; data.placement = \"device\": each "
                "device reads its fedseq-client --data-dir; the lines above say why)")
        return roster(found)

    def _announced(self, name: str, site: Site, told: bool, timeout: float
                   ) -> dict[str, list[ClientData]]:
        """What site `name`'s status says its devices announced that can be true, each left
        out with a line saying why."""
        st = self.status.get(name)
        if name in self.refusing():  # (its own line is logged)
            return {}
        if st is None or st.state != "online" or st.run_id != self.run_id:
            log.warning("site %s said no clients within %.0f s (deploy.wait_devices_s): its "
                        "devices take no part in run %s", name, timeout, self.run_id)
            return {}
        if not told:
            log.warning("site %s: device(s) %s announced no clients within %.0f s: they take no "
                        "part in run %s", name, ", ".join(sorted(
                            set(st.devices) - set(st.clients) - set(st.refused))), timeout,
                        self.run_id)
        out: dict[str, list[ClientData]] = {}
        for why in sorted(st.refused.values()):  # the edge's line of each (its device's own)
            log.warning("site %s: %s", name, printable(why, 300))
        for d, sizes in sorted(st.clients.items()):
            clients = [ClientData.of(c) for c in sizes]
            wrong = (f"{printable(d, 64)} is not a device of site {name}"
                     if d not in site.devices else announcement_problem(self.cfg.data, clients))
            if wrong is None:
                out[d] = clients
            else:
                log.warning("site %s: %s cannot follow run %s: %s", name, printable(d, 64),
                            self.run_id, printable(wrong, 300))
        return out

    def use_roster(self, cfg: ExperimentConfig, found: list[tuple[str, ClientData]]) -> None:
        """data.placement = "device": the run's clients as numbered (`cfg` has their number);
        each site holds its own devices' clients."""
        self.cfg, self.roster = cfg, found
        owners = tuple(d for d, _ in found)
        self.sites = {s.name: s for s in site_tree(cfg, owners=owners)}

    def open(self, weights: Weights, personal: tuple[str, ...]) -> None:
        """Before the first task (the run was published by `wait_for_sites`): the results'
        frames are bounded by the model's size (a partial holds at most every tensor in
        float32)."""
        self.personal = personal
        self.reference = weights
        biggest = frame_size(weights) + 65536
        self.frames = FramePool(max_frame=biggest, per_sender=2 * biggest)
        log.info("run %s: %d sites (%s)", self.run_id, len(self.sites), ", ".join(self.sites))

    def snapshot(self) -> PoolState:
        """What a checkpoint holds: the run id, the task number reached and, with
        data.placement = "device", the roster (who holds which client)."""
        state: dict[str, Any] = {"run_id": self.run_id, "seq": self.seq}
        if self.roster:
            state["roster"] = [[d, c.to_dict()] for d, c in self.roster]
        return PoolState(state)

    def restore(self, state: PoolState) -> None:
        """A resumed run: task numbers continue past the checkpoint's (an edge skips none); the
        roster is the transport's (`use_roster`, from the checkpoint)."""
        self.seq = int((state.state or {}).get("seq", 0)) + 1000

    def close(self) -> None:
        """Tell every site the run is over (an idle task), then disconnect. Never raises."""
        try:
            if self._run is not None:
                self._send("idle", list(self.sites), {}, b"")
                for name in self.sites:  # the run is over (a resumed one publishes it again)
                    self.link.publish(self.topics.site(name, "run"), b"", retain=True)
                self._run = None
            self.link.publish(self.topics.server_status, ServerStatus(
                state="offline", run_id=self.run_id).encode(), retain=True, wait=True)
        except Exception as exc:  # noqa: BLE001 - closing must not hide the run's own outcome
            log.warning("closing the sites' run: %s", exc)
        finally:
            self.link.stop()
            if self.guard is not None:
                self.guard.stop()

    def wire_bytes(self) -> tuple[int, int]:
        """Payload bytes (sent, received) on this connection since the last call."""
        out, got = self.link.bytes_out, self.link.bytes_in
        before, self._wire_seen = self._wire_seen, (out, got)
        return out - before[0], got - before[1]

    # -- tasks -----------------------------------------------------------------------------
    def _send(self, kind: str, sites: list[str], fields: dict[str, Any], frame: bytes) -> int:
        """Publish a task of `kind` to each of `sites` (one frame, its chunks); its number (its
        results are collected from now on)."""
        self.seq += 1
        self.awaiting = self.seq
        self._task = (kind, fields, frame)
        self._publish_task(sites)
        return self.seq

    def _publish_task(self, sites: list[str]) -> None:
        """The task being collected (`_send`'s), to each of `sites`."""
        kind, fields, frame = self._task
        for name in sites:
            self.link.publish_frame(
                lambda i, name=name: self.topics.site(name, "task"),
                lambda name=name, **chunk: SiteTaskHeader(
                    run_id=self.run_id, site=name, seq=self.seq, kind=kind,
                    personal=list(self.personal), **fields.get(name, {}), **chunk),
                frame)

    def _collect(self, seq: int, sites: list[str], wait_s: float
                 ) -> tuple[dict[str, tuple[SiteResultHeader, Weights]], dict[str, str]]:
        """The sites' answers to task `seq` until each answered, went offline, or `wait_s`
        passed: (answers, site -> why it sent none)."""
        answers: dict[str, tuple[SiteResultHeader, Weights]] = {}
        missing: dict[str, str] = {}
        deadline = time.monotonic() + wait_s
        for s in sites:
            if s not in self.online():
                missing[s] = "its edge aggregator is offline"
        while len(answers) + len(missing) < len(sites):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ev = self._take(min(left, 1.0))
            if ev is None:
                continue
            what, site, body = ev
            if what == "connected":  # this connection was down: the task again, to whom owes
                owing = [s for s in sites if s not in answers and s not in missing]
                log.warning("task %d: the connection to %s was down; sent again to %s", seq,
                            self.link.url, ", ".join(owing) or "no site")
                self._publish_task(owing)
                continue
            if site not in sites or site in answers or site in missing:
                continue
            if what == "status" and body.state == "offline":
                missing[site] = "its edge aggregator went offline during the step"
            elif what == "result" and body[0].seq == seq:
                answers[site] = body
            elif what == "invalid":
                missing[site] = f"its answer is invalid: {body}"
        self.awaiting = -1
        for s in sites:
            if s not in answers and s not in missing:
                missing[s] = f"no answer within {wait_s:.0f} s"
        return answers, missing

    def _step_wait(self) -> float:
        """Seconds a site may take for its k site rounds: each within the devices' deadline."""
        d = self.cfg.deploy
        return self.k * (d.round_timeout_s or d.round_timeout_max_s) + SLACK_S

    def await_sites(self, sites: list[str]) -> None:
        """Before a task: wait for the edges of `sites` that are offline (restarting, or their
        host rebooting), each within what is left of its share of deploy.wait_devices_s
        (`WaitShares`, as a device's)."""
        def missing() -> set[str]:
            return self.shares.waitable(set(sites) - set(self.online()))

        if not missing():
            return
        log.warning("waiting up to %.0f s for the edge aggregators of %s",
                    self.shares.most(missing()), ", ".join(sorted(missing())))
        took = self.shares.wait(missing, lambda: not missing(), self._take)
        log.warning("waited %.1f s for edge aggregators; %d of %d sites online", took,
                    sum(s in self.online() for s in sites), len(sites))

    def site_rounds(self, round: int, by_site: dict[str, list[int]], plan: ClientPlan,
                    needed: list[str], start: Weights, contract: RoundContract) -> SiteRounds:
        """Each site's k site rounds of global round `round` (pool_api.SiteAggregators)."""
        sites = list(by_site)
        self.await_sites(sites)
        fields = {s: {"round": round, "clients": cs, "plan": plan_to_dict(plan),
                      "needed": list(needed), "bound": contract.max_abs_delta,
                      "clip": contract.clip} for s, cs in by_site.items()}
        wait_s = self._step_wait()
        seq = self._send("train", [s for s in sites if s in self.online()], fields,
                         encode_tensors(start))
        answers, missing = self._collect(seq, sites, wait_s)
        devices = sum(len(ds) for ds in self.online().values())
        outcome = RoundOutcome(deadline_s=wait_s, wire=self.wire_bytes(), able_devices=devices,
                               late_updates=self.late)
        self.late = 0
        return SiteRounds(answers, missing, outcome)

    def train(self, round: int, clients: list[int], plan: ClientPlan, weights: Weights,
              check: UpdateCheck, enough: int | None = None, secure: Any = None) -> TrainRound:
        """Not a fleet of sites' way: its rounds are the sites' (`site_rounds`)."""
        raise ConfigError("a fleet of sites trains through its edge aggregators "
                          "(EdgeSites.train), never one client at a time from the coordinator")

    def _scores(self, kind: str, fields: dict[str, Any], weights: Weights, check: ScoreCheck,
                wait_s: float) -> tuple[dict[int, tuple[int, int]], dict[int, int],
                                        tuple[int, int] | None]:
        """An evaluate or finetune task to every site online; the scores `check` accepts, the
        clients whose fine-tuning diverged and (data.placement = "device", evaluate) the global
        model on the test rows of the sites whose scores all passed, as their devices scored
        it."""
        self.await_sites(list(self.sites))
        sites = sorted(self.online())
        seq = self._send(kind, sites, dict.fromkeys(sites, fields), encode_tensors(weights))
        answers, missing = self._collect(seq, sites, wait_s + SLACK_S)
        for s, why in sorted(missing.items()):
            log.warning("site %s: no scores: %s", s, why)
        scores: dict[int, tuple[int, int]] = {}
        diverged: dict[int, int] = {}
        pooled: list[tuple[int, int]] = []
        for s, (head, _) in sorted(answers.items()):
            refused = 0
            for c, (correct, total) in head.scores.items():
                why = (check(c, correct, total) if c in self.sites[s].clients
                       else "not one of its own clients")
                if why is None:
                    scores[c] = (correct, total)
                else:
                    refused += 1
                    log.warning("site %s: score of client %d refused: %s", s, c, why)
            diverged.update({c: b for c, b in head.diverged.items() if c in scores})
            if head.global_score is not None:
                correct, total = head.global_score
                rows = sum(t for _, t in head.scores.values())
                if refused or total != rows or not 0 <= correct <= total:
                    log.warning("site %s: its global score %d/%d is left out (its clients' "
                                "scores hold %d test rows, %d of them refused)", s, correct,
                                total, rows, refused)
                else:
                    pooled.append((correct, total))
        glob = ((sum(c for c, _ in pooled), sum(t for _, t in pooled)) if pooled else None)
        return scores, diverged, glob

    def evaluate(self, weights: Weights, eval_heads: tuple[str, ...], check: ScoreCheck
                 ) -> EvalOutcome:
        """Every site scores its clients' personalized models; the global model is the
        coordinator's to score, or with data.placement = "device" the devices' (pooled)."""
        scores, _, glob = self._scores("evaluate", {"eval_heads": list(eval_heads)}, weights,
                                       check, self.cfg.deploy.eval_timeout_s)
        return EvalOutcome(EvalReport(*(glob or (None, None)), scores), self.wire_bytes())

    def finetune(self, plan: ClientPlan, weights: Weights, eval_heads: tuple[str, ...],
                 check: ScoreCheck, progress: Progress) -> FinetuneOutcome:
        """Every site's clients fine-tune and report their scores."""
        scores, diverged, _ = self._scores(
            "finetune", {"plan": plan_to_dict(plan), "eval_heads": list(eval_heads)}, weights,
            check, self.cfg.deploy.finetune_timeout_s)
        progress(len(scores), self.cfg.data.num_clients)
        return FinetuneOutcome(scores, diverged)


def site_name_problem(name: str) -> str | None:
    """Why `name` cannot name a site on the wire (None: it can)."""
    if not DEVICE_NAME.fullmatch(name):
        return (f"site name {printable(name, 80)!r} must be 1-64 letters, digits, '-' or '_' "
                "(it is a topic level)")
    return None


__all__ = ["EdgePool", "site_config", "site_name_problem"]
