"""Round loop on synthetic data: aggregation, personal state, byte accounting, bad updates."""

import json
from dataclasses import replace

import pytest
import torch

from conftest import synthetic_data
from fedseq.common.algorithms import make_algorithm, model_layout
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.config import load_config
from fedseq.common.models import build_model, get_blocks
from fedseq.common.protocol.tensors import decode_tensors, frame_size
from fedseq.server.pools.inprocess import InProcessPool
from fedseq.server.rounds.coordinator import Coordinator, select_clients
from fedseq.server.rounds.pool_api import RoundOutcome, TrainRound
from fedseq.server.rounds.rundir import RunDir


def _coord(name, *over, pool_cls=InProcessPool, run_dir=None):
    cfg = load_config(None, [f"algorithm.name={name}", "rounds=4", "train.local_epochs=1",
                             "train.batch_size=8", "data.num_clients=3", "train.join_ratio=0.67",
                             "algorithm.unfreeze_rounds=[0,1,2]", "algorithm.finetune_epochs=1", *over])
    data = synthetic_data()
    model = build_model("cnn", (1, 28, 28), 4, generator_seed=1, **model_layout(name))
    alg = make_algorithm(cfg, model.spec)
    pool = pool_cls(data, model, alg.personal_blocks(), cfg.seed, algorithm=name)
    return Coordinator(cfg, alg, model, data, pool, run_dir), model


def test_selection_is_pure_function_of_seed_and_round():
    a = [select_clients(0, t, 30, 6) for t in range(5)]
    assert a == [select_clients(0, t, 30, 6) for t in range(5)]
    assert all(len(s) == 6 == len(set(s)) for s in a) and len({tuple(s) for s in a}) > 1


@pytest.mark.parametrize("name,over", [("fedper", ()), ("fedper", ("algorithm.fedper.personal_layers=3",)),
                                       ("fedrep", ()), ("fedrod", ()), ("fedreg", ()),
                                       ("lg-fedavg", ())])
def test_personal_blocks_never_aggregated(name, over):
    coord, model = _coord(name, *over)
    personal = coord.alg.personal_blocks()
    if over:  # FedPer's K_P = 3: the head and the last two base blocks (FedPer section 4.3)
        assert personal == ("conv2", "fc1", "fc2") and coord.alg.shared_blocks() == ("conv1",)
    init = get_blocks(model, personal)
    coord.run()
    assert all(torch.equal(coord.global_weights[k], v) for k, v in init.items())
    # ... while the clients' own copies did train
    trained = [c for c, w in coord.pool.personal.items()
               if any(not torch.equal(w[k], init[k]) for k in init)]
    assert trained


def test_fedseq_vanilla_sends_only_what_changed():
    coord, model = _coord("fedseq-vanilla")
    rows = coord.run().rows
    conv1 = frame_size(get_blocks(model, ["conv1"]))
    full = sum(frame_size(get_blocks(model, [b])) for b in model.spec.blocks)
    assert rows[0]["bytes_down"] == 2 * full  # two clients fetch the initial model once
    assert rows[0]["uploaded_blocks"] == ["conv1"]
    assert rows[0]["bytes_up"] == 2 * conv1  # two clients, conv1 deltas only
    # round 1: only conv1 changed; a client of round 0 fetches just conv1, a new one everything
    again = len(set(rows[0]["clients"]) & set(rows[1]["clients"]))
    assert rows[1]["bytes_down"] == again * conv1 + (2 - again) * full
    assert rows[1]["trainable_params"] == 800 + 32 + 51200 + 64


def test_fedavg_bytes_are_full_model():
    coord, model = _coord("fedavg")
    rows = coord.run().rows
    blocks = sum(frame_size(get_blocks(model, [b])) for b in model.spec.blocks)
    update = frame_size(get_blocks(model, model.spec.blocks))  # one frame, as a device sends it
    assert rows[0]["bytes_up"] == 2 * update
    assert rows[1]["bytes_down"] == 2 * blocks  # everything changed in round 0, sent per block
    assert "wire_bytes_out" not in rows[0]  # nothing crossed a wire


