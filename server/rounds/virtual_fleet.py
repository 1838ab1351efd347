"""Simulated time: a fleet of devices with paces and links, so that fedseq-sim advances a virtual
clock and models the energy a mixed testbed would spend ([fleet] in the config).

A device trains its clients one after another at its pace (`DeviceProfile`: effective training
FLOP/s, from the run's measured FLOPs per client-round), jittered per client-round from the run's
training seed; it receives a round's blocks over its link before training and sends each update
after it (`LinkProfile`, the rehearsal's). Clients are dealt to devices as a deployment deals
them (server/rounds/sites.py assign_clients: devices by name, round-robin).

Energy: every device of the fleet draws its idle power for the whole run and its training power
while it trains; transfers are counted at idle power (a Wi-Fi radio's extra draw is small beside
a Jetson's training draw, and no figure for it is measured here).

The profiles' figures (docs/results.md, "Mixed fleets", gives their sources): peak FP32 rates are
the datasheets' core counts x clocks x 2 (FMA) for the GPUs and x 8 or 16 FLOP/cycle (NEON FMA
units) for the CPUs; training power is the power mode's budget. The fraction of the peak a small
model's training reaches (`utilisation`) and the idle power are ASSUMPTIONS, one per kind of
processor, until a device's run is measured: a user with a measured pace gives a custom profile
(`fedseq fleet RUN_DIR` makes them from a deployment's rows: measured_fleet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedseq.common.errors import ConfigError
from fedseq.common.seeding import numpy_rng
from fedseq.server.rounds.links import LinkProfile, parse_profile

if TYPE_CHECKING:
    from fedseq.common.config import ExperimentConfig
    from fedseq.server.rounds.records import RoundRecord

#: assumed fraction of the FP32 peak a client's training reaches (small batches of a small
#: model leave most of a GPU idle); replace with a measured pace where there is one
GPU_UTILISATION = 0.10
CPU_UTILISATION = 0.25


@dataclass(frozen=True)
class DeviceProfile:
    """A kind of device: the FP32 peak of what trains, the fraction of it training reaches, the
    board's power while training and idle, in watts."""

    name: str
    peak_gflops: float
    utilisation: float
    train_w: float
    idle_w: float

    @property
    def flops_per_s(self) -> float:
        """Effective training FLOP/s."""
        return self.peak_gflops * 1e9 * self.utilisation


PROFILES: dict[str, DeviceProfile] = {
    # Jetson Nano 4 GB, MAXN (10 W): 128 Maxwell cores at 921.6 MHz; 4 Cortex-A57 at 1.43 GHz
    "nano": DeviceProfile("nano", 235.9, GPU_UTILISATION, 10.0, 2.0),
    "nano-cpu": DeviceProfile("nano-cpu", 45.8, CPU_UTILISATION, 10.0, 2.0),
    # Jetson Xavier NX, 15 W: 384 Volta cores at 1.1 GHz; 6 Carmel at 1.4 GHz
    "xavier-nx": DeviceProfile("xavier-nx", 844.8, GPU_UTILISATION, 15.0, 3.0),
    "xavier-nx-cpu": DeviceProfile("xavier-nx-cpu", 134.4, CPU_UTILISATION, 15.0, 3.0),
    # Jetson Orin Nano 8 GB, 15 W: 1024 Ampere cores at 625 MHz; 6 Cortex-A78AE at 1.5 GHz
    "orin-nano": DeviceProfile("orin-nano", 1280.0, GPU_UTILISATION, 15.0, 3.0),
    "orin-nano-cpu": DeviceProfile("orin-nano-cpu", 144.0, CPU_UTILISATION, 15.0, 3.0),
}


def parse_device(text: str) -> DeviceProfile:
    """A profile name, or `custom:gflops=G,train_w=W,idle_w=W` (G: the measured effective
    training GFLOP/s; idle_w defaults to 0)."""
    if text in PROFILES:
        return PROFILES[text]
    if not text.startswith("custom:"):
        raise ConfigError(f"fleet.devices: unknown device profile {text!r}; use one of "
                          f"{', '.join(PROFILES)} or custom:gflops=G,train_w=W,idle_w=W")
    fields: dict[str, float] = {}
    for part in text[len("custom:"):].split(","):
        key, _, value = part.partition("=")
        try:
            fields[key] = float(value)
        except ValueError:
            raise ConfigError(f"fleet.devices: {text!r}: {key}={value!r} is not a number") from None
        if key not in ("gflops", "train_w", "idle_w") or not math.isfinite(fields[key]) \
                or fields[key] < 0:
            raise ConfigError(f"fleet.devices: {text!r}: {key!r} must be one of gflops, train_w, "
                              "idle_w with a finite value >= 0")
    if fields.get("gflops", 0) <= 0 or "train_w" not in fields:
        raise ConfigError(f"fleet.devices: {text!r} needs gflops > 0 and train_w")
    return DeviceProfile(text, fields["gflops"], 1.0, fields["train_w"], fields.get("idle_w", 0.0))


