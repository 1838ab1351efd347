"""A secure round over Mosquitto with the project's broker.conf and ACL, where device local02 is a
script holding local02's login: for its clients it answers the stages with junk keys (client 1),
with keys and then silence (client 3: it drops before sharing, and nobody waits for its input),
with keys and shares and then a masked input that is junk (client 5: it dropped after sharing).
The round completes on local01's clients, client 5's masks are removed with its neighbours'
shares, and the masked inputs the coordinator's login captured look uniform."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest
import torch

from conftest import device_process, quick_config, wait_online
from fedseq.common.protocol.frames import pack_chunk, split_frame
from fedseq.common.protocol.messages import (
    DeviceStatus,
    RunConfig,
    SecAggMessage,
    Step,
    UpdateHeader,
)
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.common.secagg import (
    MASKED,
    SecAggClient,
    keys_from_wire,
    keys_to_wire,
    setup_from_dict,
    shares_to_wire,
)
from fedseq.server.ops.deployment import run_deployment, stop_children

pytest.importorskip("cryptography")
T = Topics()


class FaultyDevice:
    """local02 as a script (module docstring); its clients are the odd ones (1, 3, 5)."""

    def __init__(self, port: int, password: str):
        self.run_id: str | None = None
        self.parties: dict[int, SecAggClient] = {}
        self.seq = -1
        self.done = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="faulty-local02")
        c.username_pw_set("local02", password)
        c.on_connect = lambda cl, u, f, rc, p: cl.subscribe(
            [(T.step, 1), (T.run_config, 1), (T.secagg_relay("local02"), 1)])
        c.on_message = self._message
        c.connect("127.0.0.1", port)
        c.loop_start()
        self.client = c
        self._status("online")

    def _status(self, state: str) -> None:
        self.client.publish(T.device_status("local02"), DeviceStatus(
            device="local02", state=state, since=time.time()).encode(), qos=1, retain=True)

    def _send(self, stage: str, items: dict) -> None:
        self.client.publish(T.secagg("local02"), SecAggMessage(
            run_id=self.run_id, seq=self.seq, stage=stage, device="local02",
            items=items).encode(), qos=1)

    def _message(self, client, userdata, msg):
        if not msg.payload:
            return
        if msg.topic == T.run_config:
            self.run_id = RunConfig.decode(msg.payload).run_id
        elif msg.topic == T.step:
            self._on_step(Step.decode(msg.payload))
        else:
            self._on_relay(SecAggMessage.decode(msg.payload))

    def _on_step(self, step: Step) -> None:
        if step.kind == "evaluate" and self.done.is_set():
            self._status("offline")  # nothing to score: gone before the evaluation
        if step.kind == "train" and step.secagg and step.seq != self.seq:
            self.seq, self.round = step.seq, step.round
            setup, self.layout, _ = setup_from_dict(step.secagg)
            self.parties = {c: SecAggClient(c, setup) for c in (3, 5)}
            keys = {c: keys_to_wire(p.advertise()) for c, p in self.parties.items()}
            keys[1] = ["junk", "junk"]
            self._send("keys", keys)

    def _on_relay(self, relay: SecAggMessage) -> None:
        if relay.stage == "keys":  # client 5 shares; 3 is silent from now on
            shares = {}
            for c, p in self.parties.items():
                if c == 3:
                    continue
                # a device of an older fedseq: no checks of its shares
                blobs, commitment, _ = p.share_keys(
                    {int(v): keys_from_wire(k) for v, k in relay.items[c].items()})
                shares[c] = shares_to_wire(blobs, commitment, None)
            self._send("shares", shares)
        elif relay.stage == "shares":  # client 5's masked input is junk, then it is gone
            frame = encode_tensors({MASKED: torch.zeros(7, dtype=torch.int32)})
            for i, part in enumerate(split_frame(frame)):
                head = UpdateHeader(run_id=self.run_id, seq=self.seq, round=self.round,
                                    client=5, device="local02", num_samples=1, chunk=i,
                                    chunks=1, size=len(frame),
                                    sha256=hashlib.sha256(frame).hexdigest())
                self.client.publish(T.update("local02"), pack_chunk(head, part), qos=1)
            self.done.set()  # online and silent: the round waits for 5 until its deadline

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


class Capture:
    """A listener with the coordinator's login: every masked input that crosses the broker."""

    def __init__(self, port: int, password: str):
        self.inputs: list[np.ndarray] = []
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="capture")
        c.username_pw_set("coordinator", password)
        c.on_connect = lambda cl, u, f, rc, p: cl.subscribe(T.update("local01"), 1)
        c.on_message = self._message
        c.connect("127.0.0.1", port)
        c.loop_start()
        self.client = c
        self.chunks: dict[tuple[int, int], dict[int, bytes]] = {}

    def _message(self, client, userdata, msg):
        from fedseq.common.protocol.frames import unpack_chunk

        head, data = unpack_chunk(msg.payload, UpdateHeader)
        parts = self.chunks.setdefault((head.seq, head.client), {})
        parts[head.chunk] = bytes(data)
        if len(parts) == head.chunks:
            frame = b"".join(parts[i] for i in range(head.chunks))
            self.inputs.append(decode_tensors(frame)[MASKED].numpy().view(np.uint32))

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _beside_local01(cfg, port, home, data_root, tmp_path, scripts):
    """The run of `cfg` into tmp_path/run with local01's real daemon beside the `scripts`
    (stopped after it, with the daemon)."""
    daemon = device_process("local01", port, home, data_root)
    try:
        # online before the run starts: its 2 s wait is for the stages, not a daemon's start under load
        wait_online(port, home, "local01")
        return run_deployment(cfg, tmp_path / "run", broker=f"mqtt://127.0.0.1:{port}",
                              announce=lambda s: None)
    finally:
        for script in scripts:
            script.stop()
        stop_children([daemon])