@pytest.mark.parametrize("name", ["local", "fedper"])
def test_personal_blocks_count_once_at_a_clients_first_round(name):
    """A client starts its personal blocks from the initial model, which it downloads once (for
    `local` that is the whole model, though nothing is ever aggregated)."""
    coord, model = _coord(name)
    rows = coord.run().rows
    personal = coord.alg.personal_blocks()
    shared = [b for b in model.spec.blocks if b not in personal]
    first = sum(frame_size(get_blocks(model, [b])) for b in model.spec.blocks)
    assert rows[0]["bytes_down"] == 2 * first  # two new clients: every block, personal ones too
    new = len(set(rows[1]["clients"]) - set(rows[0]["clients"]))
    again = 2 - new
    # a returning client fetches only the shared blocks that changed, never its personal ones
    changed = sum(frame_size(get_blocks(model, [b])) for b in shared)
    assert rows[1]["bytes_down"] == new * first + again * changed


class PoisonPool(InProcessPool):
    """Client 0 sends NaNs, a wrong shape or a personal block; the round must survive it."""

    mode = "nan"

    def train(self, round, clients, plan, weights, check, enough=None):
        inner = super().train(round, clients, plan, weights, lambda u: None)

        def poisoned():
            for u in inner:
                if u.client == clients[0]:
                    k = next(iter(u.deltas))
                    if self.mode == "nan":
                        u.deltas[k] = torch.full_like(u.deltas[k], float("nan"))
                    elif self.mode == "shape":
                        u.deltas[k] = torch.zeros(3)
                    else:
                        u.deltas["fc2_p.weight"] = torch.zeros(4, 512)
                if check(u) is None:
                    yield u
            return inner.outcome

        return TrainRound(poisoned())


@pytest.mark.parametrize("mode", ["nan", "shape", "personal"])
def test_bad_update_rejected_model_stays_finite(mode):
    PoisonPool.mode = mode
    coord, _ = _coord("fedrod", pool_cls=PoisonPool)
    row = coord.run_round(0).to_json()  # the row as metrics.jsonl holds it
    assert len(row["rejected"]) == 1 and [int(c) for c in row["rejected"]] == row["failed"]
    assert len(row["reported"]) == 1
    assert all(torch.isfinite(v).all() for v in coord.global_weights.values())


def test_run_dir_outputs(tmp_path):
    cfg_over = []
    coord, model = _coord("fedseq-anti", *cfg_over)
    rd = RunDir(tmp_path, coord.cfg)
    coord.run_dir = rd
    result = coord.run()
    rd.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["train"] * 4 + ["finetune"]
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    for key in ("round", "phase", "global_acc", "personal_acc", "clients", "bytes_down", "bytes_up",
                "trainable_params", "train_flops", "seconds"):
        assert key in rows[0]
    assert rows[-1]["personal_acc"] == pytest.approx(result.final.personal_acc)
    assert (tmp_path / "config.toml").read_text().count("fedseq-anti") == 1
    lines = (tmp_path / "clients.csv").read_text().splitlines()
    assert lines[0].startswith("client,train_samples") and len(lines) == 4
    saved = decode_tensors((tmp_path / "model.safetensors").read_bytes())
    assert all(torch.equal(saved[k], coord.global_weights[k]) for k in saved)


def test_late_update_ignored():
    class LatePool(InProcessPool):
        def train(self, round, clients, plan, weights, check, enough=None):
            inner = super().train(round, clients, plan, weights, check, enough)

            def with_a_late_one():
                late = ClientUpdate(clients[0], round - 1, {}, 10)
                if check(late) is None:
                    yield late
                yield from inner
                return inner.outcome

            return TrainRound(with_a_late_one())

    coord, _ = _coord("fedavg", pool_cls=LatePool)
    row = coord.run_round(1).to_json()  # the row as metrics.jsonl holds it
    assert len(row["reported"]) == 2


