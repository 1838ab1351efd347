"""How long one device login's flood delays another device's messages at the coordinator.

    python bench/flood.py [--seconds 30] [--model convnet] [--clients 3] [--modes mixed updates]
    python bench/flood.py --modes tiny:5000 tiny:20000 tiny [--guard]   # tiny statuses at a rate

Mosquitto runs from the project's broker.conf with its password file and ACL on loopback. The
coordinator's side is the real one: a ServerSession and its Inbox (the network thread that reads
every device's messages), opened for a run of `--model`'s update size where dev01 (honest) and
dev03 (the attacker) each hold `--clients` clients. dev01 publishes its status every 0.2 s,
stamped with when it was sent; the bench records when the coordinator's network thread reads
each one. First a quiet phase, then bench/flooder.py floods dev03's own topics for `--seconds`
(per mode). Printed per phase: dev01's status delays (median, 99th percentile, worst), how many
of them arrived, MB the coordinator received, the coordinator process's CPU per second, and what
the inbox dropped unread (flooded) or refused. dev03's budget is printed beside them: what one
login may take of the network thread at once and per second (server/pools/mqtt/budget.py).

With --guard the broker loads its dynamic-security plugin and the coordinator's flood guard
(server/pools/mqtt/guard.py) disables dev03's login once its messages keep being dropped: the
phase's line then says when it was disabled. Without it the budget alone bounds the flood.

Everything (broker, coordinator, devices, flooder) shares this machine's cores.
"""

from __future__ import annotations

import argparse
import getpass
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from fedseq.common.data.catalog import INPUT_SHAPES, NUM_CLASSES
from fedseq.common.models import build_model, get_blocks
from fedseq.common.protocol.messages import Assignment, DeviceStatus, RunConfig, Step
from fedseq.common.protocol.tensors import frame_size
from fedseq.common.protocol.topics import Topics
from fedseq.server.ops.broker import write_local_mosquitto
from fedseq.server.pools.mqtt.broker_session import ServerSession

#: the flood guard's password for this bench's broker
GUARD_SECRET = secrets.token_hex(16)