@pytest.mark.slow("secure rounds on Mosquitto with faulty stages waited out")
def test_faulty_stages_drop_their_clients_and_the_round_still_counts(
        data_root, tmp_path, mosquitto, one_thread, caplog):
    port, home, _ = mosquitto
    pw = {n: (home / f"{n}.pw").read_text().strip() for n in ("coordinator", "local02")}
    cfg = quick_config(data_root, "rounds=1", "data.num_clients=6", "algorithm.name=fedavg",
                       # t = 2 of k = 5: the three survivors hold two shares of each other
                       "secagg.enabled=true", "secagg.threshold=0.3", "deploy.min_devices=2",
                       "deploy.wait_devices_s=2",
                       "deploy.round_timeout_s=20", "deploy.eval_timeout_s=20",
                       "algorithm.finetune_epochs=0",
                       "deploy.round_timeout_min_s=30", "deploy.username=coordinator",
                       f"deploy.password_file={str(home / 'coordinator.pw')!r}")
    faulty, capture = FaultyDevice(port, pw["local02"]), Capture(port, pw["coordinator"])
    res = _beside_local01(cfg, port, home, data_root, tmp_path, [faulty, capture])
    assert faulty.done.is_set()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]
    assert first["status"] == "ok" and first["reported"] == [0, 2, 4], first
    assert first["secure_recovered"] == [5]  # shared, then no valid masked input
    assert first["rejected"].keys() == {"5"}
    log = caplog.text
    assert "client 1 dropped out (advertise: expected 32 bytes" in log
    assert "client 3 dropped out (share keys: no shares)" in log
    assert "no update from 1 clients before the deadline: 5" in log  # not 3: it never shared
    assert all(torch.isfinite(v).all() for v in res.global_weights.values()
               if v.is_floating_point())
    # Each masked input the coordinator's login could read looks uniform on Z_2^32 and says
    # nothing of the update: a chi-squared test of its top byte (256 cells; fails at p < 1e-4)
    assert len(capture.inputs) == 3
    for y in capture.inputs:
        counts = np.bincount((y >> 24).astype(np.int64), minlength=256)
        expected = y.size / 256
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 370, chi2  # 255 degrees of freedom: p ~ 1e-5 at 370


class SilentDevice(FaultyDevice):
    """local02 as a script that advertises its clients' keys (1, 3, 5) and then says nothing,
    online all the while (the evaluation too): the stage of shares waits for it until its
    deadline."""

    def _on_step(self, step: Step) -> None:
        if step.kind == "train" and step.secagg and step.seq != self.seq:
            self.seq = step.seq
            setup, _, _ = setup_from_dict(step.secagg)
            mine = [c for c in (1, 3, 5) if c in setup.graph]
            self._send("keys", {c: keys_to_wire(SecAggClient(c, setup).advertise())
                                for c in mine})
            self.done.set()

    def _on_relay(self, relay: SecAggMessage) -> None:
        pass  # silent


@pytest.mark.slow("a secure round on Mosquitto that waits out a silent device's stage: ~25 s")
def test_a_device_silent_after_its_keys_stalls_the_round_one_stage_deadline(
        data_root, tmp_path, mosquitto, one_thread, caplog):
    """Hardening VI, finding 9: how long a device that is online and silent stalls a secure
    round. The stage of shares waits deploy.round_timeout_min_s (8 s here) for it, drops its
    clients, and the round completes on the other device's; no other stage waits for it (the
    evaluation waits deploy.eval_timeout_s for it, as for any silent device: 4 s here)."""
    port, home, _ = mosquitto
    pw = {n: (home / f"{n}.pw").read_text().strip() for n in ("coordinator", "local02")}
    cfg = quick_config(data_root, "rounds=1", "data.num_clients=6", "algorithm.name=fedavg",
                       "secagg.enabled=true", "secagg.threshold=0.3", "deploy.min_devices=2",
                       "deploy.wait_devices_s=2", "deploy.round_timeout_s=60",
                       "deploy.eval_timeout_s=4", "algorithm.finetune_epochs=0",
                       "deploy.round_timeout_min_s=8", "deploy.username=coordinator",
                       f"deploy.password_file={str(home / 'coordinator.pw')!r}")
    silent = SilentDevice(port, pw["local02"])
    res = _beside_local01(cfg, port, home, data_root, tmp_path, [silent])
    assert silent.done.is_set()
    first = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][0]
    assert first["status"] == "ok" and first["reported"] == [0, 2, 4], first
    assert "no shares stage from local02 within 8 s" in caplog.text
    assert "client 3 dropped out (share keys: no shares)" in caplog.text
    # the stage's 8 s, local01's training and the evaluation's 4 s: never the 60 s deadline
    print(f"the round with a silent device took {first['seconds']:.1f} s")
    assert 8 + 4 <= first["seconds"] < 30, first["seconds"]
    assert all(torch.isfinite(v).all() for v in res.global_weights.values()
               if v.is_floating_point())
