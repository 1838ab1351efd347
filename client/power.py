"""Energy and health on the device: readers for the power sensors the hardware offers, and a meter
that integrates them while the device works (issue 18; docs/energy.md).

Sources, tried in this order (the first readable one is used; `fedseq-client doctor` lists every
source it found and why any is unusable):

- ``jetson-iio``: JetPack 4 (Nano, TX1/TX2), the ``ina3221x`` IIO driver:
  ``/sys/bus/i2c/drivers/ina3221x/*/iio:device*/`` with ``rail_name_N`` and ``in_power{N}_input``
  (mW). The Nano's rails are POM_5V_IN (the whole board), POM_5V_GPU and POM_5V_CPU.
- ``jetson-hwmon``: JetPack 5/6 (Xavier, Orin), the mainline ``ina3221`` hwmon driver: every
  ``/sys/class/hwmon/hwmon*`` whose ``name`` is ``ina3221`` (the index differs per board and boot),
  channels 1-3 by their ``in{N}_label``, power = ``in{N}_input`` (mV) x ``curr{N}_input`` (mA);
  the sum channel (``in7``) is skipped.
- ``rapl``: x86, the powercap ``energy_uj`` counters (cumulative µJ, wrapping at
  ``max_energy_range_uj``); readable only by root on most kernels since Linux 5.10 (CVE-2020-8694).
- ``nvml``: NVIDIA desktop/server GPUs, NVML's total energy counter (mJ; Volta and later), when the
  ``pynvml`` module is installed (not a dependency).

Power sources are sampled every ``period`` seconds and integrated with the trapezoid rule; counter
sources are read at the same times (a wrap between two reads is undone). The board's total is the
input rail where one exists (``*_IN``), the platform domain (``psys``) or the sum of the CPU
packages for RAPL, else the sum of the rails. Python 3.8, no third-party import.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

#: default sampling period (s): 20 Hz. tegrastats' 1 s default leaves a 2 s client-round with two
#: samples; the INA3221's own conversion window on Jetsons is a few ms to ~150 ms, so sampling
#: faster mostly re-reads one value, while 50 ms keeps a 2 s round's integration within a few
#: percent and costs ~0.1% of one core (a sysfs read is ~20-50 µs).
PERIOD_S = 0.05


def sysfs_root() -> str:
    """Where the sensors are read: / (FEDSEQ_SYSFS_ROOT points the readers at a copy or a fake
    tree of /sys and /proc, as the tests do, or a rehearsal without Jetsons)."""
    return os.environ.get("FEDSEQ_SYSFS_ROOT", "/")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _readable(path: str) -> Optional[str]:
    """None if `path` can be read, else why not (for doctor)."""
    try:
        _read(path)
        return None
    except PermissionError:
        return f"{path} is not readable by this user (uid {os.getuid()})"
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"


@dataclass
class Source:
    """One power or energy source: `read()` returns watts per rail ("power") or cumulative joules
    per rail ("energy", wrapping at `wrap[rail]` joules)."""

    name: str
    kind: str  # "power" | "energy"
    read: Callable[[], Dict[str, float]]
    total: Optional[List[str]] = None  # the rails whose sum is the board's total; None: all
    wrap: Dict[str, float] = field(default_factory=dict)


def jetson_iio(root: str = "/") -> Tuple[Optional[Source], List[str]]:
    """JetPack 4's ina3221x IIO driver (mW per rail)."""
    files: Dict[str, str] = {}
    problems: List[str] = []
    pattern = os.path.join(root, "sys/bus/i2c/drivers/ina3221x/*/iio:device*")
    for dev in sorted(glob.glob(pattern)):
        for name_file in sorted(glob.glob(os.path.join(dev, "rail_name_*"))):
            n = name_file.rsplit("_", 1)[1]
            power = os.path.join(dev, f"in_power{n}_input")
            try:
                rail = _read(name_file)
            except OSError:
                continue
            why = _readable(power)
            if why is None:
                files[rail] = power
            else:
                problems.append(f"jetson-iio {rail}: {why}")
    if not files:
        return None, problems or ["jetson-iio: no ina3221x rails (not a JetPack 4 board)"]

    def read() -> Dict[str, float]:
        return {rail: float(_read(p)) / 1000.0 for rail, p in files.items()}

    total = [r for r in files if r.upper().endswith("_IN")] or None
    return Source("jetson-iio", "power", read, total), problems


