"""End to end over real brokers: the coordinator and fedseq-client daemons as real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import coordinator_run, quick_config
from conftest import coordinator_watcher as _watcher
from conftest import device_process as _device
from conftest import wait_online as _wait_online
from fedseq.common.models import build_run_model
from fedseq.server.ops.broker import free_port
from fedseq.server.ops.deployment import run_deployment, stop_children
from fedseq.server.ops.simulation import run_simulation


def _quiet(_msg: str) -> None:
    pass


FAITHFUL = ("algorithm.final_finetune=true", "train.lr_milestones=[0.5]",
            "train.augment=['crop', 'flip', 'jitter']", "data.normalize='channel'")


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 20 s on 2 cores")
@pytest.mark.parametrize("algorithm, extra", [
    ("fedrod", ()), ("fedyogi", ()), ("scaffold", ()), ("feddyn", ()), ("ditto", ()),
    ("gpfl", ()), ("moon", ()), ("fednova", ()), ("fedavg", FAITHFUL)])
def test_amqtt_deployment_matches_simulation(data_root, tmp_path, one_thread, algorithm, extra):
    """A two-head algorithm, one with a server optimizer (its state on the coordinator),
    SCAFFOLD (c published as blocks, dc in the updates, each c_i on its device's disk: three
    rounds, so that clients train twice), FedDyn (g_k on the device's disk, h on the
    coordinator), Ditto (each client's own model on its device's disk, evaluated there), GPFL
    (CoV and GCE shared, heads on the devices' disks, evaluated through the valve there), MOON
    (each client's previous base on its device's disk), FedNova (normalized on the device,
    stepped by tau_eff on the coordinator), and
    FedAvg with a paper's training options (a step decay of the learning rate, augmentation
    drawn on the device, per-channel normalization, then every client fine-tuned)."""
    rounds = 3 if algorithm in ("scaffold", "feddyn", "ditto", "moon") else 2
    own = ("algorithm.ditto.epochs=1",) if algorithm == "ditto" else ()  # 5 by default: 30 s more
    cfg = quick_config(data_root, f"algorithm.name={algorithm}", f"rounds={rounds}",
                       "train.join_ratio=0.6", "deploy.port=0", *own, *extra)
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1, announce=_quiet)
    sim = run_simulation(cfg, out=None)
    assert len(dep.rows) == len(sim.rows) == rounds + bool(extra)  # + the fine-tuning's row
    if extra:
        assert dep.rows[-1]["phase"] == sim.rows[-1]["phase"] == "finetune"
        assert dep.rows[-1]["personal_acc"] == sim.rows[-1]["personal_acc"]
    assert set(sim.rows[0]["clients"]) & set(sim.rows[rounds - 1]["clients"])  # trained again
    for d, s in zip(dep.rows[:rounds], sim.rows[:rounds], strict=True):
        assert d["clients"] == s["clients"] and d["reported"] == d["clients"]
        assert d["global_acc"] == s["global_acc"] and d["personal_acc"] == s["personal_acc"]
        # the testbed's local-model accuracy travels in the update headers
        assert d["local_acc"] == s["local_acc"] and d["round_local_acc"] == s["round_local_acc"]
        assert s["round_local_acc"] is not None
        assert d["train_flops"] == s["train_flops"]
    for k, v in sim.global_weights.items():
        assert torch.equal(dep.global_weights[k], v), k  # bitwise, same threads and order
    rows = [json.loads(x) for x in (tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["bytes_down"] > 0 and rows[0]["bytes_up"] > 0
    # the wire bytes of a round are its training step's and its evaluation's (every round is
    # evaluated here): round 0's aggregate went out for round 0's evaluation (and round 1 trains
    # from it), so round 1's shared blocks go out in its evaluation step; the updates come in
    from fedseq.common.algorithms import make_algorithm, model_layout
    from fedseq.common.data.catalog import INPUT_SHAPES, NUM_CLASSES
    from fedseq.common.models import build_model, get_blocks
    from fedseq.common.protocol.tensors import frame_size

    model = build_model(cfg.model.name, INPUT_SHAPES["fmnist"], NUM_CLASSES["fmnist"],
                        **model_layout(algorithm))
    personal = make_algorithm(cfg, model.spec).personal_blocks()
    shared = sum(frame_size(get_blocks(model, [b])) for b in model.spec.blocks if b not in personal)
    assert rows[1]["wire_bytes_out"] >= shared, (rows[1]["wire_bytes_out"], shared)
    assert all(r["wire_bytes_in"] >= r["bytes_up"] for r in rows[:rounds]), rows
    # what each device trained with is recorded beside the run (what bitwise depends on)
    stacks = json.loads((tmp_path / "dep" / "devices.json").read_text())
    assert sorted(stacks) == ["local01", "local02"]
    for rows_of_device in stacks.values():
        (only,) = rows_of_device  # one stack per device: no duplicate from the second write
        assert only["torch"] == torch.__version__ and only["threads"] == 1
        assert only["torch_device"] == "cpu" and only["cpu"] and only["machine"]


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 15 s on 2 cores")
@pytest.mark.parametrize("algorithm, norm, learns", [
    ("fedseq-anti", "batch", 0.4), ("fedseq-anti", "running", 0.4), ("fedavg", "fedbn", 0.3)])
def test_batchnorm_model_under_fedseqs_freeze_schedule_matches_simulation(
        data_root, tmp_path, one_thread, algorithm, norm, learns):
    """FedBABU's 4convNet under FedSeq-Anti's schedule, its BatchNorm on batch statistics and on
    running statistics (frozen blocks normalize by theirs; the statistics travel and aggregate
    with their block), and under FedBN (every normalization layer personal, kept on the device's
    disk): the devices score their own clients, the simulation all of them in one process; both
    give the same accuracies and, bitwise, the same weights."""
    cfg = quick_config(data_root, f"algorithm.name={algorithm}", "model.name=4convnet", "rounds=3",
                       "algorithm.unfreeze_rounds=[0,1,1,2]", "algorithm.finetune_epochs=1",
                       "train.join_ratio=0.6", "deploy.port=0", f"model.norm={norm}")
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1, announce=_quiet)
    sim = run_simulation(cfg, out=None)
    assert [r["phase"] for r in dep.rows] == [r["phase"] for r in sim.rows]
    for d, s in zip(dep.rows, sim.rows, strict=True):
        assert (d["global_acc"], d["personal_acc"]) == (s["global_acc"], s["personal_acc"])
    assert sim.rows[-1]["personal_acc"] > learns  # chance is 0.10
    for k, v in sim.global_weights.items():
        assert torch.equal(dep.global_weights[k], v), k
    stats = [k for k in sim.global_weights if k.endswith(".running_var")]
    assert len(stats) == (0 if norm == "batch" else 4)
    initial = build_run_model("4convnet", (1, 28, 28), 10, False, cfg.seed_for("init"),
                              norm=norm).state_dict()
    moved = {k for k in stats if not torch.equal(sim.global_weights[k], initial[k])}
    assert moved == (set() if norm == "fedbn" else set(stats))  # FedBN's stay with the clients


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 34 s on 2 cores")
def test_divergence_travels_from_the_devices(data_root, tmp_path, one_thread):
    # lr 1e4 makes every client's loss NaN within its first epoch, in training and fine-tuning
    # (a client whose update explodes without turning NaN is refused by the bound and waited
    # for until the deadline: an invalid update never ends the wait for a valid one)
    cfg = quick_config(data_root, "algorithm.name=fedbabu", "rounds=1", "train.lr=1e4",
                       "deploy.port=0", "deploy.round_timeout_s=30")
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1, announce=_quiet)
    sim = run_simulation(cfg, out=None)
    train, ft = dep.rows
    assert train["status"] == "failed" and train["failed"] == train["clients"]
    assert sorted(int(c) for c in train["rejected"]) == train["clients"]
    # most clients' loss turns NaN (refused as diverged), the rest explode past the bound
    assert any(r.startswith("training diverged") for r in train["rejected"].values())
    assert ft["phase"] == "finetune" and sorted(ft["diverged"]) == [str(c) for c in range(5)]
    def diverged(row):  # (the bound's reason names the first tensor in the frame's order)
        return {c: r for c, r in row["rejected"].items() if r.startswith("training diverged")}

    assert diverged(dep.rows[0]) == diverged(sim.rows[0])
    assert ft["diverged"] == sim.rows[1]["diverged"]  # the same batches, device and simulation


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 7 s on 2 cores")
def test_mosquitto_with_credentials_and_acl(data_root, tmp_path, mosquitto):
    port, home, restart_broker = mosquitto
    devices = [_device(n, port, home, data_root) for n in ("local01", "local02")]
    try:
        cfg = quick_config(data_root, "algorithm.name=fedseq-vanilla", "rounds=3",
                           "algorithm.unfreeze_rounds=[0,1,2]", "train.join_ratio=0.6",
                           "deploy.min_devices=2", "deploy.username=coordinator",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}")
        res = run_deployment(cfg, tmp_path / "run", broker=f"mqtt://127.0.0.1:{port}",
                             announce=_quiet)
    finally:
        stop_children(devices)
    assert [d.returncode for d in devices] == [0, 0]  # SIGTERM: offline published, exit 0
    train = [r for r in res.rows if r["phase"] == "train"]
    assert all(r["reported"] == r["clients"] for r in train)
    assert res.rows[-1]["phase"] == "finetune" and res.rows[-1]["personal_acc"] > 0.5
    assert sorted(res.final.per_client) == list(range(5))
    # personal state of the fine-tuned FedSeq clients is not kept, but every device trained
    assert train[0]["uploaded_blocks"] == ["conv1"]
    for r in train:  # the record names who reported, and the deadline each round had
        assert set(r["reporters"].values()) <= {"local01", "local02"}
        assert sorted(int(c) for c in r["reporters"]) == r["reported"]
        assert r["deadline_s"] > 0 and r["device_failures"] == {} and r["late_updates"] == 0
    # the project's ACL lets each device describe itself on its own info topic
    stacks = json.loads((tmp_path / "run" / "devices.json").read_text())
    assert sorted(stacks) == ["local01", "local02"]
    assert all(len(v) == 1 and v[0]["torch"] == torch.__version__ for v in stacks.values())


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 29 s on 2 cores")
@pytest.mark.parametrize("model, norm, size", [("resnet18", "batch", 44_000_000),
                                               ("mobilenet", "running", 12_800_000)])
def test_a_big_models_round_crosses_mosquitto_bitwise(data_root, tmp_path, mosquitto, one_thread,
                                                     model, norm, size):
    """ResNet-18's 44.7 MB updates and global model, and MobileNet's 12.9 MB with its running
    statistics, through Mosquitto with the project's broker.conf and ACL (1 MiB chunks under its
    2 MiB packet limit, its queue limits): every update arrives, the round's bytes are the model's
    frames, the weights (statistics included) are the simulation's."""
    from fedseq.common.data.catalog import INPUT_SHAPES, NUM_CLASSES
    from fedseq.common.models import build_model, get_blocks
    from fedseq.common.protocol.tensors import frame_size

    port, home, _ = mosquitto
    devices = [_device(n, port, home, data_root) for n in ("local01", "local02")]
    over = ("algorithm.name=fedavg", f"model.name={model}", "rounds=1", "data.fraction=0.01",
            "data.min_samples=10", "train.join_ratio=0.6", "deploy.min_devices=2",
            f"model.norm={norm}")
    try:
        cfg, res = coordinator_run(data_root, tmp_path / "run", mosquitto, *over)
    finally:
        stop_children(devices)
    (row,) = res.rows
    assert row["reported"] == row["clients"] and len(row["clients"]) == 3
    net = build_model(model, INPUT_SHAPES["fmnist"], NUM_CLASSES["fmnist"], norm=norm)
    whole = frame_size(get_blocks(net, net.spec.blocks))
    assert whole > size  # ResNet-18: 22 times the broker's packet limit
    assert row["bytes_up"] == 3 * whole and row["wire_bytes_in"] >= row["bytes_up"]
    sim = run_simulation(cfg, out=None)
    assert all(torch.equal(res.global_weights[k], v) for k, v in sim.global_weights.items())
    assert row["global_acc"] == sim.rows[0]["global_acc"]
    assert sum(k.endswith("running_var") for k in sim.global_weights) == (27 if norm == "running"
                                                                          else 0)


