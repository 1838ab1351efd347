"""paho-mqtt's own CPU cost of moving one 2.3 MB frame (the CNN's update) through a loopback
Mosquitto, in 1 MiB QoS-1 chunks as fedseq sends them: publisher and subscriber processes, with
glibc's default malloc thresholds and with `keep_large_buffers()` (what every fedseq Link sets).

    python bench/paho_frame.py [--frames 40] [--chunk 1048576]

Prints CPU milliseconds per frame on each side and the ratio default/tuned. This is the floor
the transport puts under bench/mqtt_round.py's round overhead before any of fedseq's own work.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fedseq.common.protocol.link import keep_large_buffers

SIZE = 2_328_712  # the CNN's FedAvg update frame


def subscriber(port: int, messages: int, tuned: bool) -> None:
    if tuned:
        keep_large_buffers()
    done = threading.Event()
    count = [0]

    def on_message(client, userdata, msg) -> None:
        count[0] += 1
        if count[0] == messages:
            done.set()

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sub-{os.getpid()}")
    c.on_message = on_message
    c.connect("127.0.0.1", port)
    c.subscribe("bench/#", qos=1)
    c.loop_start()
    time.sleep(1.0)
    print("ready", flush=True)
    start = time.process_time()
    done.wait(300)
    print(f"{1000 * (time.process_time() - start):.3f}", flush=True)
    c.loop_stop()


def publisher(port: int, frames: int, chunk: int, tuned: bool) -> tuple[float, float]:
    """(publisher CPU ms per frame, subscriber CPU ms per frame)."""
    chunks = -(-SIZE // chunk)
    sub = subprocess.Popen([sys.executable, __file__, "--subscriber", str(port),
                            str(frames * chunks), str(int(tuned))], stdout=subprocess.PIPE, text=True)
    assert sub.stdout is not None
    sub.stdout.readline()
    if tuned:
        keep_large_buffers()  # idempotent per process: the untuned run goes first
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"pub-{int(tuned)}")
    c.connect("127.0.0.1", port)
    c.loop_start()
    time.sleep(0.3)
    frame = os.urandom(SIZE)
    view = memoryview(frame)
    spent = 0.0
    for _ in range(frames):
        start = time.process_time()
        infos = [c.publish(f"bench/{j}", bytes(view[j * chunk:(j + 1) * chunk]), qos=1)
                 for j in range(chunks)]
        for info in infos:
            info.wait_for_publish()
        spent += time.process_time() - start
        time.sleep(0.05)  # one frame at a time, as a device sends its update
    received = float(sub.stdout.readline())
    sub.wait()
    c.loop_stop()
    c.disconnect()
    return 1000 * spent / frames, received / frames


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--subscriber":
        subscriber(int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--chunk", type=int, default=1 << 20)
    args = ap.parse_args()
    from mqtt_round import start_mosquitto  # bench/ is on sys.path; the subscriber needs no torch

    with tempfile.TemporaryDirectory() as tmp:
        broker, url = start_mosquitto(Path(tmp))
        port = int(url.rsplit(":", 1)[1])
        try:
            base = publisher(port, args.frames, args.chunk, tuned=False)
            tuned = publisher(port, args.frames, args.chunk, tuned=True)
        finally:
            broker.terminate()
            broker.wait()
    print(f"{SIZE:,}-byte frame in {-(-SIZE // args.chunk)} chunks of {args.chunk:,} bytes, QoS 1, "
          f"{args.frames} frames")
    for side, i in (("publish", 0), ("receive", 1)):
        print(f"  {side}: default malloc {base[i]:.2f} ms/frame, keep_large_buffers {tuned[i]:.2f} "
              f"ms/frame -> {base[i] / tuned[i]:.2f}x less CPU")


if __name__ == "__main__":
    main()