def jetson_hwmon(root: str = "/") -> Tuple[Optional[Source], List[str]]:
    """JetPack 5/6's ina3221 hwmon driver (mV x mA per channel; the sum channel skipped)."""
    chans: Dict[str, Tuple[str, str]] = {}
    problems: List[str] = []
    for hw in sorted(glob.glob(os.path.join(root, "sys/class/hwmon/hwmon*"))):
        try:
            if _read(os.path.join(hw, "name")) != "ina3221":
                continue
        except OSError:
            continue
        for n in (1, 2, 3):
            label_file = os.path.join(hw, f"in{n}_label")
            volt, curr = os.path.join(hw, f"in{n}_input"), os.path.join(hw, f"curr{n}_input")
            try:
                label = _read(label_file)
            except OSError:
                continue
            if "sum" in label.lower() or label.upper().startswith("NC"):
                continue  # the shunt-sum channel, or an unconnected one
            why = _readable(volt) or _readable(curr)
            if why is None:
                chans[label] = (volt, curr)
            else:
                problems.append(f"jetson-hwmon {label}: {why}")
    if not chans:
        return None, problems or ["jetson-hwmon: no ina3221 hwmon channels (not a JetPack 5/6 board)"]

    def read() -> Dict[str, float]:
        return {label: float(_read(v)) * float(_read(c)) / 1e6 for label, (v, c) in chans.items()}

    total = [r for r in chans if r.upper().endswith("_IN")] or None
    return Source("jetson-hwmon", "power", read, total), problems


def rapl(root: str = "/") -> Tuple[Optional[Source], List[str]]:
    """x86 powercap counters (µJ, wrapping)."""
    zones: Dict[str, str] = {}
    wrap: Dict[str, float] = {}
    problems: List[str] = []
    for zone in sorted(glob.glob(os.path.join(root, "sys/class/powercap/*"))):
        energy = os.path.join(zone, "energy_uj")
        if not os.path.exists(energy):
            continue
        try:
            name = _read(os.path.join(zone, "name"))
        except OSError:
            name = os.path.basename(zone)
        parent = os.path.basename(zone).count(":") > 1  # a sub-zone (core, uncore, dram) of a package
        rail = f"{os.path.basename(zone).split(':')[1]}/{name}" if parent else name
        why = _readable(energy)
        if why is not None:
            problems.append(f"rapl {rail}: {why} (RAPL is root-only since Linux 5.10, "
                            "CVE-2020-8694: a udev rule or `chmod a+r` on energy_uj opens it)")
            continue
        zones[rail] = energy
        try:
            wrap[rail] = float(_read(os.path.join(zone, "max_energy_range_uj"))) / 1e6
        except (OSError, ValueError):
            wrap[rail] = 2.0 ** 32 / 1e6
    if not zones:
        return None, problems or ["rapl: no powercap energy counters (not x86, or no RAPL)"]

    def read() -> Dict[str, float]:
        return {rail: float(_read(p)) / 1e6 for rail, p in zones.items()}

    total = (["psys"] if "psys" in zones else
             [r for r in zones if r.startswith("package")] or None)
    return Source("rapl", "energy", read, total, wrap), problems


def nvml(root: str = "/") -> Tuple[Optional[Source], List[str]]:
    """NVML's total GPU energy counter (mJ), if pynvml is installed and the GPU supports it."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None, ["nvml: pynvml not installed (pip install nvidia-ml-py for desktop GPUs)"]
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                   for i in range(pynvml.nvmlDeviceGetCount())]
        for h in handles:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    except Exception as exc:  # NVMLError: no driver, no GPU, or not supported (pre-Volta)
        return None, [f"nvml: {exc}"]

    def read() -> Dict[str, float]:
        return {f"gpu{i}": pynvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0
                for i, h in enumerate(handles)}

    return Source("nvml", "energy", read, None, {f"gpu{i}": 2.0 ** 64 / 1000 for i in
                                                 range(len(handles))}), []


FINDERS = (jetson_iio, jetson_hwmon, rapl, nvml)


def find_source(root: str = "/") -> Tuple[Optional[Source], List[str]]:
    """The first usable source, and every finder's problems (for doctor and the status)."""
    problems: List[str] = []
    for finder in FINDERS:
        src, why = finder(root)
        if src is not None:
            return src, why
        problems.extend(why)
    return None, problems


