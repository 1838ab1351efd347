"""fedseq-server edge: a site's edge aggregator ([hierarchy] on a fleet).

Upstream, on the coordinator's broker, it is one participant holding its site's clients: it
reads the run (`<root>/site/<name>/run`) and the coordinator's tasks, and answers each train task
with one partial aggregate (server/pools/mqtt/edges.py has the coordinator's side). Downstream,
on its site's broker, it is the coordinator its devices already speak to: an MqttPool over the
site's devices, holding the clients the run's deal gives them (sites.py `site_tree`), or with
data.placement = "device" those they announced (the coordinator's roster numbers them). Between
the two it runs the site's k site rounds with the round loop's own code (sites.py
`EdgeSites.partials` over a Ledger of its own): the round contract, the algorithm's weights, the
codecs, the same sums in the same order as a simulation's site, so two tiers on a fleet give the
simulation's numbers.

It serves run after run until stopped (a systemd unit on the site's host); a restarted edge
reads the run again from its retained message and answers the next task (the round it missed
costs its site's clients that round, recorded by the coordinator with why).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.algorithms.plan import plan_from_dict
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.placed import ClientData
from fedseq.common.errors import ConfigError, FedseqError, ProtocolError, validation_problem
from fedseq.common.models import Weights, block_of, in_blocks
from fedseq.common.protocol.frames import FramePool, unpack_chunk
from fedseq.common.protocol.link import Link, TlsOptions, session_id
from fedseq.common.protocol.messages import (
    ClientSizes,
    SiteClient,
    SiteResultHeader,
    SiteRun,
    SiteStatus,
    SiteTaskHeader,
)
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.common.registry import REGISTRY
from fedseq.common.text import printable
from fedseq.server.pools.mqtt.mqtt_pool import MqttPool
from fedseq.server.rounds.experiment import load_experiment
from fedseq.server.rounds.ledger import Ledger, RoundUpdates
from fedseq.server.rounds.pool_api import PoolState
from fedseq.server.rounds.sites import EdgeSites, deal, site_tree

log = logging.getLogger(__name__)

#: the largest task frame an edge takes (the global model, float32): 2 GiB
MAX_TASK_BYTES = 1 << 31
#: an edge's pool opens at step number and block version (its first task's number) x this,
#: past what an edge of the same run before it can have published (a task publishes at most
#: hierarchy.edge_rounds <= 100 steps and versions of a block), so the site's devices, which
#: skip a step number they have run and a block version older than one they hold, follow an
#: edge aggregator restarted mid-run
TASK_STRIDE = 1000


@dataclass(frozen=True)
class Login:
    """A broker login: user name, password, TLS options; on the site's broker, the flood
    guard's login and its password file (deploy.guard_username, deploy.guard_password_file)."""

    username: str | None = None
    password: str | None = None
    tls: TlsOptions | None = None
    guard_username: str | None = None
    guard_password_file: Path | None = None


