"""Energy per client-round end to end: real daemons (--local-devices) read a fake JetPack 4 sysfs
tree (FEDSEQ_SYSFS_ROOT) through a real broker, and the coordinator records what they measured."""

from __future__ import annotations

import json

import pytest

from conftest import quick_config
from fedseq.server.ops.deployment import run_deployment
from fedseq.server.ops.simulation import run_simulation


def _tree(root):
    dev = root / "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    dev.mkdir(parents=True)
    for n, (rail, mw) in enumerate([("POM_5V_IN", 5000), ("POM_5V_GPU", 1000), ("POM_5V_CPU", 2000)]):
        (dev / f"rail_name_{n}").write_text(rail + "\n")
        (dev / f"in_power{n}_input").write_text(f"{mw}\n")
    zone = root / "sys/class/thermal/thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("CPU-therm\n")
    (zone / "temp").write_text("47000\n")
    (zone / "trip_point_0_type").write_text("passive\n")
    (zone / "trip_point_0_temp").write_text("97000\n")
    (root / "sys/devices/gpu.0").mkdir(parents=True)
    (root / "sys/devices/gpu.0/load").write_text("250\n")
    (root / "proc").mkdir()
    (root / "proc/meminfo").write_text("MemTotal: 4051060 kB\nMemAvailable: 1024000 kB\n")


@pytest.mark.slow("a simulated fleet's time and energy over many rounds: 10 s on 2 cores")
def test_devices_report_energy_and_health_per_client_round(data_root, tmp_path, monkeypatch,
                                                           one_thread):
    _tree(tmp_path / "fakesys")
    monkeypatch.setenv("FEDSEQ_SYSFS_ROOT", str(tmp_path / "fakesys"))
    cfg = quick_config(data_root, "algorithm.name=fedbabu", "rounds=2", "train.join_ratio=0.6",
                       "deploy.port=0")
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=lambda s: None)
    rows = [json.loads(x) for x in (tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()]
    tuned = rows.pop()  # FedBABU's fine-tuning: every client, its joules measured too
    assert tuned["phase"] == "finetune" and tuned["energy"]["unmeasured"] == []
    assert sorted(int(c) for c in tuned["energy"]["clients"]) == tuned["clients"]
    assert tuned["energy_j"] == pytest.approx(sum(tuned["energy"]["clients"].values()), abs=1e-2)
    assert tuned["energy_j"] > 0
    for r in rows:
        e = r["energy"]
        assert sorted(int(c) for c in e["clients"]) == r["reported"] and e["unmeasured"] == []
        assert r["energy_j"] == pytest.approx(sum(e["clients"].values()), abs=1e-2)
        assert set(e["devices"]) == set(r["reporters"].values())
        for d in e["devices"].values():
            assert d["source"] == "jetson-iio" and d["w"] == pytest.approx(5.0)  # POM_5V_IN only
            assert d["j"] > 0 and d["max_temp_c"] == 47.0 and d["throttled"] is False
            assert d["gpu_load"] == 0.25 and d["mem_available_mb"] == 1000
    # the report puts accuracy against energy and wall time, and energy in the table
    from fedseq.server.report import report

    table, figures = report([tmp_path / "dep"], tmp_path / "report")
    assert table[0]["energy kJ"] == pytest.approx(sum(r["energy_j"] for r in rows) / 1e3, abs=1e-3)
    assert table[0]["J/round"] > 0 and (tmp_path / "report" / "edge.png") in figures
    assert table[0]["finetune kJ"] == pytest.approx(tuned["energy_j"] / 1e3, abs=1e-3)
    # the simulation measures nothing and claims nothing
    sim = run_simulation(cfg, out=None)
    assert all("energy_j" not in r for r in sim.rows)
    assert sim.rows[-1]["personal_acc"] == tuned["personal_acc"]
    for k, v in sim.global_weights.items():  # and energy never touches the weights
        assert (dep.global_weights[k] == v).all(), k


@pytest.mark.slow("a simulated fleet's time and energy over many rounds: 4 s on 2 cores")
def test_without_a_power_source_energy_is_null_never_zero(data_root, tmp_path, monkeypatch,
                                                          one_thread):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("FEDSEQ_SYSFS_ROOT", str(tmp_path / "empty"))
    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=1", "deploy.port=0")
    run_deployment(cfg, tmp_path / "dep", local_devices=1, client_threads=1,
                   announce=lambda s: None)
    (row,) = [json.loads(x) for x in (tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()]
    assert row["energy_j"] is None and row["energy"]["clients"] == {}
    assert row["energy"]["unmeasured"] == row["reported"]
    (dev,) = row["energy"]["devices"].values()
    assert dev["j"] is None and dev["w"] is None and dev["source"] is None


def test_a_devices_energy_claims_are_bounded_by_power_and_time():
    """Hardening III, finding 16: what one device says its clients' work cost counts only while
    its claims in a step stay below MAX_DEVICE_W since the step went out; another device's
    claims have their own budget."""
    from fedseq.server.pools.mqtt.collect import MAX_DEVICE_W, plausible_joules

    claimed: dict[str, float] = {}
    assert plausible_joules(claimed, "dev01", 0.5 * MAX_DEVICE_W, 1.0)
    assert not plausible_joules(claimed, "dev01", 0.6 * MAX_DEVICE_W, 1.0)  # 1.1 kW for 1 s
    assert plausible_joules(claimed, "dev02", 0.9 * MAX_DEVICE_W, 1.0)
    assert plausible_joules(claimed, "dev01", 1.4 * MAX_DEVICE_W, 2.0)  # 1.9 kJ in 2 s
    assert not plausible_joules(claimed, "dev03", 1e7, 60.0)  # the old bound, per client-round