@dataclass
class Mark:
    """The meter's state at one moment: time and cumulative joules per rail."""

    t: float
    joules: Dict[str, float]


@dataclass
class Energy:
    """What one stretch of work cost: joules and mean watts in total and per rail."""

    source: str
    seconds: float
    joules: float
    mean_w: float
    rails: Dict[str, float]
    max_temp_c: Optional[float] = None  # the hottest thermal zone during the stretch
    throttled: Optional[bool] = None  # a zone at or past a passive trip point; None: unknown

    def fields(self) -> Dict[str, Any]:
        """The update header's energy fields (rounded: informational, not bitwise)."""
        return {"energy_j": round(self.joules, 3), "energy_w": round(self.mean_w, 3),
                "energy_rails": {r: round(j, 3) for r, j in sorted(self.rails.items())[:16]},
                "energy_source": self.source, "max_temp_c": self.max_temp_c,
                "throttled": self.throttled}


class EnergyMeter:
    """Integrates a source in a background thread (`start`/`stop`); `mark()` takes a reading now
    and `since(mark)` is the energy from that mark until now. Without a source every `since` is
    None (never 0 J), and `reason` says why. Health (temperature, throttling) is sampled once a
    second in the same thread."""

    def __init__(self, source: Optional[Source], period: float = PERIOD_S, reason: str = "",
                 clock: Callable[[], float] = time.monotonic, root: Optional[str] = None):
        self.source = source
        self.period = period
        self.reason = reason if source is None else ""
        self.clock = clock
        self.root = root or sysfs_root()
        self._lock = threading.Lock()
        self._cum: Dict[str, float] = {}
        self._last: Optional[Tuple[float, Dict[str, float]]] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # (time, hottest zone °C, throttled) once a second, the last hour
        self._health: Deque[Tuple[float, Optional[float], Optional[bool]]] = deque(maxlen=3600)
        self.errors = 0

    @classmethod
    def for_this_device(cls, root: Optional[str] = None) -> EnergyMeter:
        """The meter of this device's power sensors (sysfs under `root`), or one without a source
        that says why."""
        root = root or sysfs_root()
        src, problems = find_source(root)
        return cls(src, reason="; ".join(problems), root=root)

    def sample(self) -> None:
        """Take one reading and add what passed since the last one."""
        if self.source is None:
            return
        try:
            values = self.source.read()
        except (OSError, ValueError):
            self.errors += 1
            return
        now = self.clock()
        with self._lock:
            if self._last is not None and now <= self._last[0]:
                return  # a concurrent reading (sampler thread and a mark) already took this time
            if self._last is not None:
                t0, before = self._last
                dt = now - t0
                for rail, v in values.items():
                    if rail not in before:
                        continue
                    if self.source.kind == "power":
                        add = (before[rail] + v) / 2.0 * dt
                    else:
                        add = v - before[rail]
                        if add < 0:  # the counter wrapped
                            add += self.source.wrap.get(rail, 0.0)
                    self._cum[rail] = self._cum.get(rail, 0.0) + max(add, 0.0)
            else:
                self._cum = {rail: 0.0 for rail in values}
            self._last = (now, values)

    def sample_health(self) -> Dict[str, Any]:
        """The device's temperature and throttling now, kept as the step's worst; the sample."""
        h = health(self.root)
        temp = h["temp_c"]
        throttled = h["throttled"]
        with self._lock:
            self._health.append((self.clock(), temp if isinstance(temp, float) else None,
                                 throttled if isinstance(throttled, bool) else None))
        return h

    def mark(self) -> Mark:
        """A mark to measure from: the time and the energy so far, each sensor's."""
        self.sample()
        with self._lock:
            return Mark(self._last[0] if self._last else self.clock(), dict(self._cum))

    def since(self, mark: Mark) -> Optional[Energy]:
        """Energy from `mark` to now, with the hottest temperature and any throttling seen in
        between (health is sampled once a second, and once more now); None without a source."""
        if self.source is None:
            return None
        self.sample_health()
        now = self.mark()
        rails = {r: now.joules[r] - mark.joules.get(r, 0.0) for r in now.joules}
        total_rails = self.source.total or list(rails)
        joules = sum(rails.get(r, 0.0) for r in total_rails)
        seconds = max(now.t - mark.t, 0.0)
        with self._lock:
            window = [(temp, thr) for t, temp, thr in self._health if t >= mark.t]
        temps = [temp for temp, _ in window if temp is not None]
        flags = [thr for _, thr in window if thr is not None]
        return Energy(self.source.name, seconds, joules, joules / seconds if seconds else 0.0,
                      rails, max(temps) if temps else None, any(flags) if flags else None)

    def start(self) -> None:
        """Start sampling in a background thread (where there is a source, once)."""
        if self.source is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="energy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the sampling thread."""
        self._stop.set()

    def _run(self) -> None:
        last_health = 0.0
        while not self._stop.wait(self.period):
            self.sample()
            if self.clock() - last_health >= 1.0:
                last_health = self.clock()
                self.sample_health()


