"""The device daemon against garbage on every topic it reads: logged, dropped, never a crash.
On Mosquitto with the project's broker.conf (the device's real broker; no server-side package, so
this also runs on the oldest device stack): the garbage comes from the coordinator's login, the
one account the ACL lets write the topics a device reads."""

import time

import paho.mqtt.client as mqtt
import pytest

from fedseq.client.daemon import DeviceDaemon
from fedseq.common.protocol.topics import Topics


def test_garbage_is_dropped_and_daemon_stays_up(tmp_path, caplog, mosquitto):
    port, _, _ = mosquitto
    daemon = DeviceDaemon("local01", f"mqtt://127.0.0.1:{port}", None, tmp_path, "cpu",
                          username="local01", password="d1-secret")
    try:
        daemon.start(attempts=3)
        t = Topics()
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="evil")
        pub.username_pw_set("coordinator", "c-secret")
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        garbage = [
            (t.run_config, b"{not json"), (t.step, b'{"v": 1, "kind": "explode"}'),
            (t.assignment("local01"), b"\x00\xff"), (t.weights("fc1", 0), b"\x00\x00\x00\x09garbage"),
            (t.weights("fc1", 0), b""), (t.control, b"[]"),
        ]
        wanted = {topic for topic, payload in garbage if payload}

        def dropped() -> set:
            return {topic for topic in wanted for r in caplog.records
                    if f"dropped message on {topic}:" in r.message}

        # Sent again until each was dropped: the daemon's subscriptions may not be in place yet
        # when start() returns (the broker acknowledges them later; under load, after the first
        # messages), and under load it takes a while to get through them (a fixed 1 s flaked).
        deadline = time.monotonic() + 60
        while dropped() != wanted and time.monotonic() < deadline:
            for topic, payload in garbage:
                pub.publish(topic, payload, qos=1).wait_for_publish(30)
            until = time.monotonic() + 2.0
            while dropped() != wanted and time.monotonic() < until:
                time.sleep(0.1)
        pub.loop_stop()
        assert daemon.worker.is_alive() and daemon.link.connected.is_set()
        assert daemon.run is None and daemon.step is None
        assert dropped() == wanted
    finally:
        daemon.stop()


@pytest.fixture(params=["mosquitto", "amqtt"])
def broker_logins(request, tmp_path):
    """(url, coordinator's login, local01's login) on Mosquitto with the project's broker.conf,
    or on the embedded amqtt broker (the server extra: skipped on a device stack)."""
    if request.param == "mosquitto":
        port, _, _ = request.getfixturevalue("mosquitto")
        yield (f"mqtt://127.0.0.1:{port}", ("coordinator", "c-secret"),
               ("local01", "d1-secret"))
        return
    pytest.importorskip("amqtt")
    from fedseq.server.ops.broker import EmbeddedBroker

    broker = EmbeddedBroker("127.0.0.1", 0)  # loopback, anonymous
    broker.start()
    try:
        yield broker.url, (None, None), (None, None)
    finally:
        broker.stop()


def test_weights_chunks_lost_for_this_device_are_fetched_again(tmp_path, caplog, broker_logins,
                                                               monkeypatch):
    """A chunk the broker dropped for this device (its queue overflowed) is not published again
    while its block is unchanged (FedSeq's frozen blocks): after RESYNC_S without a weights chunk
    the daemon subscribes again, the broker (Mosquitto, or the embedded amqtt) re-sends the
    retained chunks and the block completes. The loss is a delivery the device drops once, as if
    it never came."""
    import hashlib

    import torch

    from fedseq.client import session as mod
    from fedseq.common.config import load_config
    from fedseq.common.protocol.frames import pack_chunk, split_frame
    from fedseq.common.protocol.messages import RunConfig, Step, WeightsHeader
    from fedseq.common.protocol.tensors import encode_tensors

    monkeypatch.setattr(mod, "RESYNC_S", 1.0)
    real_unpack, lost = mod.unpack_chunk, []

    def lossy(payload, header_type):
        head, data = real_unpack(payload, header_type)
        if head.chunk == 1 and not lost:
            lost.append(head.chunk)
            raise mod.ProtocolError("lost (test)")
        return head, data

    monkeypatch.setattr(mod, "unpack_chunk", lossy)
    url, (c_user, c_pw), (d_user, d_pw) = broker_logins
    port = int(url.rsplit(":", 1)[1])
    daemon = DeviceDaemon("local01", url, tmp_path / "data", tmp_path, "cpu",
                          username=d_user, password=d_pw)
    t = Topics()
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="coordinator-test")
    if c_user is not None:
        pub.username_pw_set(c_user, c_pw)
    try:
        daemon.start(attempts=3)
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        cfg = load_config(None, ["algorithm.name=fedavg", "model.name=cnn"])
        pub.publish(t.run_config, RunConfig(run_id="r1", config=cfg.model_dump(mode="json")
                                            ).encode(), qos=1, retain=True).wait_for_publish(10)
        frame = encode_tensors({"fc1.weight": torch.ones(512, 1024)})  # 2 MiB: 3 chunks
        chunks = split_frame(frame)
        for i, chunk in enumerate(chunks):
            head = WeightsHeader(run_id="r1", block="fc1", version=1, chunk=i, chunks=len(chunks),
                                 size=len(frame), sha256=hashlib.sha256(frame).hexdigest())
            pub.publish(t.weights("fc1", i), pack_chunk(head, bytes(chunk)), qos=1,
                        retain=True).wait_for_publish(10)
        step = Step(run_id="r1", seq=1, kind="evaluate", clients=[99], versions={"fc1": 1})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # (sent again: the subscriptions may not be in place)
            pub.publish(t.step, step.encode(), qos=1, retain=True).wait_for_publish(10)
            with daemon.session.cond:
                held = daemon.session.blocks.get("r1", {}).get("fc1")
            if held is not None:
                break
            time.sleep(0.5)
        assert lost == [1]
        assert held is not None and held[0] == 1 and torch.equal(held[1]["fc1.weight"],
                                                                torch.ones(512, 1024))
        assert any("asking the broker for the retained blocks again" in r.message
                   for r in caplog.records)
    finally:
        pub.loop_stop()
        daemon.stop()
