"""fedseq-server start: the same round loop as fedseq-sim, with devices over MQTT."""

from __future__ import annotations

import contextlib
import functools
import logging
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedseq.common.config import ExperimentConfig, FleetConfig
from fedseq.common.data.placed import ClientData
from fedseq.common.errors import ConfigError
from fedseq.server.ops.broker import coordinator_login
from fedseq.server.ops.local_fleet import embedded_broker, spawn_local_devices
from fedseq.server.ops.rehearsal import Rehearsal
from fedseq.server.pools.mqtt import MqttPool
from fedseq.server.pools.mqtt.arrivals import MqttArrivals
from fedseq.server.pools.mqtt.mqtt_pool import fleet_run_id, restored_roster
from fedseq.server.pools.processes import stop_children
from fedseq.server.rounds.buffered import BufferedAsync
from fedseq.server.rounds.checkpoint import Checkpoint
from fedseq.server.rounds.coordinator import RunResult
from fedseq.server.rounds.driver import DriverFactory
from fedseq.server.rounds.experiment import Experiment
from fedseq.server.rounds.records import RoundRecord
from fedseq.server.rounds.run import Transport, run_experiment
from fedseq.server.rounds.rundir import RunDir

log = logging.getLogger(__name__)


def record_devices(run_dir: RunDir, pool: MqttPool) -> None:
    """devices.json: the stacks of the devices in the run (online at its start or holding
    clients); one that never described itself is listed with no entry."""
    devices = set(pool.devices) | set(pool.assignment)
    stacks = pool.inbox.device_stacks()
    run_dir.record_devices({d: stacks.get(d, []) for d in sorted(devices)})


def _record_devices_finally(run_dir: RunDir, pool: MqttPool) -> None:
    try:
        record_devices(run_dir, pool)
    except OSError as exc:  # the run's own outcome matters more than this record
        log.warning("could not write %s/devices.json: %s", run_dir.path, exc)


def run_deployment(
    cfg: ExperimentConfig,
    out: Path | None,
    broker: str | None = None,
    local_devices: int = 0,
    on_round: Callable[[RoundRecord], None] | None = None,
    announce: Callable[[str], None] = print,
    client_threads: int | None = None,
    mode: str = "new",
    info: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    rehearsal: Rehearsal | None = None,
) -> RunResult:
    """mode "resume" continues `out` after its checkpoint's last complete round, under the same
    run id (devices keep their personal state) and the same assignment."""
    _own_broker(rehearsal, broker or cfg.deploy.broker)
    if cfg.fleet:
        announce("note: [fleet] models a simulation's time; a deployment's devices are real, "
                 "so it is ignored here")
        cfg = cfg.model_copy(update={"fleet": FleetConfig()})
    fleet: Transport
    if cfg.hierarchy and (cfg.hierarchy.edge_aggregation or rehearsal is None):
        # a fleet of sites: an edge aggregator per site (sites_fleet.py); without edge
        # aggregation a rehearsal's sites are its network's shape, the run a flat one
        from fedseq.server.ops.sites_fleet import SitesTransport

        fleet = SitesTransport(cfg, out, broker, local_devices, announce, client_threads,
                               rehearsal)
    else:
        fleet = MqttTransport(cfg, out, broker, local_devices, announce, client_threads,
                              rehearsal)
    driver: DriverFactory | None = None
    if cfg.train.mode == "async":  # the devices' own pace orders the arrivals
        driver = functools.partial(BufferedAsync, arrivals=MqttArrivals)
    return run_experiment(cfg, out, fleet, mode, info, on_round, on_progress, driver=driver)


def _own_broker(rehearsal: Rehearsal | None, broker: str | None) -> None:
    """A rehearsal runs its own broker: refuse a given one in one line."""
    if rehearsal is not None and broker is not None:
        raise ConfigError("a rehearsal (--link, --cpu-quota) runs its own embedded broker on "
                          "its bridge; leave out --broker and deploy.broker")


