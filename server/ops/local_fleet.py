"""What `fedseq-server start` and `campaign` start on this machine: the embedded broker (amqtt,
or Mosquitto from the checkout's broker.conf and ACL) and local fedseq-client daemons
(`--local-devices`), for a flat fleet (deployment.py) and a fleet of sites (sites_fleet.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedseq.common.config import DeployConfig, ExperimentConfig
from fedseq.common.errors import ConfigError
from fedseq.server.ops.broker import (
    GUARD_LOGIN,
    EmbeddedBroker,
    LocalMosquitto,
    one_run_login,
)
from fedseq.server.ops.rehearsal import Rehearsal
from fedseq.server.pools.processes import die_with_parent


def local_device_names(n: int) -> list[str]:
    """The names of `n` local devices: local01, local02, ..."""
    return [f"local{i:02d}" for i in range(1, n + 1)]


def login_options(d: DeployConfig, prefix: str = "") -> list[str]:
    """The command-line options logging a process started here in as `d` says: its user name,
    password file and TLS files (--PREFIXusername, --PREFIXpassword-file, ...), and
    --no-verify-hostname where `d` turns that check off."""
    out = ["--" + prefix + "username", d.username] if d.username else []
    for flag, value in (("password-file", d.password_file), ("ca-file", d.ca_file),
                        ("cert-file", d.cert_file), ("key-file", d.key_file)):
        if value is not None:
            out += ["--" + prefix + flag, str(value)]
    if not d.tls_verify_hostname:
        out.append("--no-verify-hostname")
    return out


def spawn_local_devices(n: int, url: str, cfg: ExperimentConfig, state_dir: Path,
                        threads: int | None = None, rehearsal: Rehearsal | None = None,
                        names: list[str] | None = None) -> list[subprocess.Popen]:
    """Start n fedseq-client daemons (local01..; `names`: those of the n) as child processes.
    By default they share the cores (cores // n torch threads each): oversubscribed OpenMP
    threads spin and slow every process down several times over. In a rehearsal each runs in its
    device's network namespace, behind its link, under its CPU quota (by default the n are the
    rehearsal's first n devices)."""
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    env = dict(os.environ)
    env.setdefault("MALLOC_ARENA_MAX", "2")  # as the systemd unit: less memory per daemon
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    procs = []
    if names is None:
        names = rehearsal.devices[:n] if rehearsal is not None else local_device_names(n)
    for name in names:
        # data.placement = "device": each local device's own folder under data.devices_root
        data = cfg.data.devices_root / name if cfg.data.devices_root is not None else cfg.data.root
        cmd = [sys.executable, "-m", "fedseq.client.cli", "--device", name, "--broker", url,
               "--data-dir", str(data), "--state-dir", str(state_dir / name),
               "--topic-root", cfg.deploy.topic_root, "--torch-device", "cpu",
               "--log-level", "WARNING"]  # their progress is the coordinator's to show
        if threads:
            cmd += ["--threads", str(threads)]
        # an authenticated embedded broker: local devices use the coordinator's login
        cmd += login_options(cfg.deploy)
        for plugin in cfg.plugins():  # this machine's own environment, the operator's own run
            cmd += ["--allow-plugin", plugin]
        if rehearsal is not None:
            cmd = rehearsal.command(name, cmd)
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent))
        if rehearsal is not None:
            rehearsal.started(name, procs[-1].pid)
    return procs


def embedded_broker(stack: contextlib.ExitStack, d: DeployConfig, rehearsal: Rehearsal | None,
                    announce: Callable[[str], None], whose: str, local_devices: int = 0
                    ) -> tuple[str, dict[str, Any]]:
    """The broker started here for a run or a campaign (`whose`), until `stack` closes: amqtt in
    this process, or Mosquitto from the checkout's broker.conf and ACL (deploy.embedded_broker),
    on `d.host` or a rehearsal's bridge. Returns its URL and the deploy.* login the coordinator
    and the local devices use there: Mosquitto's one login, or in a rehearsal a login made for it
    unless a password file is given; empty where none is needed."""
    # a rehearsal's bridge is reachable from this machine's namespaces only, and its broker
    # takes one login made for this run (unless a password file is given): the daemons there
    # run as root, and nobody else may publish to them
    host = rehearsal.broker_host if rehearsal is not None else d.host
    if d.embedded_broker == "mosquitto":
        if d.broker_password_file is not None:
            raise ConfigError(f"deploy.broker_password_file is the embedded amqtt's; the {whose}'s "
                              "Mosquitto makes its own login (devices elsewhere: --broker)")
        home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedseq-mosquitto-")))
        broker = stack.enter_context(LocalMosquitto(host, d.port, home))
        announce(f"Mosquitto for this {whose} at {broker.url} (the project's broker.conf and ACL; "
                 "one login, for the coordinator and its local devices"
                 + ("; the flood guard on" if broker.guard_secret else "") + ")")
        login: dict[str, Any] = {"username": broker.user, "password_file": broker.secret}
        if broker.guard_secret is not None:  # the flood guard wherever the broker can have it
            login.update(guard_username=GUARD_LOGIN, guard_password_file=broker.guard_secret)
        return broker.url, login
    passwords, login = d.broker_password_file, {}
    if rehearsal is not None and passwords is None:
        auth = stack.enter_context(tempfile.TemporaryDirectory(prefix="fedseq-rehearsal-"))
        passwords, secret = one_run_login(Path(auth))
        login = {"username": "rehearsal", "password_file": secret}
    url = stack.enter_context(EmbeddedBroker(host, d.port, passwords, d.allow_anonymous)).url
    announce(f"embedded MQTT broker at {url}" + (
        f" - {local_devices} local devices start here" if local_devices else
        f" - start devices with: fedseq-client --device NAME --broker {url}"))
    return url, login


__all__ = ["embedded_broker", "local_device_names", "spawn_local_devices"]