@dataclass(frozen=True)
class Device:
    """One simulated device: its name, profile and link."""

    name: str
    profile: DeviceProfile
    link: LinkProfile

    def down_s(self, nbytes: int) -> float:
        """Seconds to receive `nbytes` over its link (one-way delay included)."""
        return self.link.down_s(nbytes)

    def up_s(self, nbytes: int) -> float:
        """Seconds to send `nbytes` over its link (one-way delay included)."""
        return self.link.up_s(nbytes)


class VirtualFleet:
    """The simulated fleet of a run: its devices, which client each holds, and the jittered
    seconds of a client's training."""

    def __init__(self, cfg: ExperimentConfig):
        devices: list[Device] = []
        for group in cfg.fleet.devices:
            profile = parse_device(group.profile)
            link = parse_profile(group.link, "fleet.devices: link")
            kind = group.profile.split(":", 1)[0]
            devices += [Device(f"{kind}-{len(devices) + i:02d}", profile, link)
                        for i in range(group.count)]
        if not devices:
            raise ConfigError("no [fleet] devices: give fleet.devices, e.g. --set "
                              "'fleet.devices=[{profile=\"nano\",count=10}]'")
        self.devices = sorted(devices, key=lambda d: d.name)
        n = len(self.devices)
        self.device_of = {c: self.devices[c % n] for c in range(cfg.data.num_clients)}
        self.seed = cfg.seed_for("training")
        self.jitter = cfg.fleet.jitter
        #: the whole fleet's idle draw, watts
        self.idle_w = sum(d.profile.idle_w for d in self.devices)

    def train_s(self, client: int, flops: int, key: int) -> float:
        """Seconds `client`'s device takes for `flops` of training, in the client-round `key`
        (a round, or an asynchronous dispatch): the device's pace, jittered."""
        device = self.device_of[client]
        z = float(numpy_rng(self.seed, "pace", key, client).standard_normal())
        return flops / device.profile.flops_per_s * math.exp(self.jitter * z)

    def extra_j(self, client: int, train_s: float) -> float:
        """Joules above idle that `train_s` of training costs on `client`'s device."""
        p = self.device_of[client].profile
        return (p.train_w - p.idle_w) * train_s


@dataclass
class ClientTiming:
    """One client's part of a synchronous round, in seconds from the round's start."""

    start: float  # its training starts
    train_s: float
    arrival: float  # its update has reached the coordinator


def sync_round(fleet: VirtualFleet, clients: list[int], flops: dict[int, int],
               down_bytes: dict[int, int], up_bytes: int, round: int
               ) -> dict[int, ClientTiming]:
    """When each selected client's update arrives: a device receives the round's blocks once
    (the most any of its clients needed), then trains its clients in client order, sending each
    update as it is done (while it trains the next)."""
    out: dict[int, ClientTiming] = {}
    by_device: dict[str, list[int]] = {}
    for c in sorted(clients):
        by_device.setdefault(fleet.device_of[c].name, []).append(c)
    for mine in by_device.values():
        device = fleet.device_of[mine[0]]
        t = device.down_s(max(down_bytes[c] for c in mine))
        for c in mine:
            train = fleet.train_s(c, flops[c], round)
            out[c] = ClientTiming(t, train, t + train + device.up_s(up_bytes))
            t += train
    return out


def energy_j(fleet: VirtualFleet, seconds: float, trained: dict[int, float]) -> float:
    """The fleet's joules over `seconds` in which the clients `trained` (client -> its seconds
    of training in that span): every device idle all along, plus training's extra draw."""
    return fleet.idle_w * seconds + sum(fleet.extra_j(c, s) for c, s in trained.items())


def measured_fleet(rows: list[RoundRecord], train_w: float, idle_w: float, link: str) -> str:
    """A deployment's devices as a [fleet] (`fedseq fleet RUN_DIR`): one custom profile per
    device, its effective GFLOP/s = the FLOPs of its counted updates over the training seconds
    it reported for them (the rows' `paces` and `reporters`), its training watts the mean it
    measured where it did (else `train_w`), devices by name as the deployment dealt clients to
    them. The rows do not say the links: `link` for every device. A ConfigError where no row
    has paces (a simulation, or a deployment from before they were recorded)."""
    flops: dict[str, float] = {}
    seconds: dict[str, float] = {}
    watts: dict[str, list[float]] = {}
    for r in rows:
        for c, (s, f) in r.paces.items():
            device = r.reporters.get(c)
            if device is not None and s > 0:
                flops[device] = flops.get(device, 0.0) + f
                seconds[device] = seconds.get(device, 0.0) + s
        devices = getattr(r.energy, "devices", None) or {}
        for device, e in devices.items():
            if e.w is not None:
                watts.setdefault(device, []).append(e.w)
    if not flops:
        raise ConfigError("the run directory's rows record no measured paces: only a deployment "
                          "(fedseq-server start) of this version records them")
    parse_profile(link, "--link")
    groups = []
    for device in sorted(flops):
        w = sum(watts[device]) / len(watts[device]) if device in watts else train_w
        gflops = flops[device] / seconds[device] / 1e9
        groups.append(f'{{profile="custom:gflops={gflops:.4g},train_w={w:.3g},idle_w={idle_w:g}",'
                      f'count=1,link="{link}"}},  # {device}')
    return "fleet.devices = [\n" + "".join(f"    {g}\n" for g in groups) + "]"
