"""fedseq-server status: what the broker knows about the coordinator, the run and every device
(with each device's torch build and health: free memory, temperature, throttling, the energy of its last
client-round and its power source, refreshed with its heartbeat).

Everything shown is retained on the broker (server status, run config, current step, each
device's status with its last reported error), so it works before a run, during one and after.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fedseq.common.errors import ProtocolError
from fedseq.common.protocol.link import Link, TlsOptions, session_id
from fedseq.common.protocol.messages import (
    DeviceInfo,
    DeviceStatus,
    RunConfig,
    ServerStatus,
    SiteStatus,
    Step,
)
from fedseq.common.protocol.topics import Topics
from fedseq.common.text import printable


@dataclass
class FleetView:
    """What the broker's retained messages say about the coordinator, the run and every device."""

    server: ServerStatus | None = None
    run: RunConfig | None = None
    step: Step | None = None
    devices: dict[str, DeviceStatus] = field(default_factory=dict)
    stacks: dict[str, DeviceInfo] = field(default_factory=dict)  # what each device trains with
    campaign: Any = None  # a campaign.CampaignStatus: the last progress a campaign published
    invalid: list[str] = field(default_factory=list)
    #: [hierarchy]: each site's edge aggregator as it said (its devices online), and the site of
    #: each device as the run's config names it (the sites' devices' statuses are bridged here)
    sites: dict[str, SiteStatus] = field(default_factory=dict)
    site_of: dict[str, str] = field(default_factory=dict)


def read_fleet(url: str, topic_root: str = "fedseq", username: str | None = None,
               password: str | None = None, tls: TlsOptions | None = None,
               wait: float = 2.0) -> FleetView:
    """Subscribe, collect the retained messages for `wait` seconds, disconnect."""
    t = Topics(topic_root)
    view = FleetView()
    lock = threading.Lock()

    def on_message(topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            with lock:
                if topic == t.server_status:
                    view.server = ServerStatus.decode(payload)
                elif topic == t.run_config:
                    view.run = RunConfig.decode(payload)
                elif topic == t.step:
                    view.step = Step.decode(payload)
                elif topic == t.campaign:
                    view.campaign = _campaign_status(payload)
                elif (kind := getattr(t.parse(topic), "kind", "")) == "device_info":
                    info = DeviceInfo.decode(payload)
                    if topic == t.device_info(info.device):
                        view.stacks[info.device] = info
                elif kind == "device_status":
                    status = DeviceStatus.decode(payload)
                    if topic == t.device_status(status.device):
                        view.devices[status.device] = status
                elif kind == "site_status":
                    site = SiteStatus.decode(payload)
                    if topic == t.site(site.site, "status"):
                        view.sites[site.site] = site
                elif kind == "site_run":  # a fleet of sites: the run is given to each site
                    view.run = RunConfig.decode(payload)
                    sites = view.run.config.get("hierarchy", {}).get("sites", {})
                    view.site_of = {str(d): str(s) for s, ds in sites.items() for d in ds}
                # anything else (amqtt replays other retained messages too: weights,
                # assignments) is not what status reads
        except ProtocolError as exc:
            view.invalid.append(f"{topic}: {exc}")

    link = Link(session_id("fedseq-status"), url,
                [t.server_status, t.campaign, t.run_config, t.step, t.device_status(),
                 t.device_info(), t.site("+", "status"), t.site("+", "run")],
                on_message,
                username=username, password=password, tls=tls)
    link.start(attempts=1)
    try:
        time.sleep(wait)
    finally:
        link.stop()
    return view


def _campaign_status(payload: bytes) -> Any:
    from pydantic import ValidationError

    from fedseq.server.ops.campaign import CampaignStatus

    try:
        return CampaignStatus.model_validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"invalid campaign status ({exc.error_count()} errors)") from None


