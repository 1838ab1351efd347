"""A testbed rehearsed on one machine: every local device daemon in its own network namespace,
behind an emulated link (Linux tc) and optionally a CPU quota (cgroup v1 `cpu`), so round times,
transfer times and deadlines reflect a Wi-Fi or LTE fleet before the devices are booked.

Layout: a bridge with the coordinator's side at 10.77.0.1/24; device i lives in namespace
`<prefix>-<i>` with 10.77.0.(i+1) on a veth pair whose host end is in the bridge. The download
direction (broker to device) is shaped on the host end, the upload direction inside the namespace.
With the kernel's `netem` qdisc a link has rate, delay, jitter and loss; a kernel without it
(CONFIG_NET_SCH_NETEM unset, as on the VM this was developed on) gets the rate alone, from `tbf`,
and the rehearsal says in one line that delay, jitter and loss are not emulated. Needs root.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from fedseq.common.errors import ConfigError, TransportError
from fedseq.server.rounds.links import LinkProfile

log = logging.getLogger(__name__)

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
#: one file per live rehearsal (its id, holding the pid that made it): a rehearsal whose process
#: died without cleaning up (kill -9) is removed by the next one
STATE = Path("/run/fedseq-rehearsal")
T = TypeVar("T")


def per_device(items: list[str], devices: list[str], parse: Callable[[str], T],
               what: str) -> dict[str, T]:
    """`VALUE` for every device and `DEVICE=VALUE` for one, later items winning."""
    out: dict[str, T] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if sep and name in devices:
            out[name] = parse(value)
        elif sep and not item.startswith("custom:") and name not in devices:
            raise ConfigError(f"{what} {item!r}: no local device {name!r} (they are "
                              f"{devices[0]}..{devices[-1]})")
        else:
            parsed = parse(item)
            out.update({d: parsed for d in devices})
    return out


def parse_quota(text: str) -> float:
    """--cpu-quota's value: cores per device, 0.01 to 64 (a ConfigError in one line otherwise)."""
    try:
        cores = float(text)
    except ValueError:
        raise ConfigError(f"--cpu-quota {text!r}: give cores per device, e.g. 0.5") from None
    if not 0.01 <= cores <= 64:
        raise ConfigError(f"--cpu-quota {text!r}: between 0.01 and 64 cores")
    return cores


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise TransportError(f"rehearsal: `{' '.join(cmd)}` failed: {r.stderr.strip()}")