@pytest.mark.parametrize("name", ["fedavg", "fedper"])
def test_local_acc_scores_each_clients_last_locally_trained_model(name):
    """FedReG's testbed definition, recomputed by hand: every client's most recent locally
    trained model on its own test rows; a client not trained yet holds the global model."""
    from fedseq.common.evaluation import evaluate
    from fedseq.common.training import run_client_round

    coord, model = _coord(name, "rounds=3", "train.join_ratio=0.34")
    data, alg = coord.data, coord.alg
    ref_model = build_model("cnn", (1, 28, 28), 4, False, generator_seed=1)
    personal = {c.client: get_blocks(ref_model, alg.personal_blocks()) for c in data.clients}
    last: dict[int, tuple[int, int]] = {}
    for t in range(3):
        global_w = dict(coord.global_weights)
        row = coord.run_round(t).to_json()  # the row as metrics.jsonl holds it
        fresh = {}
        for c in row["clients"]:
            _, personal[c] = run_client_round(ref_model, {**global_w, **personal[c]}, alg.plan(t),
                                              data, data.clients[c], 0, t)
            test = data.clients[c].test
            with torch.no_grad():
                pred = ref_model.logits(ref_model.features(data.images(test)), alg.eval_heads()).argmax(1)
            fresh[c] = (int((pred == data.y[test]).sum()), len(test))
        last.update(fresh)
        assert row["round_local_acc"] == pytest.approx(
            sum(a for a, _ in fresh.values()) / sum(b for _, b in fresh.values()))
        rep = evaluate(ref_model, data, coord.global_weights, personal, alg.eval_heads())
        assert row["personal_acc"] == pytest.approx(rep.personal_acc)
        scores = [last.get(c, r) for c, r in rep.per_client.items()]
        assert row["local_acc"] == pytest.approx(sum(a for a, _ in scores) / sum(b for _, b in scores))
        if t == 0:
            assert len(last) < len(data.clients)  # some clients still hold the global model


def test_updates_streamed_before_a_quorum_failure_are_discarded():
    """deploy.min_updates is the round loop's rule, the same in simulation: two valid updates
    streamed in and were folded in, then the round missed its quorum of three."""
    coord, model = _coord("fedavg", "deploy.min_updates=3")
    before = {k: v.clone() for k, v in coord.global_weights.items()}
    row = coord.run_round(0).to_json()  # the row as metrics.jsonl holds it
    assert row["status"] == "failed" and row["reported"] == [] and row["round_local_acc"] is None
    assert row["quorum_failed"] == "2 valid updates < deploy.min_updates=3"
    assert row["received"] == row["clients"]
    assert all(torch.equal(coord.global_weights[k], v) for k, v in before.items())
    assert row["train_flops"] > 0  # the clients did the work all the same
    assert coord.book.version == dict.fromkeys(model.spec.blocks, 0)


def test_a_non_finite_aggregate_refuses_the_round_and_keeps_the_model(monkeypatch):
    """The aggregate's own safety net (behind the contract's finiteness check): a round whose
    sum is not finite fails with its reason; the global model is untouched."""
    from fedseq.common.algorithms import aggregate

    coord, _ = _coord("fedavg")
    before = {k: v.clone() for k, v in coord.global_weights.items()}
    real_add = aggregate.WeightedDeltaSum.add

    def add_inf(self, deltas, weight_of, client, device=None):
        real_add(self, deltas, weight_of, client, device)
        self.sums[next(iter(self.sums))].view(-1)[0] = float("inf")

    monkeypatch.setattr(aggregate.WeightedDeltaSum, "add", add_inf)
    row = coord.run_round(0).to_json()  # the row as metrics.jsonl holds it
    assert row["status"] == "failed" and "NaN or Inf" in row["quorum_failed"]
    assert all(torch.equal(coord.global_weights[k], v) for k, v in before.items())


def test_a_stop_between_checkpoint_and_row_is_healed_on_resume(tmp_path, monkeypatch):
    """The checkpoint is written before the round's row; a stop in between leaves a checkpoint
    whose row is missing from metrics.jsonl (here: torn), and the resumed run writes it from the
    checkpoint."""
    from fedseq.server.rounds.checkpoint import load_checkpoint

    full, _ = _coord("fedper")
    expected = full.run().global_weights

    coord, _ = _coord("fedper")
    coord.run_dir = RunDir(tmp_path, coord.cfg)
    real = RunDir.log_round

    def stop_at_round_1(self, row):
        if row.round == 1:
            raise KeyboardInterrupt
        real(self, row)

    monkeypatch.setattr(RunDir, "log_round", stop_at_round_1)
    with pytest.raises(KeyboardInterrupt):
        coord.run()
    coord.run_dir.close()
    monkeypatch.setattr(RunDir, "log_round", real)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.next_round == 2  # round 1 was checkpointed, its row never written
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"round": 1, "phase": "tr')  # and a torn line, as a crash mid-write leaves
    resumed, _ = _coord("fedper")
    resumed.run_dir = RunDir(tmp_path, resumed.cfg, "resume", ckpt.next_round)
    result = resumed.run(ckpt)
    resumed.run_dir.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if r["phase"] == "train"] == [0, 1, 2, 3]
    assert all(torch.equal(result.global_weights[k], v) for k, v in expected.items())


