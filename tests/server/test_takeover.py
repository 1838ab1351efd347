"""Session takeover: MQTT disconnects a client when another CONNECT uses its client id, and the
broker's ACL binds topics to logins, not ids. On Mosquitto with broker.conf's password file and
ACL, a device login that keeps connecting with the ids fedseq used to use (fedseq-device-<name>,
fedseq-server-<run id>, the run id read from the retained run config) must not knock anyone
off: the run completes with every update and the clean simulation's weights."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
import pytest
import torch

from conftest import device_process, quick_config
from fedseq.common.protocol.link import session_id
from fedseq.common.protocol.messages import RunConfig
from fedseq.common.protocol.topics import Topics
from fedseq.server.ops.deployment import run_deployment, stop_children
from fedseq.server.ops.simulation import run_simulation


def test_session_ids_are_unguessable():
    ids = {session_id("fedseq-device-dev01") for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("fedseq-device-dev01-") for i in ids)


@pytest.mark.slow("session takeovers on a live Mosquitto: 7 s on 2 cores")
def test_a_device_login_cannot_take_over_other_sessions(data_root, tmp_path, mosquitto, one_thread):
    port, home, _ = mosquitto
    password = (home / "local02.pw").read_text().strip()
    run_ids: list[str] = []
    stop = threading.Event()
    tries = [0]

    def read_run_id(client, userdata, msg):
        if msg.payload:
            run_ids.append(RunConfig.decode(msg.payload).run_id)

    spy = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=session_id("spy"))
    spy.username_pw_set("local02", password)
    spy.on_message = read_run_id
    spy.on_connect = lambda c, u, f, rc, p: c.subscribe(Topics().run_config, qos=1)
    spy.connect("127.0.0.1", port)
    spy.loop_start()

    def attack():
        while not stop.is_set():
            ids = ["fedseq-device-local01", "fedseq-device-local02"]
            ids += [f"fedseq-server-{r}" for r in run_ids[-1:]]
            for cid in ids:
                c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid)
                c.username_pw_set("local02", password)
                try:
                    c.connect("127.0.0.1", port)
                    c.loop(0.2)
                    c.disconnect()
                    tries[0] += 1
                except OSError:
                    pass
            stop.wait(0.5)

    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "train.join_ratio=0.6",
                       "deploy.min_devices=2", "deploy.round_timeout_s=120",
                       "deploy.eval_timeout_s=120", "deploy.username=coordinator",
                       f"deploy.password_file={str(home / 'coordinator.pw')!r}")
    devices = [device_process(n, port, home, data_root) for n in ("local01", "local02")]
    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        start = time.monotonic()
        res = run_deployment(cfg, tmp_path / "run", broker=f"mqtt://127.0.0.1:{port}",
                             announce=lambda s: None)
        took = time.monotonic() - start
    finally:
        stop.set()
        attacker.join(10)
        spy.loop_stop()
        stop_children(devices)
    assert tries[0] > 10, "the attack did not run"
    assert all(r["reported"] == r["clients"] for r in res.rows), res.rows
    assert took < 200, f"the run waited for deadlines ({took:.0f} s)"  # about 15 s when clean
    sim = run_simulation(cfg, out=None)
    for k, v in sim.global_weights.items():
        assert torch.equal(res.global_weights[k], v), k