def test_devices_json_keeps_each_stack_across_resumes_and_lists_the_silent(data_root, tmp_path):
    from fedseq.server.rounds.rundir import RunDir

    cfg = quick_config(data_root)
    nano = {"seen": 1.0, "torch": "1.12.1", "threads": 4}
    run = RunDir(tmp_path, cfg)
    run.record_devices({"jetson01": [nano], "jetson02": []})  # jetson02 never described itself
    run.close()
    resumed = RunDir(tmp_path, cfg, "resume", 1)  # a later coordinator sees the retained stack
    resumed.record_devices({"jetson01": [{**nano, "seen": 9.0},
                                         {**nano, "seen": 9.5, "torch": "1.13.0"}],
                            "jetson02": []})
    resumed.close()
    stacks = json.loads((tmp_path / "devices.json").read_text())
    assert stacks == {"jetson01": [nano, {**nano, "seen": 9.5, "torch": "1.13.0"}], "jetson02": []}


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 40 s on 2 cores")
def test_device_lost_mid_round_fails_fast(data_root, tmp_path, mosquitto):
    """A device killed right after round 1's step is out: its last will ends the round for its
    clients at once, the other device's updates are aggregated. With deploy.min_devices = the
    fleet, the coordinator waits wait_devices_s for the lost device once, not before every later
    step."""

    from fedseq.common.protocol.messages import Step

    port, home, _ = mosquitto
    d1 = _device("local01", port, home, data_root)
    d2 = _device("local02", port, home, data_root)
    killed = []

    def on_step(client, userdata, msg):
        if msg.payload and not killed:
            step = Step.decode(msg.payload)
            if step.kind == "train" and step.round == 1:
                d2.send_signal(signal.SIGKILL)
                killed.append(time.monotonic())

    watcher = _watcher(port, home, on_step)
    wait_s = 30
    try:
        # both online first: the coordinator's first wait must not race two daemons importing
        # torch (CI, loaded)
        for name in ("local01", "local02"):
            _wait_online(port, home, name)
        cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=4", "train.join_ratio=1.0",
                           "train.eval_every=1", "deploy.min_devices=2",
                           "deploy.round_timeout_s=300", f"deploy.wait_devices_s={wait_s}",
                           "deploy.username=coordinator",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}")
        res = run_deployment(cfg, None, broker=f"mqtt://127.0.0.1:{port}", announce=_quiet)
    finally:
        watcher.loop_stop()
        stop_children([d1, d2])
    assert killed
    train = [r for r in res.rows if r["phase"] == "train"]
    r1 = train[1]
    assert r1["failed"] and set(r1["failed"]) | set(r1["reported"]) == set(r1["clients"])
    assert r1["reported"]  # the surviving device's clients were aggregated
    # ended by the last will, not the 300 s deadline; its evaluation waited wait_s for local02
    assert wait_s <= r1["seconds"] < wait_s + 120, r1["seconds"]
    for later in train[2:]:  # local02 was written off: no wait before these rounds' steps
        assert later["reported"] == r1["reported"]
        assert later["seconds"] < wait_s, later["seconds"]


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 17 s on 2 cores")
def test_a_ghost_device_is_not_waited_for(data_root, tmp_path, mosquitto):
    """A device that died while the broker was down leaves its retained 'online' status behind
    (its last will was never published). The coordinator counts it online at first and assigns it
    clients, but without its heartbeat it is offline after three heartbeats: rounds do not wait
    their deadline for it, and the live device's clients are aggregated."""
    import paho.mqtt.client as mqtt

    from fedseq.common.protocol.messages import DeviceStatus

    port, home, _ = mosquitto
    # the live device first, online before the ghost appears: the ghost's heartbeat runs out
    # 6 s after the coordinator hears it, so a daemon slow to start must not be waited for then
    d1 = _device("local01", port, home, data_root)
    try:
        _wait_online(port, home, "local01")
        ghost = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ghost-of-local02")
        ghost.username_pw_set("local02", (home / "local02.pw").read_text().strip())
        ghost.connect("127.0.0.1", port)
        ghost.loop_start()
        status = DeviceStatus(device="local02", state="online", heartbeat_s=2.0, since=time.time())
        ghost.publish("fedseq/device/local02/status", status.encode(), qos=1,
                      retain=True).wait_for_publish(10)
        ghost.loop_stop()
        ghost.socket().close()  # dies without a goodbye and without a last will
        cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "train.join_ratio=1.0",
                           "deploy.min_devices=2", "deploy.round_timeout_s=120",
                           "deploy.wait_devices_s=5", "deploy.username=coordinator",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}")
        start = time.monotonic()
        res = run_deployment(cfg, None, broker=f"mqtt://127.0.0.1:{port}", announce=_quiet)
        took = time.monotonic() - start
    finally:
        stop_children([d1])
    ghost_clients = {1, 3}  # round-robin over local01, local02
    for r in res.rows:
        if r["phase"] == "train":
            assert set(r["failed"]) == ghost_clients and r["reported"] == [0, 2, 4], r
    assert took < 100, took  # one 120 s deadline would exceed it


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 12 s on 2 cores")
def test_survives_broker_restart(data_root, tmp_path, mosquitto):
    """Mosquitto restarts between rounds: everyone reconnects, renews subscriptions, resyncs from
    the retained (persisted) messages, and the run completes."""
    port, home, restart_broker = mosquitto
    devices = [_device(n, port, home, data_root) for n in ("local01", "local02")]
    restarted = []

    def on_round(row):
        if row.round == 0 and not restarted:
            restart_broker()
            restarted.append(True)

    try:
        cfg = quick_config(data_root, "algorithm.name=fedper", "rounds=3", "train.join_ratio=0.6",
                           "deploy.min_devices=2", "deploy.round_timeout_s=60",
                           "deploy.eval_timeout_s=60", "deploy.username=coordinator",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}")
        res = run_deployment(cfg, None, broker=f"mqtt://127.0.0.1:{port}", announce=_quiet,
                             on_round=on_round)
    finally:
        stop_children(devices)
    assert restarted
    assert all(r["reported"] == r["clients"] for r in res.rows[1:]), res.rows
    assert len(res.final.per_client) == 5  # every device answered the last evaluation