def test_diverged_training_is_refused_and_the_client_keeps_its_blocks():
    coord, model = _coord("fedper", "train.lr=1e4", "rounds=2")
    init = {k: v.clone() for k, v in coord.global_weights.items()}
    personal0 = {c: {k: v.clone() for k, v in w.items()} for c, w in coord.pool.personal.items()}
    rows = coord.run().rows
    for row in rows:
        assert row["rejected"] and all("training diverged" in r for r in row["rejected"].values())
        assert set(row["refusals"]) == set(row["rejected"])
        assert set(row["refusals"].values()) == {"diverged"}
    assert all(torch.equal(coord.global_weights[k], v) for k, v in init.items())
    for c, w in coord.pool.personal.items():  # never replaced by the NaN blocks
        assert all(torch.equal(v, personal0[c][k]) for k, v in w.items())


def test_diverged_finetuning_is_listed_in_its_row():
    coord, _ = _coord("fedbabu", "rounds=2")
    assert coord.run().rows[-1]["diverged"] == {}
    coord, _ = _coord("fedbabu", "rounds=2")
    plan = coord.alg.finetune_plan()
    coord.alg.finetune_plan = lambda: replace(plan, lr=1e4)
    row = coord.run().rows[-1]
    assert row["phase"] == "finetune" and set(row["diverged"]) == {"0", "1", "2"}
    assert all(k >= 1 for k in row["diverged"].values())


class FailingDevicePool(InProcessPool):
    """A deployment's outcome, made by hand: every selected client's device said it cannot train;
    `able` other devices of the fleet could."""

    able = 1

    def train(self, round, clients, plan, weights, check, enough=None):
        def nothing():
            return RoundOutcome(blocked=set(clients), device_failures={"dev01": "out of memory"},
                                deadline_s=60.0, able_devices=self.able)
            yield  # a generator that yields no update

        return TrainRound(nothing())


def test_one_failing_device_holding_a_rounds_selection_does_not_end_the_run():
    """Hardening III, finding 13: with another device able to train, a round whose selected
    clients all sit on one failing device is a failed round; with no device able, the run stops
    in one line with the devices' reasons."""
    from fedseq.common.errors import TransportError

    FailingDevicePool.able = 1
    coord, _ = _coord("fedavg", pool_cls=FailingDevicePool)
    row = coord.run_round(0).to_json()  # the row as metrics.jsonl holds it
    assert row["reported"] == [] and row["failed"] == row["clients"]
    assert row["device_failures"] == {"dev01": "out of memory"}
    FailingDevicePool.able = 0
    coord, _ = _coord("fedavg", pool_cls=FailingDevicePool)
    with pytest.raises(TransportError, match="no device can train: dev01: out of memory"):
        coord.run_round(0)


@pytest.mark.parametrize("name", ["fedavg", "fedrep", "fedreg"])
def test_client_steps_count_the_local_optimizer_steps(name):
    """The round's client_steps, recomputed from the plan: per reported client, every phase's
    epochs x its batches x its training objectives (FedReG's rebalanced phase iterates over its
    rebalanced rows); the fine-tuning row counts its own."""
    import math

    from fedseq.common.flops import phase_rows

    coord, _ = _coord(name, "deploy.min_updates=1")
    records = coord.run().records
    plan, bs = coord.alg.plan(0), coord.cfg.train.batch_size
    rec = records[0]
    expected = sum(p.epochs * math.ceil(n / bs) * sum(1 for o in p.objectives if o.trainable)
                   for c in rec.reported
                   for p, n in zip(plan.phases, phase_rows(plan, coord.data, coord.data.clients[c]),
                                   strict=True))
    assert rec.client_steps == expected > 0
    if name == "fedavg":  # one phase, one objective: the batches themselves
        assert expected == sum(math.ceil(len(coord.data.clients[c].train) / bs)
                               for c in rec.reported)
    assert all(r.client_steps for r in records if r.reported or r.phase == "finetune")


