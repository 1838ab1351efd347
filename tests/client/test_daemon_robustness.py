"""The device daemon against garbage on every topic it reads: logged, dropped, never a crash.
On Mosquitto with the project's broker.conf (the device's real broker; no server-side package, so
this also runs on the oldest device stack): the garbage comes from the coordinator's login, the
one account the ACL lets write the topics a device reads."""

import time

import paho.mqtt.client as mqtt

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
