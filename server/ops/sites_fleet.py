"""fedseq-server start with [hierarchy]: a fleet of sites, each with its broker, its devices and
its edge aggregator (server/ops/edge.py), the coordinator on its own broker (EdgePool).

With `--local-devices N` the whole tree starts here, for a newcomer's first run and the tests:
the coordinator's broker as deploy.embedded_broker says, an embedded amqtt per site on loopback,
an edge aggregator per site (`fedseq-server edge`, a child process) and the sites' devices
(fedseq-client daemons, named as hierarchy.sites names them: the first N of them in site order),
each on its site's broker. In a rehearsal (`--link`, `--cpu-quota`; server/ops/rehearsal.py) the
tree is a network's: each site's broker listens in its gateway's namespace, its edge aggregator
runs there, behind the site's uplink (hierarchy.links), and its devices in their own namespaces
behind their links.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedseq.common.config import ExperimentConfig
from fedseq.common.data.placed import ClientData
from fedseq.common.errors import ConfigError
from fedseq.server.ops.broker import EmbeddedBroker, coordinator_login, one_run_login
from fedseq.server.ops.local_fleet import embedded_broker, login_options, spawn_local_devices
from fedseq.server.ops.rehearsal import Rehearsal
from fedseq.server.pools.mqtt.edges import EdgePool
from fedseq.server.pools.mqtt.mqtt_pool import fleet_run_id, restored_roster
from fedseq.server.pools.processes import die_with_parent, stop_children
from fedseq.server.rounds.checkpoint import Checkpoint
from fedseq.server.rounds.experiment import Experiment
from fedseq.server.rounds.rundir import RunDir
from fedseq.server.rounds.sites import site_tree


def edge_command(site: str, broker: str, upstream: str, data_root: Path,
                 topic_root: str = "fedseq") -> list[str]:
    """The command line of a local site's edge aggregator (its logins: add their options)."""
    return [sys.executable, "-c", "from fedseq.server.cli.launch import server_main; "
            "server_main()", "edge", "--site", site, "--broker", broker, "--upstream", upstream,
            "--data-dir", str(data_root), "--topic-root", topic_root, "--log-level", "WARNING"]


