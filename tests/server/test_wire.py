"""Wire codecs in whole runs: the simulation, --workers and a Mosquitto deployment with real
daemons give bitwise the same run under a codec; top-k's residual survives a checkpoint and a
device restart; the bytes are the codec's (the codecs themselves: tests/common/test_codecs.py)."""

from dataclasses import replace

import pytest
import torch

from conftest import coordinator_run, device_process, quick_config
from fedseq.client.state import StateStore
from fedseq.common.execution import ClientExecutor, InMemory
from fedseq.common.models import get_blocks
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.pools.processes import stop_children
from fedseq.server.rounds.checkpoint import load_checkpoint

OVER = ("rounds=3", "train.join_ratio=0.6")


def _same(a, b):
    assert [r["global_acc"] for r in a.rows] == [r["global_acc"] for r in b.rows]
    assert [r["personal_acc"] for r in a.rows] == [r["personal_acc"] for r in b.rows]
    assert [r.get("bytes_up") for r in a.rows] == [r.get("bytes_up") for r in b.rows]
    assert [r.get("bytes_down") for r in a.rows] == [r.get("bytes_down") for r in b.rows]
    assert all(torch.equal(a.global_weights[k], v) for k, v in b.global_weights.items())


@pytest.mark.slow("codecs over whole runs: 9 s on 2 cores")
def test_each_codec_cuts_the_bytes_it_should_and_still_learns(data_root, one_thread):
    plain = run_simulation(quick_config(data_root, "algorithm.name=fedavg", *OVER), None)
    up, down = plain.rows[0]["bytes_up"], plain.rows[0]["bytes_down"]
    for wire, up_ratio, down_ratio in ((("wire.up=fp16", "wire.down=bf16"), 0.5, 0.5),
                                       (("wire.up=int8", "wire.down=int8"), 0.26, 0.26),
                                       (("wire.up=topk", "wire.topk=0.01"), 0.021, 1.0)):
        run = run_simulation(quick_config(data_root, "algorithm.name=fedavg", *OVER, *wire), None)
        row = run.rows[0]
        assert row["bytes_up"] / up == pytest.approx(up_ratio, abs=0.01), (wire, row["bytes_up"])
        assert row["bytes_down"] / down == pytest.approx(down_ratio, abs=0.01), wire
        assert run.rows[-1]["global_acc"] > 0.25, wire  # chance is 0.10
        assert not any(r["rejected"] for r in run.rows), wire


@pytest.mark.slow("codecs over whole runs: 10 s on 2 cores")
@pytest.mark.parametrize("name,wire", [
    ("fedseq-anti", ("wire.up=int8", "wire.down=fp16")),
    ("fedper", ("wire.up=topk", "wire.topk=0.05", "wire.down=int8")),
    ("fedavg", ("wire.up=int8", "wire.int8_rounding=stochastic", "wire.int8_scale=tensor")),
])
def test_workers_give_bitwise_the_in_process_run_under_a_codec(data_root, one_thread, name, wire):
    cfg = quick_config(data_root, f"algorithm.name={name}", *OVER, *wire)
    _same(run_simulation(cfg, None, workers=2), run_simulation(cfg, None))


@pytest.mark.slow("codecs over whole runs: 4 s on 2 cores")
def test_a_topk_run_resumes_bitwise_with_its_residuals(data_root, tmp_path, one_thread):
    cfg = quick_config(data_root, "algorithm.name=fedavg", *OVER, "wire.up=topk", "wire.topk=0.02")
    whole = run_simulation(cfg, None)
    with pytest.raises(KeyboardInterrupt):
        run_simulation(cfg, tmp_path / "run", pause_after=1)
    held = load_checkpoint(tmp_path / "run").pool.personal
    trained = sorted(c for c, w in held.items() if w)
    assert trained == whole.records[0].clients
    assert all("~ef" in k for c in trained for k in held[c])  # the residuals, nothing else
    resumed = run_simulation(cfg, tmp_path / "run", mode="resume")
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in whole.global_weights.items())
    assert [r["global_acc"] for r in resumed.rows] == [r["global_acc"] for r in whole.rows[1:]]


