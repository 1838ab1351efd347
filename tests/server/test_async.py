"""Simulated time ([fleet]), over-selection and buffered asynchronous aggregation (FedBuff)."""

import pytest
import torch

from conftest import quick_config, same_run, synthetic_data
from fedseq.common.algorithms import make_algorithm, model_layout
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.config import FleetConfig, load_config
from fedseq.common.errors import ConfigError
from fedseq.common.models import block_of, build_model
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.pools.inprocess import InProcessPool
from fedseq.server.rounds.buffered import staleness_discount
from fedseq.server.rounds.coordinator import Coordinator, RunPaused
from fedseq.server.rounds.pool_api import TrainRound
from fedseq.server.rounds.virtual_fleet import (
    VirtualFleet,
    energy_j,
    measured_fleet,
    parse_device,
    sync_round,
)

MIXED = "fleet.devices=[{profile='nano',count=2},{profile='orin-nano',count=2}]"


# -- the model of time -------------------------------------------------------------------------
def test_staleness_discount_is_polynomial():
    assert staleness_discount(0, 0.5) == 1.0
    assert staleness_discount(3, 0.5) == 0.5
    assert staleness_discount(1, 1.0) == 0.5
    assert staleness_discount(7, 0.0) == 1.0


def test_a_synchronous_round_on_a_fleet_is_hand_computable():
    """1 GFLOP/s devices on 8 Mbit/s links (1 MB/s), no delay, no jitter: a device receives the
    round's blocks once, trains its clients one after the other, sends each update after it."""
    cfg = load_config(None, ["data.num_clients=4", "fleet.jitter=0",
                             "fleet.devices=[{profile='custom:gflops=1,train_w=6,idle_w=1',"
                             "count=2,link='custom:down=8,up=8'}]"])
    fleet = VirtualFleet(cfg)
    assert [fleet.device_of[c].name for c in range(4)] == ["custom-00", "custom-01"] * 2
    timing = sync_round(fleet, [0, 1, 2], {0: 2e9, 1: 1e9, 2: 3e9},
                        {0: 10**6, 1: 2 * 10**6, 2: 3 * 10**6}, 10**6, round=0)
    # device 00 holds clients 0 and 2: blocks 3 MB (the most either needs) = 3 s
    assert (timing[0].start, timing[0].train_s, timing[0].arrival) == (3.0, 2.0, 6.0)
    assert (timing[2].start, timing[2].train_s, timing[2].arrival) == (5.0, 3.0, 9.0)
    assert (timing[1].start, timing[1].train_s, timing[1].arrival) == (2.0, 1.0, 4.0)
    # both devices idle at 1 W for 9 s, and 5 W more while training 6 s
    assert energy_j(fleet, 9.0, {c: x.train_s for c, x in timing.items()}) == 2 * 9 + 5 * 6


def test_bad_fleet_profiles_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="unknown device profile 'jetson'"):
        parse_device("jetson")
    with pytest.raises(ConfigError, match="needs gflops > 0"):
        parse_device("custom:train_w=5")
    cfg = load_config(None, ["fleet.devices=[{profile='nano',link='wifi-bad'}]"])
    with pytest.raises(ConfigError, match="fleet.devices: link 'wifi-bad': unknown profile"):
        VirtualFleet(cfg)


def test_async_and_fleet_keys_stay_on_the_coordinator():
    cfg = load_config(None, ["train.mode='async'", "train.concurrency=4", MIXED])
    sent = cfg.for_devices()
    assert "fleet" not in sent and "mode" not in sent["train"] and "buffer" not in sent["train"]
    assert cfg.async_shape() == (4, 2)
    with pytest.raises(ConfigError, match="train.concurrency=40 is more than the 30 clients"):
        load_config(None, ["train.mode='async'", "train.concurrency=40"])
    with pytest.raises(ConfigError, match="over_select is for train.mode"):
        load_config(None, ["train.mode='async'", "train.over_select=1.5"])


# -- the synchronous loop on a fleet ---------------------------------------------------------
@pytest.mark.slow("buffered asynchronous training with device daemons or many simulated rounds: "
                  "7 s on 2 cores")
