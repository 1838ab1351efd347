"""A hostile device login that floods its own topics with maximum-size junk (tests and
bench/flood.py; not part of any install).

    python bench/flooder.py --port P --login local03 --password-file F [--seconds 60]
                            [--mode mixed|updates] [--root fedseq]

It holds one device's login on a broker with the project's ACL, so it may write only that
device's four topics, and sends as fast as the broker takes it, for `--seconds` or until the
coordinator's run ends (its step turns idle):
- mixed: junk statuses, descriptions and evaluations just under the broker's packet limit
  (2 MiB, JSON as costly to parse as its size allows), oversized update chunks, and update
  chunks with valid-looking headers for its own clients of the current step (1 MiB of random
  data, a frame size the run allows, a sha256 that never matches: the chunks are kept until the
  frame is given up), and complete one-chunk frames whose sha256 matches but whose bytes are no
  tensor frame;
- tiny: 7-byte statuses, at `--rate` a second or as fast as the connection goes (a disabled
  login's connection is closed by the broker; paho tries to log in again, which is refused);
- updates: complete frames of `--frame-mb` MiB that are valid tensor frames (their sha256
  matches, they decode) but no update of the round, again and again for each of its clients:
  what the coordinator keeps until it folds or refuses them (its frame pool, its spool file).
  (Frames that never complete are left out here: a login's partial frames are capped, and once
  at its cap they would keep its complete ones out.)
Prints one line: messages and MB sent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from fedseq.common.protocol.messages import PROTOCOL_VERSION

CHUNK = 1 << 20
BIG = 2_000_000  # under broker.conf's max_packet_size (2 MiB) with the topic and header


def tensor_frame(size: int) -> bytes:
    """A safetensors frame of about `size` bytes: one float32 tensor of zeros."""
    n = size // 4
    header = json.dumps({"junk": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + bytes(4 * n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--login", required=True)
    ap.add_argument("--password-file", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--mode", choices=("mixed", "updates", "tiny"), default="mixed")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="tiny: messages a second (0: as fast as the connection goes)")
    ap.add_argument("--frame-mb", type=int, default=13, help="the frame size its chunks claim")
    ap.add_argument("--root", default="fedseq")
    args = ap.parse_args()
    me, root = args.login, args.root
    state: dict = {"run": None, "step": None, "clients": []}

    def on_message(client, userdata, msg):
        try:
            body = json.loads(msg.payload)
        except ValueError:
            return
        if msg.topic == f"{root}/run/config":
            state["run"] = body.get("run_id")
        elif msg.topic == f"{root}/step":
            state["step"] = body
        elif msg.topic.endswith("/assign"):
            state["clients"] = body.get("clients", [])

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"flood-{os.getpid()}")
    c.username_pw_set(me, args.password_file.read_text().strip())
    c.on_message = on_message
    refused = [0]

    def on_connect(cl, u, f, rc, p):
        if rc.is_failure:  # its login disabled at the broker (the flood guard)
            refused[0] += 1
            return
        cl.subscribe([(f"{root}/run/config", 1), (f"{root}/step", 1),
                      (f"{root}/device/{me}/assign", 1)])

    c.on_connect = on_connect
    c.max_queued_messages_set(32)
    c.connect("127.0.0.1", args.port)
    c.loop_start()
    # the costliest JSON of its size to parse that we know of: 666,000 empty objects (a fedseq
    # before hardening IV spent 0.4 s of its network thread on one, and 50 ms more to read the
    # refused message's protocol version), under another protocol version
    junk = b'{"v":4,"device":"' + me.encode() + b'","x":[' + b"{}," * ((BIG - 64) // 3) + b'{}]}'
    data = os.urandom(CHUNK)
    one = os.urandom(CHUNK - 64)
    frame = tensor_frame(args.frame_mb * CHUNK - 4096)
    sent = [0, 0]
    began = time.monotonic()
    started = False

    def publish(topic: str, payload: bytes) -> None:
        while True:
            rc = c.publish(topic, payload, qos=0).rc
            if rc == mqtt.MQTT_ERR_SUCCESS:
                break
            # paho's queue is full (the broker is not taking more yet), or the connection is
            # down (paho's thread reconnects): wait, and count only what went out
            time.sleep(0.001 if rc == mqtt.MQTT_ERR_QUEUE_SIZE else 0.1)
            if time.monotonic() - began > args.seconds:
                return
        sent[0] += 1
        sent[1] += len(payload)

    def chunk(client: int, seq: int, i: int, chunks: int, size: int, sha: str, part: bytes) -> bytes:
        head = json.dumps({"v": PROTOCOL_VERSION, "run_id": state["run"], "seq": seq,
                           "round": (state["step"] or {}).get("round", 0), "client": client,
                           "device": me, "num_samples": 1, "chunk": i, "chunks": chunks,
                           "size": size, "sha256": sha}, separators=(",", ":")).encode()
        return len(head).to_bytes(4, "big") + head + part

    n = 0
    while time.monotonic() - began < args.seconds:
        step = state["step"]
        if step is None or state["run"] is None or step.get("run_id") != state["run"]:
            time.sleep(0.05)
            continue
        if step.get("kind") == "idle" and started:
            break  # the run ended
        if args.mode == "tiny" and refused[0]:
            time.sleep(0.1)  # disabled: paho keeps trying to log in
            continue
        started = True
        if args.mode == "tiny":  # 7-byte statuses, paced or not (hardening V, finding 3)
            publish(f"{root}/device/{me}/status", b"1234567")
            if args.rate:
                time.sleep(max(0.0, began + sent[0] / args.rate - time.monotonic()))
            continue
        seq, mine = step.get("seq", 0), state["clients"] or [0]
        n += 1
        if args.mode == "mixed":
            publish(f"{root}/device/{me}/status", junk)
            publish(f"{root}/device/{me}/info", junk)
            publish(f"{root}/eval/{me}", junk)
            publish(f"{root}/update/{me}", junk)  # an oversized chunk message
        client = mine[n % len(mine)]
        size = args.frame_mb * CHUNK
        sha = hashlib.sha256(str(n).encode()).hexdigest()  # never the frame's
        if args.mode == "mixed":
            for i in range(min(3, args.frame_mb)):  # the start of a frame that never completes
                publish(f"{root}/update/{me}", chunk(client, seq, i, args.frame_mb, size, sha,
                                                     data))
            # a complete one-chunk frame whose sha256 matches: no tensors inside
            publish(f"{root}/update/{me}", chunk(client, seq, 0, 1, len(one),
                                                 hashlib.sha256(one).hexdigest(), one))
        else:  # a whole valid tensor frame, no update of the round
            digest = hashlib.sha256(frame).hexdigest()
            parts = [frame[i:i + CHUNK] for i in range(0, len(frame), CHUNK)]
            for i, part in enumerate(parts):
                publish(f"{root}/update/{me}", chunk(client, seq, i, len(parts), len(frame),
                                                     digest, part))
    c.loop_stop()
    c.disconnect()
    print(f"flooder {me}: {sent[0]} messages, {sent[1] / 1e6:.0f} MB in "
          f"{time.monotonic() - began:.0f} s" + (f", {refused[0]} logins refused" if refused[0] else ""),
          file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