class EdgeRun:
    """One run at the site: its experiment (the partition's sizes, the model, the algorithm),
    the MqttPool over the site's devices and the round loop's bookkeeping for its site rounds.
    With data.placement = "device" and no roster yet, the run is first published to the site's
    devices, whose announcements the edge's status carries upstream (`announcements`); the
    coordinator's roster then settles it (`settle`)."""

    def __init__(self, site: str, cfg: ExperimentConfig, run_id: str, broker: str,
                 login: Login, roster: list[tuple[str, ClientData]] | None = None):
        names = [s.name for s in site_tree(cfg)]
        if site not in names:
            raise ConfigError(f"run {run_id} has no site {site!r} (hierarchy.sites: "
                              f"{', '.join(names)})")
        self.name, self.run_id, self.login = site, run_id, login
        self.listed = set(cfg.hierarchy.sites[site])
        self.book: Ledger | None = None
        self.opened = False
        self._configure(cfg)
        self.pool = MqttPool(cfg, broker, run_id, login.username, login.password, login.tls)
        self.pool.start()
        try:
            if cfg.data.placement == "device" and roster is None:  # the devices announce first
                self.pool.session.retain(self.pool.topics.run_config,
                                         self.pool.run_config().encode())
            else:
                self.settle(cfg, roster)
        except BaseException:
            self.pool.close()
            raise

    def _configure(self, cfg: ExperimentConfig) -> None:
        """The coordinator counts devices over all sites; here a step waits for this site's.
        The site broker's flood guard is this host's (the run's config carries none)."""
        cfg.deploy.min_devices = 1
        cfg.deploy.guard_username = self.login.guard_username
        cfg.deploy.guard_password_file = self.login.guard_password_file

    def settle(self, cfg: ExperimentConfig, roster: list[tuple[str, ClientData]] | None) -> None:
        """The run's experiment loaded (with data.placement = "device" from the coordinator's
        `roster`: every client's device and sizes, in client-id order), the site's clients and
        the round loop's bookkeeping over its pool."""
        if roster is not None and len(roster) != cfg.data.num_clients:
            raise ConfigError(f"run {self.run_id}: its roster lists {len(roster)} clients, its "
                              f"config {cfg.data.num_clients}")
        self._configure(cfg)
        exp = load_experiment(cfg, test_images_only=True, announced=roster)
        self.site = next(s for s in site_tree(cfg, owners=exp.data.owners) if s.name == self.name)
        dealt = deal(cfg, exp.data.owners)
        self.dealt = {d: dealt[d] for d in self.site.devices}
        self.pool.cfg, self.pool.roster = cfg, list(roster or [])
        self.book = Ledger(cfg, exp.algorithm, exp.model, exp.data, self.pool, collect_threads=1)
        self.sites = EdgeSites(self.book)

    def announcements(self) -> tuple[dict[str, list[ClientData]], dict[str, str]]:
        """Before the roster (data.placement = "device"): what each of the site's devices online
        announced for this run, and those that cannot follow it, each with a line saying why
        (MqttPool.announcement). Empty once the run has its roster."""
        if self.book is not None:
            return {}, {}
        clients: dict[str, list[ClientData]] = {}
        refused: dict[str, str] = {}
        for d in self.devices():
            announced, why = self.pool.announcement(d)
            if announced is not None:
                clients[d] = announced
            elif why is not None:
                refused[d] = why
        return clients, refused

    def devices(self) -> list[str]:
        """The site's devices online now (their statuses applied first)."""
        session = self.pool.session
        session.set_aside(session.drain(0.0))
        return sorted(d for d in session.online if d in self.listed)

    def _open(self, h: SiteTaskHeader, weights: Weights) -> None:
        """Before the first task: the site's devices online, its pool opened on the clients
        the run's deal gives them, its step numbers and block versions past any an edge of
        this run before it published (TASK_STRIDE)."""
        if self.opened:
            return
        if self.book is None:
            raise ConfigError(f"run {self.run_id} has no roster here yet (data.placement = "
                              "\"device\": the coordinator publishes it once the sites' devices "
                              "have announced their clients)")
        self.pool.wait_for_devices(1, self.book.cfg.deploy.wait_devices_s)
        floor = h.seq * TASK_STRIDE
        self.pool.restore(PoolState({
            "run_id": self.run_id, "seq": floor, "assignment": self.dealt,
            "published": {b: [floor, ""] for b in dict.fromkeys(map(block_of, weights))},
            "roster": [[d, c.to_dict()] for d, c in self.pool.roster]}))
        self.pool.open(weights, tuple(h.personal))
        self.opened = True

    def train(self, h: SiteTaskHeader, start: Weights) -> tuple[dict[str, Any], Weights]:
        """The site's k site rounds of global round h.round: the result's fields and its
        partial's deltas (none where the site folded nothing)."""
        self._open(h, start)
        book = self.book
        assert book is not None
        plan = plan_from_dict(h.plan or {})
        mine = [c for c in h.clients if c in self.site.clients]
        contract = book.contract(h.round, mine, plan, start, h.bound)
        got = RoundUpdates(WeightedDeltaSum())
        partials = self.sites.partials(h.round, mine, plan, h.needed, contract, got,
                                       got.checker(h.round), start,
                                       book.sent(in_blocks(start, h.needed), fresh=True))
        fields: dict[str, Any] = {
            "round": h.round, "rejected": {c: str(r) for c, r in got.rejected.items()},
            "failures": dict(got.outcome.device_failures),
            "blocked": sorted(got.outcome.blocked), "bytes_up": got.bytes_up,
            "recovered": self.sites.recovered, "excluded": self.sites.excluded}
        if not partials:
            return fields, {}
        p = partials[0]
        fields["weights"] = p.weights
        fields["clients"] = [SiteClient(
            client=c, device=got.outcome.reporters.get(c, ""), num_samples=got.samples[c][0],
            effective_samples=got.samples[c][1], train_seconds=got.paces[c][0],
            local_correct=got.local_scores[c][0] if c in got.local_scores else None,
            local_total=got.local_scores[c][1] if c in got.local_scores else None,
            upload_bytes=got.uploads.get(c, 0), norm=got.norms.get(c),
            under_clip=got.under_clip.get(c), folds=got.folds.get(c, 1)) for c in p.clients]
        return fields, p.deltas

    def scores(self, h: SiteTaskHeader, weights: Weights) -> dict[str, Any]:
        """An evaluate or finetune task: its clients' scores (the coordinator checks them)."""
        self._open(h, weights)
        if h.kind == "evaluate":
            report = self.pool.evaluate(weights, tuple(h.eval_heads), lambda c, k, n: None).report
            if report.global_total is None:
                return {"scores": report.per_client}
            # data.placement = "device": the devices scored the global model on their test rows
            return {"scores": report.per_client,
                    "global_score": (int(report.global_correct or 0), report.global_total)}
        done = self.pool.finetune(plan_from_dict(h.plan or {}), weights, tuple(h.eval_heads),
                                  lambda c, k, n: None, lambda done, total: None)
        return {"scores": done.scores, "diverged": done.diverged}

    def close(self, abort: str | None = None) -> None:
        """The devices hear the run is over (or why it ended); disconnect."""
        self.pool.close(abort)


