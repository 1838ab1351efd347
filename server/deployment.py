"""fedseq-server start: the same round loop as fedseq-sim, with devices over MQTT."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedseq.common.config import ExperimentConfig
from fedseq.common.errors import ConfigError
from fedseq.common.files import read_secret
from fedseq.common.protocol.link import TlsOptions
from fedseq.server.broker import EmbeddedBroker, one_run_login
from fedseq.server.checkpoint import load_checkpoint
from fedseq.server.coordinator import Coordinator, RunResult
from fedseq.server.experiment import load_experiment
from fedseq.server.mqtt import MqttPool
from fedseq.server.processes import die_with_parent, stop_children
from fedseq.server.records import RoundRecord
from fedseq.server.rehearsal import Rehearsal
from fedseq.server.rundir import RunDir, recorded

log = logging.getLogger(__name__)


def local_device_names(n: int) -> list[str]:
    return [f"local{i:02d}" for i in range(1, n + 1)]


def spawn_local_clients(n: int, url: str, cfg: ExperimentConfig, state_dir: Path,
                        threads: int | None = None, rehearsal: Rehearsal | None = None
                        ) -> list[subprocess.Popen]:
    """Start n fedseq-client daemons (local01..) as child processes. By default they share the
    cores (cores // n torch threads each): oversubscribed OpenMP threads spin and slow every
    process down several times over. In a rehearsal each runs in its device's network namespace,
    behind its link, under its CPU quota."""
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    env = dict(os.environ)
    env.setdefault("MALLOC_ARENA_MAX", "2")  # as the systemd unit: less memory per daemon
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    procs = []
    for name in local_device_names(n):
        cmd = [sys.executable, "-m", "fedseq.client.cli", "--device", name, "--broker", url,
               "--data-dir", str(cfg.data.root), "--state-dir", str(state_dir / name),
               "--topic-root", cfg.deploy.topic_root, "--torch-device", "cpu",
               "--log-level", "WARNING"]  # their progress is the coordinator's to show
        if threads:
            cmd += ["--threads", str(threads)]
        d = cfg.deploy
        if d.username:  # an authenticated embedded broker: local devices use the coordinator's login
            cmd += ["--username", d.username]
        for flag, value in (("--password-file", d.password_file), ("--ca-file", d.ca_file),
                            ("--cert-file", d.cert_file), ("--key-file", d.key_file)):
            if value is not None:
                cmd += [flag, str(value)]
        if not d.tls_verify_hostname:
            cmd.append("--no-verify-hostname")
        if rehearsal is not None:
            cmd = rehearsal.command(name, cmd)
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent))
        if rehearsal is not None:
            rehearsal.started(name, procs[-1].pid)
    return procs


def record_devices(run_dir: RunDir, pool: MqttPool) -> None:
    """devices.json: the stacks of the devices in the run (online at its start or holding
    clients); one that never described itself is listed with no entry."""
    devices = set(pool.devices) | set(pool.assignment)
    stacks = pool.inbox.device_stacks()
    run_dir.record_devices({d: stacks.get(d, []) for d in sorted(devices)})


@contextlib.contextmanager
def _opened(pool: MqttPool) -> Iterator[MqttPool]:
    """The pool connected, and closed at the end: a run that ends early tells its devices why
    (Control abort) before the error ends the process."""
    ended: str | None = None
    try:
        pool.start()
        yield pool
    except KeyboardInterrupt:
        ended = "the coordinator was stopped (Ctrl-C or SIGTERM); it may be resumed"
        raise
    except BaseException as exc:
        ended = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise
    finally:
        pool.close(abort=ended)


def _record_devices_finally(run_dir: RunDir, pool: MqttPool) -> None:
    try:
        record_devices(run_dir, pool)
    except OSError as exc:  # the run's own outcome matters more than this record
        log.warning("could not write %s/devices.json: %s", run_dir.path, exc)


def run_deployment(
    cfg: ExperimentConfig,
    out: Path | None,
    broker: str | None = None,
    local_clients: int = 0,
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
    ckpt = load_checkpoint(out) if mode == "resume" and out is not None else None
    if ckpt is not None and ckpt.pool.state is None:
        raise ConfigError(f"--resume {out}: that run was simulated; resume it with fedseq-sim")
    if rehearsal is not None and (broker or cfg.deploy.broker) is not None:
        raise ConfigError("a rehearsal (--link, --cpu-quota) runs its own embedded broker on "
                          "its bridge; leave out --broker and deploy.broker")
    # torn down in reverse: the devices' record, the pool (devices hear why a run ended), the
    # local devices, their state folder, the embedded broker, the rehearsal's login
    with contextlib.ExitStack() as stack:
        url = broker or cfg.deploy.broker
        cfg_login = cfg
        if url is None:
            # a rehearsal's bridge is reachable from this machine's namespaces only, and its
            # broker takes one login made for this run (unless a password file is given): the
            # daemons there run as root, and nobody else may publish to them
            host = rehearsal.broker_host if rehearsal is not None else cfg.deploy.host
            passwords = cfg.deploy.broker_password_file
            if rehearsal is not None and passwords is None:
                auth = stack.enter_context(tempfile.TemporaryDirectory(prefix="fedseq-rehearsal-"))
                passwords, secret = one_run_login(Path(auth))
                login = cfg.deploy.model_copy(update={"username": "rehearsal",
                                                      "password_file": secret})
                cfg_login = cfg.model_copy(update={"deploy": login})
            embedded = EmbeddedBroker(host, cfg.deploy.port, passwords, cfg.deploy.allow_anonymous)
            stack.callback(embedded.stop)
            embedded.start()
            url = embedded.url
            announce(f"embedded MQTT broker at {url} - start devices with: "
                     f"fedseq-client --device NAME --broker {url}")
        # the local devices' personal state lives in the run directory, so --resume keeps it
        state = Path(out) / "local-devices" if out is not None else None
        if local_clients and state is None:
            state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedseq-local-")))
        children: list[subprocess.Popen] = []
        stack.callback(stop_children, children)
        pool_state = ckpt.pool.state if ckpt is not None else None
        run_id = (pool_state["run_id"] if pool_state
                  else time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
        d = cfg_login.deploy  # the run's login (a rehearsal's own), never written to its config
        tls = TlsOptions(d.ca_file, d.cert_file, d.key_file, d.tls_verify_hostname)
        # The broker first: a wrong address or password is said before minutes of data loading.
        pool = stack.enter_context(_opened(MqttPool(
            cfg, url, run_id, d.username, read_secret(d.password_file, "deploy.password_file"),
            tls)))
        # the coordinator's global evaluation reads the test rows and nothing else
        exp = load_experiment(cfg, test_images_only=True)
        if local_clients:
            assert state is not None
            children += spawn_local_clients(local_clients, url, cfg_login, state, client_threads,
                                            rehearsal)
            if rehearsal is not None:
                announce(rehearsal.describe())
        devices = pool.wait_for_devices(max(cfg.deploy.min_devices, local_clients),
                                        cfg.deploy.wait_devices_s)
        announce(f"run {run_id}: {len(devices)} devices ({', '.join(devices)})"
                 + (f", resumed at round {ckpt.next_round}" if ckpt else ""))
        run_dir = None
        if out is not None:
            run_dir = RunDir(out, cfg, mode, ckpt.next_round if ckpt else 0,
                             {"run_id": run_id, **(info or {})})
            record_devices(run_dir, pool)
            stack.callback(_record_devices_finally, run_dir, pool)
        coordinator = Coordinator(cfg, exp.algorithm, exp.model, exp.data, pool, run_dir, on_round,
                                  on_progress, collect_threads=1)
        with recorded(run_dir):
            result = coordinator.run(ckpt)
    return result