def test_a_fleet_only_adds_time_and_energy_to_a_synchronous_run(data_root, one_thread):
    """Without over-selection the model is bitwise the run without a fleet; every row carries
    its virtual seconds, the clock and the modelled joules, the clock never goes back."""
    plain = run_simulation(quick_config(data_root, "train.join_ratio=0.6"), None)
    timed = run_simulation(quick_config(data_root, "train.join_ratio=0.6", MIXED), None)
    assert all(torch.equal(plain.global_weights[k], v) for k, v in timed.global_weights.items())
    rows = [r for r in timed.records if r.phase == "train"]
    assert all(r.virtual_s > 0 and r.modelled_energy_j > 0 for r in rows)
    clock = [r.virtual_time_s for r in rows]
    assert clock == sorted(clock) and clock[-1] == pytest.approx(sum(r.virtual_s for r in rows),
                                                                  abs=0.01)


def test_over_selection_counts_the_first_to_arrive(data_root, one_thread):
    cfg = quick_config(data_root, "data.num_clients=8", "train.join_ratio=0.25",
                       "train.over_select=2", MIXED)
    rows = [r for r in run_simulation(cfg, None).records if r.phase == "train"]
    for r in rows:
        assert len(r.clients) == 4 and len(r.reported) == 2 and len(r.cancelled) == 2
        assert set(r.reported) | set(r.cancelled) == set(r.clients)


@pytest.mark.slow("buffered asynchronous training with device daemons or many simulated rounds: "
                  "9 s on 2 cores")
@pytest.mark.parametrize("over", [("train.over_select=2",),
                                  ("train.mode='async'", "train.concurrency=3"),
                                  ("train.mode='async'", "train.concurrency=4", "train.buffer=3",
                                   "algorithm.name=fedseq-anti")])
def test_simulated_time_is_bitwise_the_same_with_workers(data_root, one_thread, over):
    cfg = quick_config(data_root, "data.num_clients=8", "train.join_ratio=0.25", "rounds=4",
                       "train.threads=1", MIXED, *over)
    same_run(run_simulation(cfg, None, workers=2), run_simulation(cfg, None))


# -- the asynchronous driver, by hand ----------------------------------------------------------
class ConstantPool(InProcessPool):
    """Client c's update is 0.01 x (c + 1) in every uploaded element, over its training rows."""

    def train(self, round, clients, plan, weights, check, enough=None):
        def updates():
            for c in clients:
                deltas = {k: torch.full_like(v, 0.01 * (c + 1)) for k, v in weights.items()
                          if block_of(k) in plan.upload}
                update = ClientUpdate(c, round, deltas, len(self.data.clients[c].train))
                if check(update) is None:
                    yield update
            from fedseq.server.rounds.pool_api import RoundOutcome
            return RoundOutcome()

        return TrainRound(updates())


def _driver(*over):
    cfg = load_config(None, ["algorithm.name=fedavg", "rounds=6", "train.local_epochs=1",
                             "train.batch_size=8", "data.num_clients=3", "train.mode='async'",
                             "train.concurrency=3", "train.buffer=1",
                             "fleet.devices=[{profile='nano'},{profile='orin-nano',count=2}]",
                             *over])
    data = synthetic_data()
    model = build_model("cnn", (1, 28, 28), 4, generator_seed=1, **model_layout("fedavg"))
    alg = make_algorithm(cfg, model.spec)
    return Coordinator(cfg, alg, model, data, ConstantPool(data, model, (), cfg.seed,
                                                        algorithm="fedavg"))


def test_a_server_step_folds_staleness_discounted_deltas():
    """x_{t+1} = x_t + sum_i n_i s(tau_i) delta_i / sum_i n_i, s(tau) = (1 + tau)^-0.5."""
    coord = _driver()
    coord.book.broadcast(initial=True)
    seen, stalest = set(), 0
    for t in range(6):
        before = {k: v.clone() for k, v in coord.global_weights.items()}
        rec = coord.run_round(t)
        assert all(f.refused is None for f in rec.folds)
        sizes = {f.client: len(coord.data.clients[f.client].train) for f in rec.folds}
        step = sum(sizes[f.client] * staleness_discount(f.staleness, 0.5) * 0.01 * (f.client + 1)
                   for f in rec.folds) / sum(sizes.values())
        for k, v in coord.global_weights.items():
            torch.testing.assert_close(v - before[k], torch.full_like(v, step), rtol=0, atol=1e-6)
        for f in rec.folds:
            assert f.staleness == t - f.version and 0 <= f.version <= t
            assert (f.client, f.version) not in seen  # a client trains once per model version
            seen.add((f.client, f.version))
            stalest = max(stalest, f.staleness)
        assert rec.virtual_time_s >= (rec.virtual_time_s - rec.virtual_s) >= 0
    assert stalest >= 1  # stale updates did arrive, and were discounted