class EdgeAggregator:
    """A site's edge aggregator (module docstring): `serve` until `stop` is set."""

    def __init__(self, site: str, upstream: str, broker: str, data_root: Path | None,
                 topic_root: str = "fedseq", up: Login | None = None,
                 down: Login | None = None):
        self.site, self.broker, self.data_root = site, broker, data_root
        self.topics = Topics(topic_root)
        self.down = down or Login()
        up = up or Login()
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.frames = FramePool(max_frame=MAX_TASK_BYTES, per_sender=MAX_TASK_BYTES)
        self.run: EdgeRun | None = None
        self.cannot: tuple[str, str] | None = None  # (run id, why this edge cannot follow it)
        self.said: bytes | None = None
        #: the last task answered, (run id, seq), with its answer: sent again if that task comes
        #: again (the coordinator asks again after its connection was down)
        self.answer: tuple[tuple[str, int], dict[str, Any], bytes] | None = None
        will = SiteStatus(site=site, state="offline").encode()
        self.link = Link(session_id(f"fedseq-edge-{site}"), upstream,
                         [self.topics.site(site, "run"), self.topics.site(site, "task")],
                         self._on_message, will=(self.topics.site(site, "status"), will),
                         username=up.username, password=up.password, tls=up.tls)
        self.link.on_connect(lambda: self.events.put(("connected", None)))

    # -- network thread --------------------------------------------------------------------
    def _on_message(self, topic: str, payload: bytes) -> None:
        ref = self.topics.parse(topic)
        if ref is None or ref.device != self.site:
            return
        try:
            if ref.kind == "site_run" and payload:
                self.events.put(("run", SiteRun.decode(payload)))
            elif ref.kind == "site_task":
                head, data = unpack_chunk(payload, SiteTaskHeader)
                if head.site != self.site:
                    raise ProtocolError(f"a task for site {printable(head.site, 64)}")
                frame = self.frames.add("coordinator", (head.run_id, head.seq), head, data)
                if frame is not None:
                    weights = decode_tensors(frame) if head.size else {}
                    self.events.put(("task", (head, weights)))
        except ProtocolError as exc:
            log.warning("an invalid message on %s: %s", topic, printable(exc, 300))

    # -- main thread -----------------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        """Connect upstream (retrying until it can), then follow the coordinator's runs."""
        self.link.start(attempts=None)
        try:
            while not stop.is_set():
                try:
                    what, body = self.events.get(timeout=1.0)
                except queue.Empty:
                    what, body = "", None
                if what == "run":
                    self._join(body)
                elif what == "task":
                    self._task(*body)
                elif what == "connected":
                    self.said = None  # say it again: the broker may have lost it
                self._say_status()
        finally:
            if self.run is not None:
                self.run.close("the site's edge aggregator stopped")
            with contextlib.suppress(Exception):
                self.link.publish(self.topics.site(self.site, "status"),
                                  SiteStatus(site=self.site, state="offline"), retain=True,
                                  wait=True, timeout=5.0)
            self.link.stop()

    def _say_status(self) -> None:
        """Publish this edge's presence and its devices online when they changed (before a
        data.placement = "device" run has its roster, with what they announced)."""
        status = SiteStatus(site=self.site, state="online")
        if self.cannot is not None:
            status.error_run_id, status.error = self.cannot
        if self.run is not None:
            status.devices = self.run.devices()
            if self.run.book is None:
                status.run_id = self.run.run_id
                clients, status.refused = self.run.announcements()
                status.clients = {d: [ClientSizes(**c.to_dict()) for c in cs]
                                  for d, cs in clients.items()}
        now = status.encode()
        if now != self.said and self.link.connected.is_set():
            self.link.publish(self.topics.site(self.site, "status"), now, retain=True)
            self.said = now

    def _join(self, rc: SiteRun) -> None:
        """A run from the coordinator: its config validated here (a model, dataset or plugin
        not installed or not allowed here is said in one line), the site's pool opened; the
        same run again with its roster (data.placement = "device") settles it."""
        run = self.run
        if run is not None and run.run_id == rc.run_id:
            if run.book is not None or rc.roster is None:
                return
        elif run is not None:  # another run: this one is over
            self.run = None
            run.close()
            run = None
        self.cannot = None
        try:
            cfg = self._config(rc)
            roster = None if rc.roster is None else [
                (e.device, ClientData.of(e)) for e in rc.roster]
            if run is not None:
                run.settle(cfg, roster)
            else:
                self.run = EdgeRun(self.site, cfg, rc.run_id, self.broker, self.down, roster)
        except ValidationError as exc:
            p = validation_problem(exc)
            self._cannot_follow(rc.run_id, f"{p.where}: {p.msg}")
        except FedseqError as exc:
            self._cannot_follow(rc.run_id, printable(exc, 500))
        else:
            if self.run is not None and self.run.book is not None:
                log.info("site %s joined run %s (%d clients on %s)", self.site, rc.run_id,
                         len(self.run.site.clients), ", ".join(self.run.site.devices))

    def _cannot_follow(self, run_id: str, why: str) -> None:
        """Say, here and in this edge's status, that it cannot follow run `run_id` and why."""
        log.error("site %s cannot follow run %s: %s", self.site, run_id, why)
        self.cannot = (run_id, printable(why, 1000))
        self._say_status()

    def _config(self, rc: SiteRun) -> ExperimentConfig:
        """The run's config as this host runs it: its plugins' versions checked, its data root
        this host's."""
        cfg = ExperimentConfig.model_validate(rc.config)
        why = REGISTRY.pin_problem(rc.plugins)
        if why is not None:
            raise ConfigError(why)
        if self.data_root is not None:
            cfg.data.root = self.data_root  # this host's files, never the coordinator's
        return cfg

    def _task(self, h: SiteTaskHeader, weights: Weights) -> None:
        """Run a task of the current run and answer it (a task of another run is ignored)."""
        run = self.run
        if run is None or h.run_id != run.run_id:
            log.warning("task %d of run %s ignored: this site follows %s", h.seq, h.run_id,
                        run.run_id if run else "no run")
            return
        if h.kind == "idle":
            run.close()
            self.run = None
            return
        if self.answer is not None and self.answer[0] == (h.run_id, h.seq):
            log.info("site %s: task %d again (the coordinator's connection was down): its "
                     "answer sent again", self.site, h.seq)
            self._answer(h, *self.answer[1:])
            return
        deltas: Weights = {}
        try:
            if h.kind == "train":
                fields, deltas = run.train(h, weights)
            else:
                fields = run.scores(h, weights)
        except FedseqError as exc:
            log.error("site %s: task %d (%s) failed: %s", self.site, h.seq, h.kind,
                      printable(exc, 500))
            fields = {"failures": {f"site {self.site}": printable(exc, 300)}}
        frame = encode_tensors(deltas)
        self.answer = ((h.run_id, h.seq), fields, frame)
        self._answer(h, fields, frame)

    def _answer(self, h: SiteTaskHeader, fields: dict[str, Any], frame: bytes) -> None:
        """Publish the answer to task `h`."""
        self.link.publish_frame(
            lambda i: self.topics.site(self.site, "result"),
            lambda **chunk: SiteResultHeader(run_id=h.run_id, site=self.site, seq=h.seq,
                                             **fields, **chunk),
            frame)


def serve_until_stopped(site: str, upstream: str, broker: str, data_root: Path | None,
                        topic_root: str, up: Login, down: Login) -> None:
    """fedseq-server edge: serve until SIGTERM (systemd's stop) or Ctrl-C."""
    import signal

    from fedseq.common.stopping import SignalStop

    stop = SignalStop()
    signal.signal(signal.SIGTERM, stop.handler)
    aggregator = EdgeAggregator(site, upstream, broker, data_root, topic_root, up, down)
    with contextlib.suppress(KeyboardInterrupt):
        aggregator.serve(stop.event)


__all__ = ["EdgeAggregator", "EdgeRun", "Login", "serve_until_stopped"]