@pytest.mark.slow("a deployment with the flood guard and a broker restart mid-round: ~25 s")
def test_a_broker_restart_mid_round_gets_no_honest_login_disabled(data_root, tmp_path, mosquitto,
                                                                   caplog):
    """Hardening VI, finding 9: Mosquitto restarts while a round's updates are on their way, with
    the flood guard on. The coordinator loses the round (its devices went offline with the
    broker). The daemons send, when the broker is back, what they queued and their own resends:
    about two copies of each update, at the edge of a login's burst (two whole updates a
    client), so the last few chunks of it are dropped unread; each drop is told to the guard,
    which disables a login only at 100 drops in 5 s. No login is disabled, and the later rounds
    count all their clients."""
    import threading

    from fedseq.common.protocol.messages import Step
    from fedseq.server.pools.mqtt import guard

    drops: dict[str, int] = {}
    told = guard.FloodGuard.dropped

    def counted(self, login):
        drops[login] = drops.get(login, 0) + 1
        told(self, login)

    port, home, restart_broker = mosquitto
    devices = [_device(n, port, home, data_root) for n in ("local01", "local02")]
    restarted: list[float] = []

    def on_step(client, userdata, msg):
        if not msg.payload or restarted:
            return
        step = Step.decode(msg.payload)
        if step.kind == "train" and step.round == 1:  # while the daemons train and send
            restarted.append(time.monotonic())
            threading.Thread(target=restart_broker, daemon=True).start()

    watcher = _watcher(port, home, on_step)
    try:
        cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "deploy.min_devices=2",
                           "deploy.round_timeout_s=90", "deploy.eval_timeout_s=60",
                           "deploy.username=coordinator", "deploy.guard_username=fedseq-guard",
                           f"deploy.guard_password_file={str(home / 'fedseq-guard.pw')!r}",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}")
        with caplog.at_level("WARNING"), pytest.MonkeyPatch.context() as mp:
            mp.setattr(guard.FloodGuard, "dropped", counted)
            res = run_deployment(cfg, None, broker=f"mqtt://127.0.0.1:{port}", announce=_quiet)
    finally:
        watcher.loop_stop()
        watcher.disconnect()
        stop_children(devices)
    assert restarted
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "disabled the broker login" in m], said
    print("messages dropped unread per login after the restart:", drops)
    assert set(drops) <= {"local01", "local02"} and max(drops.values(), default=0) < 25, drops
    train = [r for r in res.rows if r["phase"] == "train"]
    assert len(train) == 3 and all(r["reported"] == r["clients"] for r in (train[0], train[2]))


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 5 s on 2 cores")
def test_doctor_reports_login_and_data(data_root, tmp_path, mosquitto):
    port, home, _ = mosquitto
    base = [sys.executable, "-m", "fedseq.client.cli", "doctor", "--device", "local01",
            "--broker", f"mqtt://127.0.0.1:{port}", "--data-dir", str(data_root),
            "--state-dir", str(tmp_path / "st"), "--username", "local01"]
    good = subprocess.run(base + ["--password-file", str(home / "local01.pw")],
                          capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stdout
    assert "fmnist" in good.stdout and "accepts local01" in good.stdout
    (tmp_path / "wrong.pw").write_text("nope\n")
    bad = subprocess.run(base + ["--password-file", str(tmp_path / "wrong.pw")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "refused user 'local01'" in bad.stdout, bad.stdout
    assert "Traceback" not in bad.stdout + bad.stderr


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 14 s on 2 cores")
def test_broker_loses_everything_then_a_device_reboots(data_root, tmp_path, mosquitto):
    """Mosquitto killed -9 without its persistence file after round 0, and local02 rebooted after
    that: the coordinator re-publishes run config, assignments, weights and step on reconnect, so
    the rebooted device rejoins and later rounds have every client."""
    port, home, restart_broker = mosquitto
    devices = [_device(n, port, home, data_root) for n in ("local01", "local02")]
    events = []

    def on_round(row):
        if row.round == 0 and not events:
            stop_children([devices[1]])
            restart_broker(lose_everything=True)
            devices.append(_device("local02", port, home, data_root))  # boots after the loss
            events.append(time.monotonic())

    try:
        cfg = quick_config(data_root, "algorithm.name=fedper", "rounds=3", "train.join_ratio=1.0",
                           "deploy.min_devices=2", "deploy.round_timeout_s=120",
                           "deploy.eval_timeout_s=120", "deploy.username=coordinator",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}")
        res = run_deployment(cfg, None, broker=f"mqtt://127.0.0.1:{port}", announce=_quiet,
                             on_round=on_round)
    finally:
        stop_children(devices)
    assert events
    assert all(r["reported"] == r["clients"] for r in res.rows[1:]), res.rows
    assert len(res.final.per_client) == 5


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 5 s on 2 cores")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_device_without_its_dataset_is_known_at_once(data_root, tmp_path, mode):
    """A daemon with a wrong data dir reports why; with nobody able to train the coordinator stops
    with one line naming the device and the cause, exit 2, long before its deadlines (also
    asynchronously, where its flights are dropped and nobody else can take them)."""
    port = free_port()
    dev = subprocess.Popen([sys.executable, "-m", "fedseq.client.cli", "--device", "dev01",
                            "--broker", f"mqtt://127.0.0.1:{port}", "--data-dir", str(tmp_path),
                            "--state-dir", str(tmp_path / "st"), "--threads", "1"])
    start = time.monotonic()
    try:
        r = subprocess.run(
            ["fedseq-server", "start", "-q", "--set", f"data.root={str(data_root)!r}",
             "--set", "data.fraction=0.03", "--set", "data.num_clients=4", "--set", "rounds=2",
             "--set", f"deploy.port={port}", "--set", "deploy.round_timeout_s=600",
             "--set", f"train.mode={mode!r}", "--out", str(tmp_path / "run")],
            capture_output=True, text=True, timeout=300)
    finally:
        stop_children([dev])
    assert time.monotonic() - start < 120
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no device can train: dev01:") and "data.root" in last, last
    assert "Traceback" not in r.stderr


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 12 s on 2 cores")
def test_broker_killed_while_devices_train(data_root, tmp_path, mosquitto):
    """Mosquitto killed -9 (losing everything) right after round 1's step: the updates finished
    while the coordinator was away are sent again when it is back, so the round completes in
    seconds, not at its 120 s deadline."""
    import threading

    from fedseq.common.protocol.messages import Step

    port, home, restart_broker = mosquitto
    devices = [_device(n, port, home, data_root) for n in ("local01", "local02")]
    killed = []

    def on_step(client, userdata, msg):
        if msg.payload and not killed:
            step = Step.decode(msg.payload)
            if step.kind == "train" and step.round == 1:
                killed.append(True)
                threading.Thread(target=restart_broker, args=(True,)).start()

    watcher = _watcher(port, home, on_step)
    try:
        cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "train.join_ratio=1.0",
                           "deploy.min_devices=2", "deploy.round_timeout_s=120",
                           "deploy.eval_timeout_s=120", "deploy.username=coordinator",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}")
        res = run_deployment(cfg, None, broker=f"mqtt://127.0.0.1:{port}", announce=_quiet)
    finally:
        watcher.loop_stop()
        stop_children(devices)
    assert killed
    r1 = res.rows[1]
    assert r1["reported"] == r1["clients"], r1
    assert r1["seconds"] < 60, r1["seconds"]
    assert all(r["reported"] == r["clients"] for r in res.rows)


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 20 s on 2 cores")
def test_revoked_login_ends_the_daemon_with_exit_2(data_root, tmp_path, mosquitto):
    """The broker stops accepting a running device (its password changed): after three refused
    reconnects the daemon exits 2 with one line, so systemd shows the unit failed."""
    port, home, restart_broker = mosquitto
    dev = _device("local01", port, home, data_root)
    time.sleep(3)  # connected and waiting for a run
    subprocess.run(["mosquitto_passwd", "-b", str(home / "passwd"), "local01", "changed"], check=True)
    restart_broker()
    try:
        dev.wait(90)
    finally:
        stop_children([dev])
    assert dev.returncode == 2


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 8 s on 2 cores")
def test_stray_messages_on_an_open_broker_do_not_end_the_run(data_root, tmp_path, one_thread):
    """On an open broker (embedded, anonymous) a stray client overwrites the retained step with
    one of another protocol version under the current run id, then with junk, then the run config
    and an assignment: the device ignores what its run's coordinator cannot have sent, the
    coordinator puts its own retained state back, and the run ends with the clean run's weights."""
    import re as _re
    import threading

    import paho.mqtt.client as mqtt

    from fedseq.common.protocol.messages import PROTOCOL_VERSION

    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "deploy.port=0",
                       "deploy.round_timeout_s=120", "train.join_ratio=0.6")
    fired: list[str] = []
    started: list[bool] = []
    watchers = []

    def stray(port: int, run_id: str) -> None:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="stray")
        c.connect("127.0.0.1", port)
        c.loop_start()
        newer = {"v": PROTOCOL_VERSION + 1, "run_id": run_id, "seq": 1, "kind": "train"}
        for topic, payload in [("fedseq/step", json.dumps(newer).encode()),
                               ("fedseq/step", b"\x00junk"),
                               ("fedseq/run/config", json.dumps(newer).encode()),
                               ("fedseq/device/local01/assign", b"{}")]:
            c.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
        c.loop_stop()
        c.disconnect()
        fired.append(run_id)

    def announce(line):
        url = _re.search(r"mqtt://127\.0\.0\.1:(\d+)", line)
        if not url or watchers:
            return
        port = int(url.group(1))

        def on_step(client, userdata, msg):  # once the device trains round 1 of the run
            try:
                step = json.loads(msg.payload)
            except ValueError:
                return
            if step.get("kind") == "train" and step.get("round") == 1 and not started:
                started.append(True)
                threading.Thread(target=stray, args=(port, step["run_id"])).start()

        w = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watcher")
        w.on_message = on_step
        w.on_connect = lambda c, u, f, rc, p: c.subscribe("fedseq/step", qos=1)
        w.connect("127.0.0.1", port)
        w.loop_start()
        watchers.append(w)

    try:
        dep = run_deployment(cfg, tmp_path / "dep", local_devices=1, client_threads=1,
                             announce=announce)
    finally:
        for w in watchers:
            w.loop_stop()
    assert fired
    assert [r["reported"] == r["clients"] for r in dep.rows] == [True] * 3, dep.rows
    sim = run_simulation(cfg, out=None)
    for k, v in sim.global_weights.items():
        assert torch.equal(dep.global_weights[k], v), k


