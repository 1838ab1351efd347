"""A testbed rehearsed on one machine: every local device daemon in its own network namespace,
behind an emulated link (Linux tc) and optionally a CPU quota (cgroup v1 `cpu`), so round times,
transfer times and deadlines reflect a Wi-Fi or LTE fleet before the devices are booked.

Layout: a bridge with the coordinator's side at 10.77.0.1/24; device i lives in namespace
`<prefix>-<i>` with 10.77.0.(i+1) on a veth pair whose host end is in the bridge. The download
direction (broker to device) is shaped on the host end, the upload direction inside the namespace.

A fleet of sites ([hierarchy]) is a tree: site j is a namespace `<prefix>-s<j>` (the site's
gateway, where its broker and its edge aggregator run) at 10.77.0.(j+1) on the coordinator's
bridge, behind the site's uplink (hierarchy.links, shaped like a device's link), with a bridge of
its own at 10.78.j.1/24; its devices hang off that bridge at 10.78.j.(i+1), behind their own
links, routed through the gateway. A device reaches the coordinator's bridge only across its
site's uplink: the flat run over the tree (hierarchy.edge_aggregation = false) sends every update
across it, two tiers send the site's partial.
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
                 quotas: dict[str, float] | None = None,
                 sites: dict[str, list[str]] | None = None,
                 uplinks: dict[str, LinkProfile] | None = None):
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
        #: site -> its devices (of `devices`), and each site's uplink to the coordinator
        self.sites = sites or {}
        self.uplinks = uplinks or {}
        self._site_of = {d: s for s, ds in self.sites.items() for d in ds}
        if self.sites and set(self._site_of) != set(devices):
            raise ConfigError("a rehearsal of sites holds each of its devices in one site")
        self.id = uuid.uuid4().hex[:6]
        self.bridge = f"fsq{self.id}"
        self.netem = True
        self._made: list[tuple[str, ...]] = []

    def ns(self, device: str) -> str:
        """The network namespace of a device of this rehearsal."""
        return f"fsq{self.id}-{self.devices.index(device) + 1}"

    def _site_index(self, site: str) -> int:
        return list(self.sites).index(site) + 1

    def site_ns(self, site: str) -> str:
        """The namespace of a site's gateway (its broker and its edge aggregator run there)."""
        return f"fsq{self.id}-s{self._site_index(site)}"

    def site_host(self, site: str) -> str:
        """The address of a site's broker, on the site's own bridge."""
        return f"10.78.{self._site_index(site)}.1"

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
        for site in self.sites:
            self._site(site)
        for i, device in enumerate(self.devices, start=1):
            ns, host, dev = self.ns(device), f"fsq{self.id}h{i}", f"fsq{self.id}d{i}"
            home = self._site_of.get(device)
            # the host end's side: the coordinator's bridge, or its site's gateway
            at = [] if home is None else ["ip", "netns", "exec", self.site_ns(home)]
            bridge = self.bridge if home is None else f"fsq{self.id}b{self._site_index(home)}"
            net = "10.77.0" if home is None else f"10.78.{self._site_index(home)}"
            _run("ip", "netns", "add", ns)
            self._made.append(("ip", "netns", "del", ns))
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", dev)
            self._made.append((*at, "ip", "link", "del", host))
            _run("ip", "link", "set", dev, "netns", ns)
            if home is not None:
                _run("ip", "link", "set", host, "netns", self.site_ns(home))
            _run(*at, "ip", "link", "set", host, "master", bridge)
            _run(*at, "ip", "link", "set", host, "up")
            _run("ip", "-n", ns, "addr", "add", f"{net}.{i + 1}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if home is not None:  # the coordinator's bridge through the gateway
                _run("ip", "-n", ns, "route", "add", "default", "via", f"{net}.1")
            link = self.links.get(device)
            if link is not None:
                self._shape(at, host, link.down_mbit, link)
                self._shape(["ip", "netns", "exec", ns], dev, link.up_mbit, link)
            if device in self.quotas:
                group = CGROUP_CPU / f"fedseq-{ns}"
                group.mkdir(exist_ok=True)
                self._made.append(("rmdir", str(group)))
                (group / "cpu.cfs_period_us").write_text("100000\n")
                (group / "cpu.cfs_quota_us").write_text(f"{int(self.quotas[device] * 100000)}\n")
        if not self.netem and any(lk.delay_ms or lk.jitter_ms or lk.loss_pct for lk in
                                  [*self.links.values(), *self.uplinks.values()]):
            log.warning("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): the links get "
                        "their rates (tbf) but no delay, jitter or loss")

    def _site(self, site: str) -> None:
        """A site's gateway namespace: on the coordinator's bridge behind the site's uplink, with
        the site's own bridge, forwarding between the two (module docstring)."""
        j, ns = self._site_index(site), self.site_ns(site)
        host, gw, bridge = f"fsq{self.id}u{j}", f"fsq{self.id}g{j}", f"fsq{self.id}b{j}"
        inside = ["ip", "netns", "exec", ns]
        _run("ip", "netns", "add", ns)
        self._made.append(("ip", "netns", "del", ns))
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", gw)
        self._made.append(("ip", "link", "del", host))
        _run("ip", "link", "set", gw, "netns", ns)
        _run("ip", "link", "set", host, "master", self.bridge)
        _run("ip", "link", "set", host, "up")
        _run("ip", "-n", ns, "addr", "add", f"10.77.0.{j + 1}/24", "dev", gw)
        _run("ip", "-n", ns, "link", "set", gw, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "link", "add", bridge, "type", "bridge")
        _run("ip", "-n", ns, "addr", "add", f"{self.site_host(site)}/24", "dev", bridge)
        _run("ip", "-n", ns, "link", "set", bridge, "up")
        _run(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run("ip", "route", "add", f"10.78.{j}.0/24", "via", f"10.77.0.{j + 1}")
        self._made.append(("ip", "route", "del", f"10.78.{j}.0/24"))
        uplink = self.uplinks.get(site)
        if uplink is not None:
            self._shape([], host, uplink.down_mbit, uplink)
            self._shape(inside, gw, uplink.up_mbit, uplink)

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

    def site_command(self, site: str, cmd: list[str]) -> list[str]:
        """`cmd` run in `site`'s gateway namespace (its edge aggregator)."""
        return ["ip", "netns", "exec", self.site_ns(site), *cmd]

    def started(self, device: str, pid: int) -> None:
        """Put a started daemon under its device's CPU quota."""
        if device in self.quotas:
            (CGROUP_CPU / f"fedseq-{self.ns(device)}" / "cgroup.procs").write_text(f"{pid}\n")

    def cut(self, device: str, down: bool = True) -> None:
        """Take `device`'s link down (or up again): the fault a walk out of Wi-Fi range makes."""
        host = f"fsq{self.id}h{self.devices.index(device) + 1}"
        site = self._site_of.get(device)
        at = [] if site is None else ["-n", self.site_ns(site)]
        _run("ip", *at, "link", "set", host, "down" if down else "up")

    def describe(self) -> str:
        """One line: how links are shaped here (netem, or tbf's rate alone) and each device's link
        and CPU quota."""
        kinds = "netem" if self.netem else "tbf rate only (no netem in this kernel)"
        parts = [f"{d}: {self.links[d].describe() if d in self.links else 'unshaped'}"
                 + (f", {self.quotas[d]:g} cores" if d in self.quotas else "")
                 for d in self.devices]
        parts += [f"site {s}'s uplink: "
                  + (self.uplinks[s].describe() if s in self.uplinks else "unshaped")
                  for s in self.sites]
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
        # a namespace is torn down asynchronously: delete the host ends of its veths (a
        # device's, a site's uplink) now rather than wait for the kernel, then the bridge
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") > 1 else ""
            if name.startswith(f"fsq{rid}") and name != f"fsq{rid}":
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"fsq{rid}"], capture_output=True)
        # (a site's route goes with the bridge its gateway is reached on)
        for group in CGROUP_CPU.glob(f"fedseq-fsq{rid}-*"):
            with contextlib.suppress(OSError):
                group.rmdir()
        with contextlib.suppress(OSError):
            f.unlink()
        removed.append(rid)
        log.warning("removed the namespaces of rehearsal %s, whose process %d is gone", rid, pid)
    return removed