def format_campaign(c: Any, now: float | None = None) -> str:
    """The campaign line of `fedseq-server status`: run i of N, its round, the outcomes, the time
    left estimated from the rounds measured, and how old that is."""
    now = time.time() if now is None else now
    at = f"run {c.run} of {c.runs} ({printable(c.folder, 120)})" if c.run else f"{c.runs} runs"
    rnd = f", round {c.round + 1} of {c.rounds} done" if c.run and c.round >= 0 else ""
    left = ""
    if c.state == "running" and c.left_s is not None:
        h, m = divmod(int(c.left_s // 60), 60)
        left = f"; about {h} h {m:02d} min left at {c.seconds_per_round:.1f} s a round"
    return (f"campaign {printable(c.campaign, 200)}: {c.state}, {at}{rnd}; {c.finished} finished, "
            f"{c.failed} failed{left} (as of {_when(c.updated)}, {max(0, now - c.updated):.0f} s ago)")


def _when(ts: float) -> str:
    """A device's claimed Unix time as local time; "?" for one no clock can show (Inf, NaN,
    1e300: a retained status of an older device, or a forged one)."""
    if not ts:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, ValueError, OSError):
        return "?"


#: above this many devices `fedseq-server status` summarizes: counts, then the devices that need
#: a look (at most LISTED of them), not a line per healthy device (`--all` lists every one)
SUMMARY_ABOVE = 30
LISTED = 50
LOW_MEMORY_MB = 256
HOT_C = 85.0


#: what can need a look at a device, worst first
PROBLEMS = ("offline", "error", "throttled", "hot", "low memory")


def problems(d: DeviceStatus) -> list[str]:
    """What needs a look at a device, in PROBLEMS' order (worst first): offline, a failed step,
    throttled, hot, low on memory. Empty: healthy."""
    found = {"offline": d.state != "online", "error": bool(d.error), "throttled": bool(d.throttled),
             "hot": d.temp_c is not None and d.temp_c >= HOT_C,
             "low memory": d.mem_available_mb is not None and d.mem_available_mb < LOW_MEMORY_MB}
    return [k for k in PROBLEMS if found[k]]


def _summarized(view: FleetView, shown: list[tuple[str, Any]]
                ) -> tuple[list[str], list[tuple[str, Any]]]:
    """A large fleet: two lines of counts by state and problem, and the devices with a problem,
    worst first (LISTED of them)."""
    found = {name: problems(d) for name, d in shown}
    counts = {k: sum(k in p for p in found.values()) for k in PROBLEMS}
    look = sorted((n for n, p in found.items() if p),
                  key=lambda n: (PROBLEMS.index(found[n][0]), n))
    summary = [f"{len(shown)} devices: {len(shown) - counts['offline']} online, "
               f"{counts['offline']} offline; "
               + ", ".join(f"{counts[k]} {k if k != 'error' else 'with an error'}"
                           for k in PROBLEMS[1:])
               + f" (error: a failed step; hot: >= {HOT_C:.0f} C; low memory: < "
               f"{LOW_MEMORY_MB} MB free)",
               f"{len(look)} need a look" + (f", the first {LISTED} below" if len(look) >
                                              LISTED else " (below)" if look else "")
               + f"; {len(shown) - len(look)} healthy devices not listed "
               "(fedseq-server status --all lists every device)"]
    return summary, [(n, view.devices[n]) for n in look[:LISTED]]


def _device_row(view: FleetView, name: str, d: Any) -> tuple[str, ...]:
    """One device's row of the table, each cell as the device said it."""
    error = "-"
    if d.error:
        error = d.error if len(d.error) <= 80 else d.error[:77] + "..."
        if d.error_seq != -1:  # -1: the whole run (the device cannot follow it): it says so
            error = f"step {d.error_seq}: {error}"
    temp = "-" if d.temp_c is None else f"{d.temp_c:.0f} C" + (" THROTTLED" if d.throttled else "")
    source = d.energy_source or "-"
    info = view.stacks.get(name)  # its torch build, where the device described itself
    torch = d.torch_device + (f" {info.torch}" if info is not None and info.torch else "")
    return (name, d.state, _when(d.since) if d.state == "online" else "-",
            d.package_version or "-", f"v{d.v}", torch,
            f"{d.memory_mb} MB" if d.memory_mb else "-",
            "-" if d.mem_available_mb is None else f"{d.mem_available_mb} MB", temp,
            "-" if d.last_round_j is None else f"{d.last_round_j:.1f} J",
            "none" if source.startswith("none") else source, error)


def format_fleet(view: FleetView, url: str, every: bool = False) -> list[str]:
    """The lines `fedseq-server status` prints: a line per device, or beyond SUMMARY_ABOVE
    devices (unless `every`) the counts by state and problem and the devices with a problem,
    worst first."""
    s = view.server
    lines = [f"broker {url}: coordinator {s.state if s else 'never seen'}"
             + (f", run {s.run_id}" if s and s.run_id and s.state == "online" else "")
             + (f" (its last run {s.run_id})" if s and s.run_id and s.state != "online" else "")]
    if view.campaign is not None:
        lines.append(format_campaign(view.campaign))
    if view.run is not None:
        c = view.run.config
        lines.append(f"run {view.run.run_id}: {c.get('algorithm', {}).get('name')} on "
                     f"{c.get('data', {}).get('dataset')}, {c.get('rounds')} rounds")
    for name, site in sorted(view.sites.items()):
        lines.append(f"site {printable(name, 64)}: edge aggregator {site.state}"
                     + (f", {len(site.devices)} devices online "
                        f"({printable(', '.join(site.devices), 300)})"
                        if site.state == "online" else ""))
    if view.step is not None:
        st = view.step
        where = f", round {st.round}" if st.kind == "train" else ""
        lines.append(f"current step {st.seq}: {st.kind}{where}"
                     + (f", {len(st.clients)} clients" if st.clients else ""))
    if not view.devices:
        lines.append("no device has ever connected to this broker under this topic root")
    header = ("device", "state", "since", "version", "protocol", "torch", "memory", "free",
              "temp", "last round", "power", "last error")
    rows: list[tuple[str, ...]] = [header]
    shown = sorted(view.devices.items())
    summary: list[str] = []
    if len(view.devices) > SUMMARY_ABOVE and not every:
        summary, shown = _summarized(view, shown)
    rows += [_device_row(view, name, d) for name, d in shown]
    if view.site_of:  # a fleet of sites: each device's site beside its name
        rows = [(f"{r[0]} ({view.site_of.get(r[0], '?')})" if i else r[0],) + r[1:]
                for i, r in enumerate(rows)]
    # every cell is a device's words: one line of plain text, of bounded length
    rows = [tuple(printable(v, 40) for v in r[:-1]) + (printable(r[-1], 120),) for r in rows]
    lines += summary
    if view.devices and len(rows) > 1:
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        for r in rows:
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[-1])
    if view.devices and not summary:
        online = sum(d.state == "online" for d in view.devices.values())
        lines.append(f"{online} of {len(view.devices)} devices online")
    lines += [f"invalid retained message on {printable(m, 300)}" for m in view.invalid]
    return lines