# -- health ----------------------------------------------------------------------------------
def _zones(root: str) -> List[str]:
    return sorted(glob.glob(os.path.join(root, "sys/class/thermal/thermal_zone*")))


def health(root: Optional[str] = None) -> Dict[str, Any]:
    """Temperature (the hottest thermal zone, °C, and its name), whether a zone is at or past a
    passive trip point (throttling; None where no zone has trip points), the Jetson GPU's load
    (0-1; None elsewhere) and available memory (MB)."""
    root = root or sysfs_root()
    out: Dict[str, Any] = {"temp_c": None, "temp_zone": None, "throttled": None,
                              "gpu_load": None, "mem_available_mb": None}
    hottest: Optional[float] = None
    trips = False
    throttled = False
    for z in _zones(root):
        try:
            t = float(_read(os.path.join(z, "temp"))) / 1000.0
        except (OSError, ValueError):
            continue
        if t <= -40.0 or t > 200.0:  # a disabled or bogus zone (some report -256 °C)
            continue
        if hottest is None or t > hottest:
            hottest = t
            try:
                out["temp_zone"] = _read(os.path.join(z, "type"))
            except OSError:
                out["temp_zone"] = os.path.basename(z)
        for type_file in glob.glob(os.path.join(z, "trip_point_*_type")):
            trips = True
            try:
                if _read(type_file) != "passive":
                    continue
                limit = float(_read(type_file[: -len("type")] + "temp")) / 1000.0
            except (OSError, ValueError):
                continue
            if t >= limit:
                throttled = True
    out["temp_c"] = None if hottest is None else round(hottest, 1)
    out["throttled"] = throttled if trips else None
    for load in ("sys/devices/gpu.0/load", "sys/devices/platform/gpu.0/load",
                 "sys/devices/platform/bus@0/17000000.gpu/load"):
        try:
            out["gpu_load"] = round(float(_read(os.path.join(root, load))) / 1000.0, 3)
            break
        except (OSError, ValueError):
            continue
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    out["mem_available_mb"] = int(line.split()[1]) // 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return out


HEALTH_SENSORS = ("temperature", "gpu load", "throttling")


def sensors(root: Optional[str] = None) -> List[Tuple[str, bool, str]]:
    """For doctor: (what, usable, detail) for every power source and health sensor."""
    root = root or sysfs_root()
    rows: List[Tuple[str, bool, str]] = []
    for finder in FINDERS:
        src, problems = finder(root)
        if src is not None:
            rows.append((src.name, True, f"{src.kind} rails: "
                         f"{', '.join(sorted(src.read()))}"
                         + (f" (total: {'+'.join(src.total)})" if src.total else "")))
        rows.extend((finder.__name__.replace("_", "-"), False, p) for p in problems)
    h = health(root)
    rows.append(("temperature", h["temp_c"] is not None,
                 f"{h['temp_c']} °C ({h['temp_zone']})" if h["temp_c"] is not None
                 else "no readable thermal zone"))
    rows.append(("gpu load", h["gpu_load"] is not None,
                 "Jetson GPU load readable" if h["gpu_load"] is not None else "not a Jetson GPU"))
    rows.append(("throttling", h["throttled"] is not None,
                 "passive trip points found" if h["throttled"] is not None
                 else "no thermal trip points"))
    return rows
