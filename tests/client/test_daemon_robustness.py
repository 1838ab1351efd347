"""The device daemon against garbage on every topic it reads: logged, dropped, never a crash."""

import time

import paho.mqtt.client as mqtt

from fedseq.client.daemon import DeviceDaemon
from fedseq.common.protocol.topics import Topics
from fedseq.server.broker import EmbeddedBroker


def test_garbage_is_dropped_and_daemon_stays_up(tmp_path, caplog):
    broker = EmbeddedBroker("127.0.0.1", 0)
    broker.start()
    daemon = DeviceDaemon("dev01", broker.url, None, tmp_path, "cpu")
    try:
        daemon.start(attempts=3)
        t = Topics()
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="evil")
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        for topic, payload in [
            (t.run_config, b"{not json"), (t.step, b'{"v": 1, "kind": "explode"}'),
            (t.assignment("dev01"), b"\x00\xff"), (t.weights("fc1", 0), b"\x00\x00\x00\x09garbage"),
            (t.weights("fc1", 0), b""), (t.control, b"[]"),
        ]:
            pub.publish(topic, payload, qos=1).wait_for_publish(5)
        time.sleep(1.0)
        pub.loop_stop()
        assert daemon.worker.is_alive() and daemon.link.connected.is_set()
        assert daemon.run is None and daemon.step is None
        assert sum("dropped message" in r.message for r in caplog.records) >= 5
    finally:
        daemon.stop()
        broker.stop()