@pytest.mark.slow("a deployment: coordinator, broker and device daemons: 3 s on 2 cores")
def test_a_real_protocol_mismatch_is_reported_by_the_device(tmp_path, data_root):
    """A coordinator of another protocol version (its run config and step both in it): the device
    says in its retained status why it cannot follow that run."""
    import paho.mqtt.client as mqtt

    from fedseq.common.protocol.messages import PROTOCOL_VERSION, DeviceStatus
    from fedseq.server.ops.broker import EmbeddedBroker

    port = free_port()
    broker = EmbeddedBroker("127.0.0.1", port)
    broker.start()
    try:
        dev = subprocess.Popen([sys.executable, "-m", "fedseq.client.cli", "--device", "local01",
                                "--broker", f"mqtt://127.0.0.1:{port}", "--data-dir",
                                str(data_root), "--state-dir", str(tmp_path / "state")])
        got: list[DeviceStatus] = []
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="newer-coordinator")

        def on_message(client, userdata, msg):
            if msg.payload:
                got.append(DeviceStatus.decode(msg.payload))

        c.on_message = on_message
        c.on_connect = lambda cl, u, f, rc, p: cl.subscribe("fedseq/device/local01/status", qos=1)
        c.connect("127.0.0.1", port)
        c.loop_start()
        try:
            deadline = time.monotonic() + 90
            while not got and time.monotonic() < deadline:
                time.sleep(0.2)
            newer = {"v": PROTOCOL_VERSION + 1, "run_id": "r-newer"}
            for topic in ("fedseq/run/config", "fedseq/step"):
                c.publish(topic, json.dumps(newer).encode(), qos=1, retain=True).wait_for_publish(10)
            while not any(s.error for s in got) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            c.loop_stop()
            stop_children([dev])
    finally:
        broker.stop()
    st = [s for s in got if s.error][-1]
    assert st.error_run_id == "r-newer" and st.error_seq == -1
    assert f"coordinator speaks v{PROTOCOL_VERSION + 1}" in st.error