class MqttTransport(Transport):
    """The devices over MQTT (MqttPool), through `broker` or an embedded one started here, with
    `local_devices` fedseq-client daemons started here (in a rehearsal's namespaces). Set up and
    torn down in reverse by run_experiment's stack: the embedded broker, the rehearsal's login,
    the local devices' state folder and the devices, the pool (devices hear why a run ended), the
    devices' record."""

    remote = True  # the coordinator's global evaluation reads the test rows and nothing else
    collect_threads = 1

    def __init__(self, cfg: ExperimentConfig, out: Path | None, broker: str | None,
                 local_devices: int, announce: Callable[[str], None],
                 client_threads: int | None, rehearsal: Rehearsal | None):
        self.cfg, self.out, self.url = cfg, out, broker or cfg.deploy.broker
        self.local_devices, self.client_threads = local_devices, client_threads
        self.announce, self.rehearsal = announce, rehearsal
        self.cfg_login = cfg  # the run's login (a rehearsal's own), never written to its config
        self.run_id = ""
        self.online = False  # the devices were started and awaited

    def connect(self, stack: contextlib.ExitStack, ckpt: Checkpoint | None) -> None:
        """The broker (embedded if none is given) and the pool's connection, before minutes of
        data loading: a wrong address or password is said first."""
        cfg, rehearsal = self.cfg, self.rehearsal
        if ckpt is not None and ckpt.pool.state is None:
            raise ConfigError(f"--resume {self.out}: that run was simulated; resume it with "
                              "fedseq-sim")
        if self.url is None:
            self.url, login = embedded_broker(stack, cfg.deploy, rehearsal, self.announce, "run",
                                              self.local_devices)
            if login:
                self.cfg_login = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(
                    update=login)})
        # the local devices' personal state lives in the run directory, so --resume keeps it
        self.state = Path(self.out) / "local-devices" if self.out is not None else None
        if self.local_devices and self.state is None:
            self.state = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="fedseq-local-")))
        self.children: list[subprocess.Popen] = []
        stack.callback(stop_children, self.children)
        self.run_id = fleet_run_id(ckpt.pool if ckpt is not None else None)
        # connected now; on the way out the devices hear why the run ended (MqttPool.__exit__)
        self.pool = stack.enter_context(MqttPool(
            cfg, self.url, self.run_id, *coordinator_login(self.cfg_login.deploy)))

    def announced(self, ckpt: Checkpoint | None) -> list[tuple[str, ClientData]]:
        """data.placement = "device": the devices online, then the clients they announce (a
        resumed run: its checkpoint's, the devices coming online in `open_pool`)."""
        if ckpt is not None:
            found = restored_roster(ckpt.pool)
        else:
            self._devices_online(None)
            found = self.pool.gather_clients(self.cfg.deploy.wait_devices_s)
            self.announce(f"run {self.run_id}: {len(found)} clients on {len(self.pool.devices)} "
                          f"devices ({', '.join(self.pool.devices)})")
        self.cfg = self.pool.cfg = self.cfg.with_clients(len(found))
        self.pool.roster = found
        return found

    def _devices_online(self, ckpt: Checkpoint | None) -> None:
        """The local devices started, and the fleet's devices online (once)."""
        if self.online:
            return
        self.online = True
        if self.local_devices:
            assert self.state is not None and self.url is not None
            self.children += spawn_local_devices(self.local_devices, self.url, self.cfg_login,
                                                 self.state, self.client_threads, self.rehearsal)
            if self.rehearsal is not None:
                self.announce(self.rehearsal.describe())
        devices = self.pool.wait_for_devices(max(self.cfg.deploy.min_devices, self.local_devices),
                                             self.cfg.deploy.wait_devices_s)
        self.announce(f"run {self.run_id}: {len(devices)} devices ({', '.join(devices)})"
                      + (f", resumed at round {ckpt.next_round}" if ckpt else ""))

    def open_pool(self, stack: contextlib.ExitStack, exp: Experiment, ckpt: Checkpoint | None
                  ) -> MqttPool:
        """The local devices started, and the fleet's devices online."""
        self._devices_online(ckpt)
        return self.pool

    def info(self) -> dict[str, Any]:
        """status.json's: the run id, and the broker it ran on (`fedseq-server status --config
        RUN_DIR` finds it there)."""
        return {"run_id": self.run_id, "broker": self.url}

    def started(self, stack: contextlib.ExitStack, run_dir: RunDir) -> None:
        """Record the fleet in the run directory (devices.json), now and again when the run ends."""
        record_devices(run_dir, self.pool)
        stack.callback(_record_devices_finally, run_dir, self.pool)


@contextlib.contextmanager
def standing_fleet(cfg: ExperimentConfig, out: Path, broker: str | None, local_devices: int,
                   client_threads: int | None, announce: Callable[[str], None],
                   rehearsal: Rehearsal | None = None
                   ) -> Iterator[tuple[str, dict[str, Any], list[subprocess.Popen]]]:
    """A campaign's fleet, up across its runs: the broker (`broker`, else an embedded one as
    `cfg.deploy` says, on the rehearsal's bridge in a rehearsal) and `local_devices`
    fedseq-client daemons (in the rehearsal's namespaces), whose personal state lives in
    OUT/local-devices. Yields the broker's URL, the deploy.* login every run uses there (the
    run's Mosquitto, or a rehearsal's amqtt, makes one) and the daemons."""
    _own_broker(rehearsal, broker or cfg.deploy.broker)
    with contextlib.ExitStack() as stack:
        url, login = broker or cfg.deploy.broker, dict[str, Any]()
        if url is None:
            url, login = embedded_broker(stack, cfg.deploy, rehearsal, announce, "campaign",
                                         local_devices)
        children: list[subprocess.Popen] = []
        stack.callback(stop_children, children)
        if local_devices:
            with_login = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update=login)})
            children += spawn_local_devices(local_devices, url, with_login,
                                            Path(out) / "local-devices", client_threads, rehearsal)
            if rehearsal is not None:
                announce(rehearsal.describe())
        yield url, login, children