class SitesTransport:
    """The sites over MQTT (module docstring): a `Transport` (server/rounds/run.py)."""

    remote = True  # the coordinator scores the global model on the test rows itself
    collect_threads = 1

    def __init__(self, cfg: ExperimentConfig, out: Path | None, broker: str | None,
                 local_devices: int, announce: Callable[[str], None],
                 client_threads: int | None, rehearsal: Rehearsal | None):
        if not cfg.hierarchy.edge_aggregation:  # deployment.py rehearses it as a flat fleet
            raise ConfigError("hierarchy.edge_aggregation = false is the flat run timed over the "
                              "tree: simulate it, or rehearse it (--local-devices with --link); "
                              "a fleet of sites aggregates at its edges")
        self.cfg, self.out, self.url = cfg, out, broker or cfg.deploy.broker
        self.local_devices, self.client_threads = local_devices, client_threads
        self.announce, self.rehearsal = announce, rehearsal
        self.run_id = ""
        self.sites = site_tree(cfg)
        names = [d for s in self.sites for d in s.devices]
        if local_devices > len(names):
            raise ConfigError(f"--local-devices {local_devices}: hierarchy.sites names "
                              f"{len(names)} devices")

    def connect(self, stack: contextlib.ExitStack, ckpt: Checkpoint | None) -> None:
        """The coordinator's broker (embedded if none is given) and the pool's connection."""
        cfg = self.cfg
        if ckpt is not None and ckpt.pool.state is None:
            raise ConfigError("--resume: that run was simulated; resume it with fedseq-sim")
        login: dict[str, Any] = {}
        if self.url is None:
            self.url, login = embedded_broker(stack, cfg.deploy, self.rehearsal, self.announce,
                                              "run")
        deploy = cfg.deploy.model_copy(update=login) if login else cfg.deploy
        self.upstream_login = deploy  # a rehearsal's edges log in as the coordinator does
        self.run_id = fleet_run_id(ckpt.pool if ckpt is not None else None)
        self.pool = stack.enter_context(EdgePool(cfg, self.url, self.run_id,
                                                 *coordinator_login(deploy)))
        if self.local_devices:
            self._local_sites(stack)

    def _local_sites(self, stack: contextlib.ExitStack) -> None:
        """A broker, an edge aggregator and the devices of every site, here (module docstring)."""
        assert self.url is not None
        cfg = self.cfg
        state = (Path(self.out) / "local-devices" if self.out is not None else
                 Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedseq-local-"))))
        names = [d for s in self.sites for d in s.devices][:self.local_devices]
        threads = self.client_threads or max(1, (os.cpu_count() or 1) // len(names))
        mine = {s.name: [d for d in s.devices if d in names] for s in self.sites}
        rh = self.rehearsal
        # the sites' brokers are embedded amqtt, without TLS; in a rehearsal they take one login
        # made for this run, else any
        site_login: dict[str, Any] = {**dict.fromkeys(
            ("username", "password_file", "ca_file", "cert_file", "key_file")),
            "tls_verify_hostname": True}
        if rh is not None:
            auth = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedseq-sites-")))
            passwords, secret = one_run_login(auth)
            site_login.update(username="rehearsal", password_file=secret)
        device_cfg = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update=site_login)})
        # upstream, the edges log in as the coordinator does (Mosquitto's login, a rehearsal's)
        logins = [*login_options(self.upstream_login, "upstream-"),
                  *login_options(device_cfg.deploy)]
        urls = {name: stack.enter_context(
            EmbeddedBroker(cfg.deploy.host, 0, None, True) if rh is None else
            EmbeddedBroker(rh.site_host(name), 1883, passwords, netns=rh.site_ns(name))).url
            for name, devices in mine.items() if devices}
        local: list[subprocess.Popen] = []
        stack.callback(stop_children, local)  # before the sites' brokers close
        for site, url in urls.items():
            cmd = [*edge_command(site, url, self.url, cfg.data.root, cfg.deploy.topic_root),
                   *logins]
            local.append(subprocess.Popen(cmd if rh is None else rh.site_command(site, cmd),
                                          preexec_fn=die_with_parent))
            local += spawn_local_devices(len(mine[site]), url, device_cfg, state, threads,
                                         rehearsal=rh, names=mine[site])
            self.announce(f"site {site}: broker {url}, its edge aggregator and "
                          f"{len(mine[site])} devices ({', '.join(mine[site])})")
        if rh is not None:
            self.announce(rh.describe())

    def announced(self, ckpt: Checkpoint | None) -> list[tuple[str, ClientData]]:
        """data.placement = "device": the clients the sites' devices announced, numbered as a
        flat fleet's (a resumed run: its checkpoint's); each site then holds its devices'."""
        if ckpt is not None:
            found = restored_roster(ckpt.pool)
        else:
            d = self.cfg.deploy
            found = self.pool.gather_clients(max(d.min_devices, self.local_devices),
                                             d.wait_devices_s)
            devices = sorted({dev for dev, _ in found})
            self.announce(f"run {self.run_id}: {len(found)} clients on {len(devices)} devices "
                          f"({', '.join(devices)})")
        self.cfg = self.cfg.with_clients(len(found))
        self.pool.use_roster(self.cfg, found)
        return found

    def open_pool(self, stack: contextlib.ExitStack, exp: Experiment, ckpt: Checkpoint | None
                  ) -> EdgePool:
        """The sites' edge aggregators online, with deploy.min_devices devices between them."""
        d = self.cfg.deploy
        devices = self.pool.wait_for_sites(max(d.min_devices, self.local_devices),
                                           d.wait_devices_s)
        self.announce(f"run {self.run_id}: {len(self.pool.online())} sites, {len(devices)} "
                      f"devices ({', '.join(devices)})"
                      + (f", resumed at round {ckpt.next_round}" if ckpt else ""))
        return self.pool

    def info(self) -> dict[str, Any]:
        """status.json's: the run id, the coordinator's broker, the sites."""
        return {"run_id": self.run_id, "broker": self.url,
                "sites": {s.name: list(s.devices) for s in self.sites}}

    def started(self, stack: contextlib.ExitStack, run_dir: RunDir) -> None:
        """Nothing beside the run directory: the devices' stacks are their sites' to record."""


__all__ = ["SitesTransport", "edge_command"]