def test_an_update_staler_than_the_bound_is_refused_and_the_step_goes_on():
    coord = _driver("train.max_staleness=0")
    coord.book.broadcast(initial=True)
    rows = [coord.run_round(t) for t in range(4)]
    assert all(f.staleness == 0 for r in rows for f in r.folds if f.refused is None)
    assert all(len(r.reported) == 1 for r in rows)
    assert [f.refused for r in rows for f in r.folds if f.staleness > 0] == \
        [c for r in rows for c in r.refusals.values()]
    codes = [c for r in rows for c in r.refusals.values()]
    assert "too-stale" in codes and set(codes) == {"too-stale"}
    assert any("train.max_staleness=0" in why for r in rows for why in r.rejected.values())


def test_async_needs_a_fleet_and_refuses_what_cannot_run_asynchronously(data_root):
    with pytest.raises(ConfigError, match="needs a \\[fleet\\]"):
        run_simulation(quick_config(data_root, "train.mode='async'"), None)
    with pytest.raises(ConfigError, match="scaffold cannot run with train.mode"):
        run_simulation(quick_config(data_root, "train.mode='async'", "algorithm.name=scaffold",
                                    MIXED), None)


@pytest.mark.slow("buffered asynchronous training with device daemons or many simulated rounds: "
                  "6 s on 2 cores")
def test_over_selection_on_a_real_fleet_counts_the_first_to_arrive(data_root, tmp_path,
                                                                    one_thread):
    """Two daemons, 4 of 6 clients selected, the first 2 valid updates count; the pool stops
    waiting for the others (cancelled: their updates come late and are dropped). A [fleet] is
    the simulation's model of time: a deployment says it ignores it."""
    from fedseq.server.ops.deployment import run_deployment

    said: list[str] = []
    cfg = quick_config(data_root, "data.num_clients=6", "train.join_ratio=0.34",
                       "train.over_select=2", "rounds=2", "deploy.port=0", MIXED)
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=said.append)
    assert any("[fleet] models a simulation's time" in m for m in said)
    rows = [r for r in dep.records if r.phase == "train"]
    for r in rows:
        assert len(r.clients) == 4 and len(r.reported) == 2 and r.virtual_s is None
        assert r.cancelled == sorted(set(r.clients) - set(r.reported))
        assert r.missed_deadline == [] and r.status == "ok"
    with pytest.raises(ConfigError, match="over_select in fedseq-sim needs a \\[fleet\\]"):
        run_simulation(quick_config(data_root, "train.over_select=2"), None)


@pytest.mark.slow("buffered asynchronous training with device daemons or many simulated rounds: "
                  "14 s on 2 cores")