class Rehearsal:
    """Namespaces, links and CPU quotas for `devices` (a context manager that removes them all)."""

    broker_host = "10.77.0.1"

    def __init__(self, devices: list[str], links: dict[str, LinkProfile],
                 quotas: dict[str, float] | None = None):
        if os.geteuid() != 0:
            raise TransportError("--link and --cpu-quota need root (network namespaces, tc, "
                                 "cgroups): run fedseq-server with sudo, or leave them out")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise TransportError(f"--link needs the `{tool}` command (apt-get install iproute2)")
        if quotas and not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
            raise TransportError(f"--cpu-quota needs the cgroup v1 cpu controller at {CGROUP_CPU}")
        if len(devices) > 250:
            raise ConfigError("a rehearsal holds at most 250 devices")
        self.devices = devices
        self.links = links
        self.quotas = quotas or {}
        self.id = uuid.uuid4().hex[:6]
        self.bridge = f"fsq{self.id}"
        self.netem = True
        self._made: list[tuple[str, ...]] = []

    def ns(self, device: str) -> str:
        """The network namespace of a device of this rehearsal."""
        return f"fsq{self.id}-{self.devices.index(device) + 1}"

    def __enter__(self) -> Rehearsal:
        sweep_stale()
        STATE.mkdir(parents=True, exist_ok=True)
        (STATE / self.id).write_text(f"{os.getpid()}\n")
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("ip", "link", "del", self.bridge))
        _run("ip", "addr", "add", f"{self.broker_host}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, device in enumerate(self.devices, start=1):
            ns, host, dev = self.ns(device), f"fsq{self.id}h{i}", f"fsq{self.id}d{i}"
            _run("ip", "netns", "add", ns)
            self._made.append(("ip", "netns", "del", ns))
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", dev)
            self._made.append(("ip", "link", "del", host))
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "link", "set", host, "master", self.bridge)
            _run("ip", "link", "set", host, "up")
            _run("ip", "-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            link = self.links.get(device)
            if link is not None:
                self._shape([], host, link.down_mbit, link)
                self._shape(["ip", "netns", "exec", ns], dev, link.up_mbit, link)
            if device in self.quotas:
                group = CGROUP_CPU / f"fedseq-{ns}"
                group.mkdir(exist_ok=True)
                self._made.append(("rmdir", str(group)))
                (group / "cpu.cfs_period_us").write_text("100000\n")
                (group / "cpu.cfs_quota_us").write_text(f"{int(self.quotas[device] * 100000)}\n")
        if not self.netem and any(lk.delay_ms or lk.jitter_ms or lk.loss_pct
                                  for lk in self.links.values()):
            log.warning("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): the links get "
                        "their rates (tbf) but no delay, jitter or loss")

    def _shape(self, inside: list[str], dev: str, mbit: float, link: LinkProfile) -> None:
        """Egress shaping on `dev`: netem with rate, delay, jitter and loss; else tbf's rate."""
        if self.netem:
            cmd = [*inside, "tc", "qdisc", "add", "dev", dev, "root", "netem", "rate",
                   f"{mbit}mbit", "limit", "10000"]
            if link.delay_ms:
                cmd += ["delay", f"{link.delay_ms}ms"]
                if link.jitter_ms:
                    cmd += [f"{link.jitter_ms}ms", "distribution", "normal"]
            if link.loss_pct:
                cmd += ["loss", f"{link.loss_pct}%"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                return
            if "unknown" not in r.stderr.lower():
                raise TransportError(f"rehearsal: `{' '.join(cmd)}` failed: {r.stderr.strip()}")
            self.netem = False
        # tbf: a burst of 64 KiB (a GSO segment), a queue of at most 500 ms at this rate
        _run(*inside, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
             "burst", "64kb", "latency", "500ms")

    def command(self, device: str, cmd: list[str]) -> list[str]:
        """`cmd` run inside `device`'s namespace."""
        return ["ip", "netns", "exec", self.ns(device), *cmd]

    def started(self, device: str, pid: int) -> None:
        """Put a started daemon under its device's CPU quota."""
        if device in self.quotas:
            (CGROUP_CPU / f"fedseq-{self.ns(device)}" / "cgroup.procs").write_text(f"{pid}\n")

    def cut(self, device: str, down: bool = True) -> None:
        """Take `device`'s link down (or up again): the fault a walk out of Wi-Fi range makes."""
        host = f"fsq{self.id}h{self.devices.index(device) + 1}"
        _run("ip", "link", "set", host, "down" if down else "up")

    def describe(self) -> str:
        """One line: how links are shaped here (netem, or tbf's rate alone) and each device's link
        and CPU quota."""
        kinds = "netem" if self.netem else "tbf rate only (no netem in this kernel)"
        parts = [f"{d}: {self.links[d].describe() if d in self.links else 'unshaped'}"
                 + (f", {self.quotas[d]:g} cores" if d in self.quotas else "")
                 for d in self.devices]
        return f"rehearsal ({kinds}): " + "; ".join(parts)

    def __exit__(self, *exc: object) -> None:
        for cmd in reversed(self._made):
            with contextlib.suppress(OSError):
                subprocess.run(cmd, capture_output=True)
        self._made.clear()
        with contextlib.suppress(OSError):
            (STATE / self.id).unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove the namespaces, links and cgroups of rehearsals whose process is gone."""
    removed = []
    for f in STATE.glob("*") if STATE.is_dir() else []:
        try:
            pid = int(f.read_text().strip())
        except (OSError, ValueError):
            pid = -1
        if pid > 0 and _alive(pid):
            continue
        rid = f.name
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in (line.split()[0] for line in names.splitlines() if line.strip()):
            if ns.startswith(f"fsq{rid}-"):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # a namespace is torn down asynchronously: delete the host ends of its veths (and the
        # bridge) now rather than wait for the kernel
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") > 1 else ""
            if name.startswith(f"fsq{rid}h"):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"fsq{rid}"], capture_output=True)
        for group in CGROUP_CPU.glob(f"fedseq-fsq{rid}-*"):
            with contextlib.suppress(OSError):
                group.rmdir()
        with contextlib.suppress(OSError):
            f.unlink()
        removed.append(rid)
        log.warning("removed the namespaces of rehearsal %s, whose process %d is gone", rid, pid)
    return removed
