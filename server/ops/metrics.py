"""Prometheus metrics of the coordinator (`fedseq-server start|campaign --metrics-port PORT`),
with the prometheus_client library: the run and its round, its accuracies, the devices that
reported or failed (by site with [hierarchy]), updates counted and refused, bytes, seconds per
round, energy, and a campaign's progress. Served on 127.0.0.1 unless --metrics-host says
otherwise; deploy/prometheus/ holds the scrape config and deploy/grafana/ a dashboard of these
series."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server

from fedseq.common.config import ExperimentConfig
from fedseq.server.rounds.records import RoundRecord

#: every series this module exports (the dashboard's panels use these names; a test checks it)
#: devices whose last status the online/offline counts remember (the newest heard)
MAX_DEVICES = 4096
NAMES = ("fedseq_run", "fedseq_round", "fedseq_rounds", "fedseq_accuracy", "fedseq_devices",
         "fedseq_updates", "fedseq_updates_refused", "fedseq_bytes", "fedseq_round_seconds",
         "fedseq_energy_joules", "fedseq_campaign_run", "fedseq_campaign_runs",
         "fedseq_campaign_finished", "fedseq_campaign_failed", "fedseq_campaign_left_seconds",
         "fedseq_privacy_epsilon", "fedseq_site_devices", "fedseq_site_partial")


class Metrics:
    """The coordinator's series in a registry of their own, served over HTTP on host:port
    (port 0: a free one, then `port` says which)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        r = self.registry = CollectorRegistry()
        self.run = Info("fedseq_run", "The run going on: its folder, algorithm, dataset, model",
                        registry=r)
        self.round = Gauge("fedseq_round", "The last complete round of the run", registry=r)
        self.rounds = Gauge("fedseq_rounds", "The run's rounds", registry=r)
        self.accuracy = Gauge("fedseq_accuracy", "Accuracy (0-1) at the last evaluated round: "
                              "global, personal, local", ["kind"], registry=r)
        self.devices = Gauge("fedseq_devices", "Devices by state: reported (an update counted in "
                             "the last round), failed (in it); online, offline (their status "
                             "messages: silent 3 heartbeats is offline; a campaign watches them)",
                             ["state"], registry=r)
        self.updates = Counter("fedseq_updates", "Updates counted into an aggregate", registry=r)
        self.refused = Counter("fedseq_updates_refused", "Updates refused by the round contract",
                               registry=r)
        self.bytes = Counter("fedseq_bytes", "Bytes of the rounds: down and up (the blocks and "
                             "updates that counted), wire_out and wire_in (what the connection "
                             "published and received)", ["direction"], registry=r)
        self.seconds = Gauge("fedseq_round_seconds", "Seconds the last round took", registry=r)
        self.energy = Counter("fedseq_energy_joules", "Joules the devices measured", registry=r)
        self.site_devices = Gauge("fedseq_site_devices", "[hierarchy]: each site's devices by "
                                  "state in the last round: reported (an update of theirs "
                                  "counted), failed (a device failure in the round)",
                                  ["site", "state"], registry=r)
        self.site_partial = Gauge("fedseq_site_partial", "[hierarchy]: 1 if the site's partial "
                                  "counted in the last round it had clients in, 0 if it was "
                                  "refused or never came", ["site"], registry=r)
        self.site_of: dict[str, str] = {}  # [hierarchy]: device -> its site
        self.epsilon = Gauge("fedseq_privacy_epsilon", "[privacy]: epsilon spent so far (at "
                             "privacy.delta)", registry=r)
        self.campaign_run = Gauge("fedseq_campaign_run", "The campaign's run going on, from 1",
                                  registry=r)
        self.campaign_runs = Gauge("fedseq_campaign_runs", "The campaign's runs", registry=r)
        self.campaign_finished = Gauge("fedseq_campaign_finished", "Runs finished", registry=r)
        self.campaign_failed = Gauge("fedseq_campaign_failed", "Runs failed", registry=r)
        self.campaign_left = Gauge("fedseq_campaign_left_seconds", "Estimated seconds left in "
                                   "the campaign (rounds left x measured seconds per round)",
                                   registry=r)
        self._heard: dict[str, tuple[float, str, float]] = {}  # device -> when, state, heartbeat_s
        self.server, self.thread = start_http_server(port, addr=host, registry=r)
        self.host, self.port = host, self.server.server_port

    def close(self) -> None:
        """Stop serving the metrics."""
        self.server.shutdown()
        self.server.server_close()

    def run_started(self, cfg: ExperimentConfig, out: str = "") -> None:
        """A run started: its out folder, algorithm, dataset, model and rounds; no round yet."""
        self.run.info({"out": out, "algorithm": cfg.algorithm.name,
                       "dataset": cfg.data.dataset, "model": cfg.model.name})
        self.rounds.set(cfg.rounds)
        self.round.set(-1)
        self.site_of = cfg.hierarchy.site_of()
        self.site_devices.clear()
        self.site_partial.clear()

    def row(self, row: RoundRecord) -> None:
        """One round's row (train, evaluate or finetune)."""
        if row.phase == "train":
            self.round.set(row.round)
            if row.seconds is not None:
                self.seconds.set(row.seconds)
            self.updates.inc(len(row.reported))
            self.refused.inc(len(row.rejected))
            devices = set((row.reporters or {}).values())
            self.devices.labels("reported").set(len(devices))
            self.devices.labels("failed").set(len(row.device_failures or {}))
            if self.site_of:
                self._sites(row)
        for kind, value in (("global", row.global_acc), ("personal", row.personal_acc),
                            ("local", row.local_acc)):
            if value is not None:
                self.accuracy.labels(kind).set(value)
        for direction, value in (("down", row.bytes_down), ("up", row.bytes_up),
                                 ("wire_out", row.wire_bytes_out), ("wire_in", row.wire_bytes_in)):
            if value:
                self.bytes.labels(direction).inc(value)
        if row.energy_j:
            self.energy.inc(row.energy_j)
        if row.epsilon is not None:
            self.epsilon.set(row.epsilon)

    def _sites(self, row: RoundRecord) -> None:
        """[hierarchy]: a train row's devices by site, and which sites' partials counted (a
        site's own failure is its row entry `site NAME`)."""
        sites = sorted(set(self.site_of.values()))
        reported: dict[str, set[str]] = {s: set() for s in sites}
        failed: dict[str, set[str]] = {s: set() for s in sites}
        for device in (row.reporters or {}).values():
            if device in self.site_of:
                reported[self.site_of[device]].add(device)
        for name in row.device_failures or {}:
            if name in self.site_of:
                failed[self.site_of[name]].add(name)
        for s in sites:
            self.site_devices.labels(s, "reported").set(len(reported[s]))
            self.site_devices.labels(s, "failed").set(len(failed[s]))
            if reported[s]:
                self.site_partial.labels(s).set(1)
            elif f"site {s}" in (row.device_failures or {}):
                self.site_partial.labels(s).set(0)

    def device_status(self, status: Any) -> None:
        """A device's DeviceStatus arrived: the online/offline counts from every device's last
        one (online, and heard within 3 heartbeats)."""
        now = time.monotonic()
        heard = self._heard
        heard.pop(status.device, None)  # to the end: the dict's order is the order heard
        heard[status.device] = (now, status.state, status.heartbeat_s)
        if len(heard) > MAX_DEVICES:  # names an open broker lets anyone invent: the oldest goes
            del heard[next(iter(heard))]
        online = sum(state == "online" and now - at <= 3 * beat for at, state, beat in heard.values())
        self.devices.labels("online").set(online)
        self.devices.labels("offline").set(len(heard) - online)

    def campaign(self, status: Any) -> None:
        """A campaign.CampaignStatus."""
        self.campaign_run.set(status.run)
        self.campaign_runs.set(status.runs)
        self.campaign_finished.set(status.finished)
        self.campaign_failed.set(status.failed)
        if status.left_s is not None:
            self.campaign_left.set(status.left_s)
