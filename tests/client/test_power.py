"""Power readers against fake sysfs trees in the documented layouts (JetPack 4 IIO, JetPack 5/6
hwmon, RAPL powercap), the meter's integration against a known power curve, counter wraps,
missing permissions, and health readings."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from fedseq.client import power


def _put(root: Path, rel: str, value) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"{value}\n")
    return p


def jp4_tree(root: Path, mw=(4000, 1200, 900)) -> Path:
    dev = "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    for n, (rail, v) in enumerate(zip(("POM_5V_IN", "POM_5V_GPU", "POM_5V_CPU"), mw)):
        _put(root, f"{dev}/rail_name_{n}", rail)
        _put(root, f"{dev}/in_power{n}_input", v)
        _put(root, f"{dev}/in_current{n}_input", v // 5)
        _put(root, f"{dev}/in_voltage{n}_input", 5000)
    return root / dev


def jp5_tree(root: Path) -> Path:
    _put(root, "sys/class/hwmon/hwmon0/name", "tmp451")  # another sensor first: no fixed index
    _put(root, "sys/class/hwmon/hwmon0/temp1_input", 40000)
    hw = "sys/class/hwmon/hwmon3"
    _put(root, f"{hw}/name", "ina3221")
    for n, (label, mv, ma) in enumerate([("VDD_IN", 5000, 1200), ("VDD_CPU_GPU_CV", 5000, 400),
                                         ("VDD_SOC", 5000, 300)], start=1):
        _put(root, f"{hw}/in{n}_label", label)
        _put(root, f"{hw}/in{n}_input", mv)
        _put(root, f"{hw}/curr{n}_input", ma)
        _put(root, f"{hw}/in{n + 3}_input", 1000)  # shunt voltages (µV): not power
    _put(root, f"{hw}/in7_label", "sum of shunt voltages")
    _put(root, f"{hw}/in7_input", 3000)
    _put(root, f"{hw}/curr4_input", 1900)
    return root / hw


def rapl_tree(root: Path, package_uj=1_000_000, dram_uj=500_000, wrap_uj=262143328850) -> Path:
    for zone, name, uj in [("intel-rapl:0", "package-0", package_uj),
                           ("intel-rapl:0:0", "core", package_uj // 2),
                           ("intel-rapl:0:1", "dram", dram_uj)]:
        _put(root, f"sys/class/powercap/{zone}/name", name)
        _put(root, f"sys/class/powercap/{zone}/energy_uj", uj)
        _put(root, f"sys/class/powercap/{zone}/max_energy_range_uj", wrap_uj)
    return root / "sys/class/powercap"


def test_jetpack4_iio_rails_in_milliwatts(tmp_path):
    jp4_tree(tmp_path)
    src, problems = power.find_source(str(tmp_path))
    assert src is not None and src.name == "jetson-iio" and src.kind == "power"
    assert src.read() == {"POM_5V_IN": 4.0, "POM_5V_GPU": 1.2, "POM_5V_CPU": 0.9}
    assert src.total == ["POM_5V_IN"]  # the board input, not the sum of rails inside it


def test_jetpack5_hwmon_channels_found_by_name_and_label(tmp_path):
    jp5_tree(tmp_path)
    src, _ = power.find_source(str(tmp_path))
    assert src is not None and src.name == "jetson-hwmon"
    watts = src.read()
    assert watts == pytest.approx({"VDD_IN": 6.0, "VDD_CPU_GPU_CV": 2.0, "VDD_SOC": 1.5})
    assert "sum of shunt voltages" not in watts and src.total == ["VDD_IN"]


def test_rapl_counters_with_a_wrap(tmp_path):
    wrap_uj = 10_000_000  # 10 J range, to wrap within the test
    rapl_tree(tmp_path, package_uj=9_000_000, wrap_uj=wrap_uj)
    src, _ = power.find_source(str(tmp_path))
    assert src is not None and src.name == "rapl" and src.kind == "energy"
    assert src.total == ["package-0"] and set(src.read()) == {"package-0", "0/core", "0/dram"}
    clock = [0.0]
    meter = power.EnergyMeter(src, clock=lambda: clock[0], root=str(tmp_path))
    start = meter.mark()
    clock[0] = 1.0
    _put(tmp_path, "sys/class/powercap/intel-rapl:0/energy_uj", 9_500_000)
    meter.sample()
    clock[0] = 2.0
    _put(tmp_path, "sys/class/powercap/intel-rapl:0/energy_uj", 1_500_000)  # wrapped past 10 J
    e = meter.since(start)
    assert e.joules == pytest.approx(0.5 + 2.0)  # 9.0 -> 9.5 -> (wrap at 10) -> 1.5
    assert e.mean_w == pytest.approx(1.25) and e.seconds == pytest.approx(2.0)


def test_an_unreadable_rapl_counter_is_reported_not_zero(tmp_path, monkeypatch):
    """energy_uj mode 0400, root-owned (the kernel's default since CVE-2020-8694): as another user
    the read fails with EACCES. Root reads any file, so as root the same error is raised where the
    file is read."""
    rapl_tree(tmp_path)
    counters = list(tmp_path.glob("sys/class/powercap/*/energy_uj"))
    for f in counters:
        f.chmod(0o400)
    if os.geteuid() == 0:
        real = power._read

        def denied(path):
            if path.endswith("energy_uj"):
                raise PermissionError(13, "Permission denied", path)
            return real(path)

        monkeypatch.setattr(power, "_read", denied)
    meter = power.EnergyMeter.for_this_device(str(tmp_path))
    assert meter.source is None and meter.since(meter.mark()) is None  # never 0 J
    assert "energy_uj is not readable by this user" in meter.reason
    assert "CVE-2020-8694" in meter.reason


def test_integration_of_a_known_power_curve():
    """P(t) = 5 + 2 sin(t) W over 10 s, sampled every 50 ms: the trapezoid integral is within
    0.01% of the exact 50 + 2 (1 - cos 10) J."""
    clock = [0.0]
    src = power.Source("synthetic", "power", lambda: {"board": 5 + 2 * math.sin(clock[0])})
    meter = power.EnergyMeter(src, clock=lambda: clock[0])
    start = meter.mark()
    for i in range(1, 201):
        clock[0] = i * power.PERIOD_S
        meter.sample()
    e = meter.since(start)
    exact = 50 + 2 * (1 - math.cos(10))
    assert e.joules == pytest.approx(exact, rel=1e-4)
    assert e.mean_w == pytest.approx(exact / 10, rel=1e-4) and e.rails == {"board": e.joules}


def test_marks_split_one_meter_into_client_rounds(tmp_path):
    dev = jp4_tree(tmp_path)
    src, _ = power.find_source(str(tmp_path))
    clock = [0.0]
    meter = power.EnergyMeter(src, clock=lambda: clock[0], root=str(tmp_path))
    a = meter.mark()
    clock[0] = 2.0  # client A: 4 W for 2 s
    b = meter.mark()
    _put(tmp_path, f"{dev.relative_to(tmp_path)}/in_power0_input", 8000)
    clock[0] = 3.0  # client B: 4 -> 8 W over 1 s (trapezoid: 6 J)
    ea, eb = meter.since(a), meter.since(b)
    assert eb.joules == pytest.approx(6.0) and eb.rails["POM_5V_GPU"] == pytest.approx(1.2)
    assert ea.joules == pytest.approx(8.0 + 6.0)


def test_no_source_gives_none_with_the_reason(tmp_path):
    meter = power.EnergyMeter.for_this_device(str(tmp_path))
    assert meter.source is None and meter.since(meter.mark()) is None
    assert "jetson-iio" in meter.reason and "rapl" in meter.reason


def test_health_temperature_throttling_gpu_load_memory(tmp_path):
    _put(tmp_path, "sys/class/thermal/thermal_zone0/type", "CPU-therm")
    _put(tmp_path, "sys/class/thermal/thermal_zone0/temp", 45500)
    _put(tmp_path, "sys/class/thermal/thermal_zone0/trip_point_0_type", "passive")
    _put(tmp_path, "sys/class/thermal/thermal_zone0/trip_point_0_temp", 50000)
    _put(tmp_path, "sys/class/thermal/thermal_zone1/type", "PMIC-Die")
    _put(tmp_path, "sys/class/thermal/thermal_zone1/temp", -256000)  # disabled: ignored
    _put(tmp_path, "sys/devices/gpu.0/load", 523)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 4051060 kB\nMemAvailable: 2048000 kB\n")
    h = power.health(str(tmp_path))
    assert h == {"temp_c": 45.5, "temp_zone": "CPU-therm", "throttled": False, "gpu_load": 0.523,
                 "mem_available_mb": 2000}
    _put(tmp_path, "sys/class/thermal/thermal_zone0/temp", 51000)
    assert power.health(str(tmp_path))["throttled"] is True
    assert power.health(str(tmp_path / "nothing"))["throttled"] is None  # no trip points: unknown


def test_doctor_rows_name_every_source(tmp_path):
    jp5_tree(tmp_path)
    rows = power.sensors(str(tmp_path))
    usable = {name for name, ok, _ in rows if ok}
    assert "jetson-hwmon" in usable
    assert any(name == "temperature" and not ok for name, ok, _ in rows)


def test_doctor_says_which_sensors_this_user_can_read(tmp_path, monkeypatch):
    from fedseq.client.doctor import check_sensors

    jp4_tree(tmp_path)
    monkeypatch.setenv("FEDSEQ_SYSFS_ROOT", str(tmp_path))
    checks = check_sensors()
    assert checks[0][0] is True and "jetson-iio readable by" in checks[0][1]
    assert "POM_5V_IN" in checks[0][1] and "50 ms" in checks[0][1]
    monkeypatch.setenv("FEDSEQ_SYSFS_ROOT", str(tmp_path / "nothing"))
    first = check_sensors()[0]
    assert first[0] is None and "energy per round will be null" in first[1]