ROOT = Path(__file__).resolve().parent.parent
T = Topics()
RUN = "flood-bench"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Honest:
    """dev01: publishes its status every `every` seconds, its send time in memory_mb (ms)."""

    def __init__(self, port: int, password: str, began: float, every: float = 0.2):
        self.began, self.every = began, every
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-dev01")
        self.c.username_pw_set("dev01", password)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.stop = threading.Event()
        self.sent = 0
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self.stop.wait(self.every):
            ms = int((time.monotonic() - self.began) * 1000)
            self.c.publish(T.device_status("dev01"), DeviceStatus(
                device="dev01", state="online", memory_mb=ms).encode(), qos=1)
            self.sent += 1

    def close(self) -> None:
        self.stop.set()
        self.c.loop_stop()
        self.c.disconnect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--quiet", type=float, default=10.0)
    ap.add_argument("--model", default="convnet")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["mixed", "updates"],
                    help="mixed, updates, tiny or tiny:RATE (messages a second)")
    ap.add_argument("--guard", action="store_true", help="the broker-side flood guard on")
    args = ap.parse_args()

    net = build_model(args.model, INPUT_SHAPES["fmnist"], NUM_CLASSES["fmnist"])
    update = frame_size(get_blocks(net, net.spec.blocks)) + 4096
    home = Path(tempfile.mkdtemp(prefix="fedseq-flood-"))
    port = free_port()
    users = {"coordinator": "c-secret", "dev01": "d1-secret", "dev03": "d3-secret"}
    for u, pw in users.items():
        (home / f"{u}.pw").write_text(pw + "\n")
    conf = write_local_mosquitto(home, port, users, ROOT / "broker.conf",
                                 ROOT / "deploy/mosquitto/fedseq.acl", getpass.getuser(),
                                 guard=GUARD_SECRET if args.guard else None)
    broker = subprocess.Popen(["mosquitto", "-c", str(conf)], stderr=subprocess.DEVNULL)
    time.sleep(0.5)

    session = ServerSession(T, RUN, f"mqtt://127.0.0.1:{port}", "coordinator", "c-secret")
    inbox = session.inbox
    k = args.clients
    inbox.open({**{c: "dev01" for c in range(k)}, **{c: "dev03" for c in range(k, 2 * k)}},
               update)
    began = time.monotonic()
    delays: list[tuple[float, float]] = []  # (read at, delay s)
    read = inbox.on_message

    last_dev03: list[float] = [0.0]

    def timed(topic: str, payload: bytes) -> None:
        if "/dev03/" in topic:
            last_dev03[0] = time.monotonic()
        if topic == T.device_status("dev01"):
            now = time.monotonic()
            sent = json.loads(payload)["memory_mb"] / 1000
            delays.append((now - began, now - began - sent))
        read(topic, payload)

    inbox.on_message = timed  # type: ignore[method-assign]  # a bench's probe
    session.start()
    guard = None
    if args.guard:
        from fedseq.server.pools.mqtt.guard import FloodGuard

        guard = FloodGuard(f"mqtt://127.0.0.1:{port}", "fedseq-guard", GUARD_SECRET, None)
        guard.start()
        inbox.on_flood = guard.dropped
    session.retain(T.run_config, RunConfig(run_id=RUN, config={}).encode())
    inbox.collect(1)
    session.retain(T.step, Step(run_id=RUN, seq=1, kind="train", round=0,
                                clients=list(range(2 * k))).encode())
    session.retain(T.assignment("dev03"), Assignment(run_id=RUN, device="dev03",
                                                    clients=list(range(k, 2 * k))).encode())
    honest = Honest(port, "d1-secret", began)
    a = inbox.allowance("dev03")
    print(f"{args.model}: update frame {update / 1e6:.1f} MB; dev01 and dev03 hold {k} clients "
          f"each; dev03's budget: {a.burst_bytes / 1e6:.1f} MB and {a.burst_cpu * 1e3:.0f} ms of "
          f"the network thread at once, {a.rate_bytes / 1e6:.1f} MB/s and "
          f"{a.rate_cpu * 1e3:.0f} ms/s")
    print(f"{'phase':<16} {'dev01 statuses':>14} {'median ms':>10} {'p99 ms':>8} {'worst ms':>9} "
          f"{'MB in':>8} {'coord CPU/s':>11} {'flooded':>8} {'dropped':>8}  flooder")

    def phase(name: str, seconds: float, mode: str | None) -> None:
        t0, cpu0, in0 = time.monotonic() - began, time.process_time(), session.link.bytes_in
        fl0, dr0, n0 = inbox.flooded, inbox.dropped, len(delays)
        said = ""
        g0 = guard.disabled_total if guard is not None else 0
        if mode is None:
            time.sleep(seconds)
        else:
            kind, _, rate = mode.partition(":")
            flood = subprocess.run(
                [sys.executable, str(ROOT / "bench" / "flooder.py"), "--port", str(port), "--login",
                 "dev03", "--password-file", str(home / "dev03.pw"), "--seconds", str(seconds),
                 "--mode", kind, "--rate", rate or "0", "--frame-mb", str(max(1, update >> 20))],
                capture_output=True, text=True, timeout=seconds + 120)
            said = flood.stdout.strip().removeprefix("flooder dev03: ")
            time.sleep(2.0)  # what the flood left in flight
            if guard is not None:
                said += f"; dev03 disabled {guard.disabled_total - g0}x by the guard"
                if guard.disabled_at is not None and guard.disabled_total > g0:
                    said += (f" {guard.disabled_at - began - t0:.2f} s into the flood, its last "
                             f"message read {last_dev03[0] - guard.disabled_at:.2f} s after")
                guard.enable_all()  # the next phase starts with dev03 let in
        wall = time.monotonic() - began - t0
        mine = [d for _, d in delays[n0:]]
        if not mine:
            print(f"{name:<16} {0:>14} (no status of dev01 was read)")
            return
        q = statistics.quantiles(mine, n=100) if len(mine) > 1 else mine * 99
        print(f"{name:<16} {len(mine):>14} {statistics.median(mine) * 1e3:>10.1f} "
              f"{q[98] * 1e3:>8.1f} {max(mine) * 1e3:>9.1f} "
              f"{(session.link.bytes_in - in0) / 1e6:>8.0f} "
              f"{(time.process_time() - cpu0) / wall:>11.2f} {inbox.flooded - fl0:>8} "
              f"{inbox.dropped - dr0:>8}  {said}")

    try:
        phase("quiet", args.quiet, None)
        for mode in args.modes:
            phase(f"flood {mode}", args.seconds, mode)
            phase("quiet after", args.quiet / 2, None)
    finally:
        honest.close()
        if guard is not None:
            guard.stop()
        session.close(lambda: None)
        broker.terminate()
        broker.wait(10)


if __name__ == "__main__":
    main()