class _OnDisk:
    """A device's personal state (client/executor.py's OnDisk) on a StateStore."""

    def __init__(self, store):
        self.store = store

    def load(self, client, names, before=None):
        return self.store.load("run", client, before) or {}

    def save(self, client, blocks, round):
        if blocks:
            self.store.save("run", client, blocks, round)


def test_the_residual_survives_a_device_restart(data_root, tmp_path, one_thread):
    """Two rounds of one client under top-k: kept in memory, and kept on disk with a new store
    (a restarted daemon) between them, give bitwise the same updates."""
    from fedseq.server.rounds.experiment import load_experiment

    cfg = quick_config(data_root, "algorithm.name=fedavg", "wire.up=topk", "wire.topk=0.02")
    exp = load_experiment(cfg)
    plan = replace(exp.algorithm.plan(0), codec=cfg.wire.codec("up").spec)
    shared = get_blocks(exp.model, exp.model.spec.blocks)
    memory = ClientExecutor(exp.model, exp.data, 0, 128, InMemory({2: {}}), "fedavg")
    want = [memory.train(2, t, plan, shared).deltas for t in (0, 1)]
    got = []
    for t in (0, 1):
        disk = ClientExecutor(exp.model, exp.data, 0, 128, _OnDisk(StateStore(tmp_path)), "fedavg")
        got.append(disk.train(2, t, plan, shared).deltas)
    assert StateStore(tmp_path).load("run", 2) is not None
    for w, g in zip(want, got, strict=True):
        assert set(w) == set(g) and all(torch.equal(w[k], g[k]) for k in w)
    assert not all(torch.equal(want[0][k], want[1][k]) for k in want[0])  # round 1 sent more


@pytest.mark.slow("codecs over whole runs: 11 s on 2 cores")
def test_a_compressed_fedseq_run_on_mosquitto_is_the_simulation_bitwise(
        data_root, tmp_path, mosquitto, one_thread):
    """FedSeq-Anti with int8 updates and fp16 global blocks, two real daemons behind the project's
    broker.conf and ACL: the devices decode, train, encode; the coordinator checks and decodes."""
    port, home, _ = mosquitto
    devices = [device_process(n, port, home, data_root) for n in ("local01", "local02")]
    over = ("algorithm.name=fedseq-anti", *OVER, "deploy.min_devices=2", "wire.up=int8",
            "wire.down=fp16", "algorithm.finetune_epochs=1")
    try:
        cfg, dep = coordinator_run(data_root, tmp_path / "run", mosquitto, *over)
    finally:
        stop_children(devices)
    sim = run_simulation(cfg, None)
    _same(dep, sim)
    assert all(r["reported"] == r["clients"] for r in dep.rows if r["phase"] == "train")
    plain = run_simulation(quick_config(data_root, *over[:-3], "algorithm.finetune_epochs=1"),
                           None)
    assert dep.rows[0]["bytes_up"] < 0.3 * plain.rows[0]["bytes_up"]
    assert dep.rows[0]["wire_bytes_in"] < 0.3 * plain.rows[0]["bytes_up"] + 200_000


@pytest.mark.slow("codecs over whole runs: 6 s on 2 cores")
def test_personal_blocks_stay_float32_under_a_downlink_codec(data_root, tmp_path, one_thread):
    """FedPer's heads are each client's own: a device starts a client that never trained from
    the published initial head, which must be the float32 one the simulation starts from (only
    the shared blocks go out in wire.down), or its scores would differ."""
    from fedseq.server.ops.deployment import run_deployment

    cfg = quick_config(data_root, "algorithm.name=fedper", "rounds=2", "train.join_ratio=0.4",
                       "wire.down=int8", "wire.up=fp16", "deploy.port=0")
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=lambda s: None)
    sim = run_simulation(cfg, None)
    assert len(set(range(5)) - {c for r in sim.rows for c in r["clients"]}) > 0  # someone never trained
    _same(dep, sim)
    assert dep.final.per_client == sim.final.per_client