def test_an_asynchronous_deployment_is_replayed_bitwise(data_root, tmp_path, one_thread):
    """Two real daemons on amqtt, 4 clients in flight, a step every 2 arrivals: each update is
    checked against the version its device trained on (the newest it held) and folded in its
    arrival order; fedseq-sim --replay of the run directory gives its global model bitwise."""
    from fedseq.server.ops.deployment import run_deployment
    from fedseq.server.ops.simulation import replay

    cfg = quick_config(data_root, "data.num_clients=6", "rounds=4", "train.mode='async'",
                       "train.concurrency=4", "train.buffer=2", "train.threads=1",
                       "deploy.port=0")
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=lambda m: None)
    rows = [r for r in dep.records if r.phase == "train"]
    assert [r.round for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r.status == "ok" and len(r.reported) == 2 and r.virtual_s is None
        assert all(f.refused is None and 0 <= f.staleness <= r.round for f in r.folds)
        assert [f.client for f in r.folds] == r.reported
    assert any(f.staleness > 0 for r in rows for f in r.folds)  # some trained on older models
    again, same, verdict = replay(tmp_path / "dep", tmp_path / "replay")
    assert same, verdict
    assert all(torch.equal(dep.global_weights[k], v) for k, v in again.global_weights.items())
    # the devices' measured paces make a fleet a simulation can run with (fedseq fleet RUN_DIR)
    assert all(sorted(r.paces) == sorted(r.reported) and set(r.reporters) == set(r.reported)
               for r in rows)
    measured = measured_fleet(rows, 5.0, 1.0, "wifi-poor")
    import tomllib

    groups = tomllib.loads(measured)["fleet"]["devices"]
    assert [g["link"] for g in groups] == ["wifi-poor"] * 2 and "# local02" in measured
    fleet = FleetConfig.model_validate({"devices": groups})
    sim = run_simulation(cfg.model_copy(update={"fleet": fleet}), None)
    assert all(r.virtual_s > 0 for r in sim.records if r.phase == "train")
    with pytest.raises(ConfigError, match="record no measured paces"):
        measured_fleet(again.records, 5.0, 1.0, "wifi-good")


@pytest.mark.slow("buffered asynchronous training with device daemons or many simulated rounds: "
                  "4 s on 2 cores")
def test_an_async_run_resumes_after_its_last_step(data_root, tmp_path, one_thread):
    """The clients in flight at the checkpoint are lost and re-selected; the clock and the
    steps go on; a synchronous run's checkpoint is not resumed asynchronously."""
    over = ("data.num_clients=8", "rounds=5", "train.mode='async'", "train.concurrency=3", MIXED)
    cfg = quick_config(data_root, *over)
    with pytest.raises(RunPaused):
        run_simulation(cfg, tmp_path / "run", pause_after=2)
    done = run_simulation(cfg, tmp_path / "run", mode="resume")
    rows = [r for r in done.records if r.phase == "train"]
    assert [r.round for r in rows] == [2, 3, 4]
    import json
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    clock = [r["virtual_time_s"] for r in logged if r["phase"] == "train"]
    assert len(clock) == 5 and clock == sorted(clock)
    sync = quick_config(data_root, "data.num_clients=8", "rounds=5")
    with pytest.raises(RunPaused):
        run_simulation(sync, tmp_path / "sync", pause_after=1)
    with pytest.raises(ConfigError, match="synchronous run's"):
        run_simulation(cfg, tmp_path / "sync", mode="resume")


# -- replay ------------------------------------------------------------------------------------
@pytest.mark.slow("buffered asynchronous training with device daemons or many simulated rounds: "
                  "5 s on 2 cores")
@pytest.mark.parametrize("over", [("algorithm.name=fedavg",),
                                  ("algorithm.name=fedper", "train.max_staleness=0")])
def test_replay_gives_the_asynchronous_run_again_bitwise(data_root, tmp_path, one_thread, over):
    """The rows' arrival order alone (no fleet) re-executes the run: the same global model and
    accuracies; refused arrivals train again too (FedPer's heads move on their devices)."""
    from fedseq.server.ops.simulation import replay

    cfg = quick_config(data_root, "data.num_clients=8", "rounds=4", "train.mode='async'",
                       "train.concurrency=4", "train.threads=1", MIXED, *over)
    original = run_simulation(cfg, tmp_path / "run")
    if "train.max_staleness=0" in over:
        assert any(f.refused for r in original.records for f in r.folds)
    again, same, verdict = replay(tmp_path / "run", tmp_path / "replay")
    assert same and verdict == "the replayed global model is bitwise the run's"
    assert all(torch.equal(original.global_weights[k], v) for k, v in again.global_weights.items())
    assert [r.accuracies() for r in again.records] == [r.accuracies() for r in original.records]
    assert again.final.per_client == original.final.per_client
    assert [r.folds for r in again.records] == [r.folds for r in original.records]


def test_only_an_asynchronous_run_is_replayed(data_root, tmp_path, one_thread):
    from fedseq.server.ops.simulation import replay

    run_simulation(quick_config(data_root, "rounds=1"), tmp_path / "sync")
    with pytest.raises(ConfigError, match="only an asynchronous run is replayed"):
        replay(tmp_path / "sync", tmp_path / "again")