@pytest.mark.slow("a deployment on Mosquitto, then the broker's retained messages read: ~10 s")
def test_a_finished_run_leaves_nothing_to_follow_on_the_broker(data_root, tmp_path, mosquitto):
    """Issue 94, finding 4: a finished run's run config, assignments, step and weights stayed
    retained, so a daemon started later said it "cannot follow" the finished run, or got its
    weights while "the current run is none yet", and `fedseq-server status` showed it as
    current. A run that ends clears what it retained; the devices' statuses and the
    coordinator's own (offline, naming its last run) are all that is left."""
    import threading

    import paho.mqtt.client as mqtt

    from fedseq.server.ops.status import format_fleet, read_fleet

    port, home, _ = mosquitto
    devices = [_device(n, port, home, data_root) for n in ("local01", "local02")]
    try:
        cfg = quick_config(data_root, "rounds=1", "deploy.min_devices=2",
                           "deploy.username=coordinator",
                           f"deploy.password_file={str(home / 'coordinator.pw')!r}")
        res = run_deployment(cfg, tmp_path / "run", broker=f"mqtt://127.0.0.1:{port}",
                             announce=_quiet)
    finally:
        stop_children(devices)
    retained: dict[str, bytes] = {}
    quiet = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="retained-reader")
    client.username_pw_set("coordinator", (home / "coordinator.pw").read_text().strip())
    client.on_message = lambda c, u, m: retained.__setitem__(m.topic, m.payload) if m.retain else None
    client.on_connect = lambda c, u, f, rc, p: c.subscribe("fedseq/#", qos=1)
    client.connect("127.0.0.1", port)
    client.loop_start()
    quiet.wait(3.0)
    client.loop_stop()
    client.disconnect()
    assert sorted(retained) == ["fedseq/device/local01/info", "fedseq/device/local01/status",
                                "fedseq/device/local02/info", "fedseq/device/local02/status",
                                "fedseq/server/status"], sorted(retained)
    run_id = json.loads(retained["fedseq/server/status"])["run_id"]
    view = read_fleet(f"mqtt://127.0.0.1:{port}", "fedseq", username="coordinator",
                      password=(home / "coordinator.pw").read_text().strip())
    lines = format_fleet(view, f"mqtt://127.0.0.1:{port}")
    assert lines[0].endswith(f"coordinator offline (its last run {run_id})"), lines[0]
    assert not any(line.startswith(("run ", "current step")) for line in lines)
    assert res.rows[-1]["phase"] == "finetune"