@pytest.mark.slow("coordinator rounds with real training: 5 s on 2 cores")
def test_a_simulation_loads_no_mqtt_code(data_root):
    """fedseq-sim's in-process run (and --workers') is the round loop over a pool: importing
    and running it loads neither the MQTT client nor the deployment's modules."""
    import subprocess
    import sys

    over = [f"data.root={str(data_root)!r}", "data.fraction=0.02", "data.num_clients=3",
            "rounds=1", "algorithm.name=fedavg"]
    code = ("import sys; from fedseq.common.config import load_config; "
            "from fedseq.server.ops.simulation import run_simulation; "
            f"run_simulation(load_config(None, {over!r}), None); "
            "import fedseq.server.pools.distributed; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('paho', 'amqtt') "
            "or m.startswith(('fedseq.server.pools.mqtt', 'fedseq.server.ops.deployment', "
            "'fedseq.server.ops.broker'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_a_block_gets_a_new_version_when_the_server_step_says_it_changed():
    """The versions follow what `server_update` returns as changed, not the tensors' identity:
    a step that hands back fresh copies of every tensor re-sends only the blocks it changed
    (FedSeq-Anti's round 0 trains the last base block alone)."""
    from fedseq.common.algorithms.aggregate import ServerStep

    coord, model = _coord("fedseq-anti")
    step_of = coord.alg.server_update
    seen = []

    def copying(global_weights, aggregate):
        step = step_of(global_weights, aggregate)
        seen.append(step.changed)
        return ServerStep({k: v.clone() for k, v in step.weights.items()}, step.changed)

    coord.alg.server_update = copying
    coord.book.broadcast(initial=True)
    plan = coord.alg.plan(0)
    coord.run_round(0)
    moved = {k.split(".")[0] for k in seen[0]}
    assert moved == set(plan.upload) and len(moved) < len(model.spec.blocks)
    assert coord.book.version == {b: int(b in moved) for b in model.spec.blocks}


def test_the_drivers_share_the_ledger_and_subclass_nothing():
    """Sync, buffered-async (with each source of arrivals) are built on the ledger, none a
    subclass of another driver: each names only the protocol it implements."""
    from fedseq.server.pools.mqtt.arrivals import MqttArrivals
    from fedseq.server.rounds.buffered import Arrivals, BufferedAsync, LoggedArrivals, VirtualArrivals
    from fedseq.server.rounds.coordinator import Rounds
    from fedseq.server.rounds.driver import Driver

    for cls in (Rounds, BufferedAsync):
        assert cls.__bases__ == (Driver,), cls
    for cls in (VirtualArrivals, LoggedArrivals, MqttArrivals):
        assert cls.__bases__ == (Arrivals,), cls


def test_an_outlier_is_named_against_the_others_median_in_rounds_of_five_or_more():
    """Issue 94, finding 6: the outlier warning fired on honest non-IID devices in 12 of a lab's
    30 rounds (three devices: the median was one client's own norm). The rule: a norm above
    outlier_factor x the median of the round's other norms, in rounds of at least five updates."""
    from fedseq.server.rounds.ledger import OUTLIER_MIN_UPDATES, outliers

    assert OUTLIER_MIN_UPDATES == 5
    assert outliers({0: 1.0, 1: 6.0, 2: 40.0}, 5.0) == ([], 0.0)  # three honest non-IID clients
    assert outliers({0: 1.0, 1: 1.2, 2: 0.9, 3: 1.1, 4: 6.0}, 5.0)[0] == [4]
    assert outliers({0: 1.0, 1: 1.2, 2: 0.9, 3: 1.1, 4: 5.0}, 5.0)[0] == []  # 5 <= 5 x 1.05
    many = {c: 1.0 for c in range(8)} | {8: 50.0, 9: 60.0}  # two at once still named
    assert outliers(many, 5.0) == ([8, 9], 1.0)
