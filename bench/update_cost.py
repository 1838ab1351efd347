"""The coordinator's CPU per client update, stage by stage, without a broker: what each update
costs beyond paho's own reading of its bytes (bench/paho_frame.py measures that part).

    python bench/update_cost.py [--model convnet] [--updates 60]

Builds `--updates` FedAvg updates of the model (random deltas) as a device sends them (1 MiB
chunks with their headers), then, in one thread with the coordinator's malloc settings, times per
update: `inbox` (Inbox.on_message for every chunk: header parsing, reassembly, the frame's
sha256, decoding the tensors), `check` (the round contract), `fold` (the weighted float64 sum)
and `norm` (the update's L2 norm, for the outlier check). The first 10 updates warm up. Printed
beside them: sha256 alone over one frame, the part of `inbox` no faster hash could save.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch

from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.algorithms.robust import update_norm
from fedseq.common.models import block_of, build_model
from fedseq.common.protocol.frames import CHUNK_BYTES, pack_chunk, split_frame
from fedseq.common.protocol.link import keep_large_buffers
from fedseq.common.protocol.messages import UpdateHeader
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.server.pools.mqtt.inbox import Inbox
from fedseq.server.rounds.contract import RoundContract

WARM = 10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="convnet")
    ap.add_argument("--updates", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    keep_large_buffers()  # as every fedseq Link sets it
    n = args.updates + WARM
    ref = {k: v.detach().clone() for k, v in build_model(args.model, (1, 28, 28), 10).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    messages, size = [], 0
    for c in range(n):
        frame = encode_tensors({k: (torch.rand(v.shape, generator=g) - 0.5) * 1e-3
                                for k, v in ref.items()})
        size, digest, parts = len(frame), hashlib.sha256(frame).hexdigest(), split_frame(frame)
        meta = dict(run_id="r", seq=1, round=0, client=c, device=f"d{c}", num_samples=100,
                    local_correct=5, local_total=10, chunks=len(parts), size=size, sha256=digest)
        messages.append([pack_chunk(UpdateHeader(chunk=i, **meta), p) for i, p in enumerate(parts)])
    topics = Topics()
    inbox = Inbox(topics, "r")
    inbox.open({c: f"d{c}" for c in range(n)}, size + 4096)
    inbox.collect(1)
    contract = RoundContract(0, frozenset(range(n)), ref, dict.fromkeys(range(n), 100), None,
                             10.0, dict.fromkeys(range(n), 10))
    weights = dict.fromkeys({block_of(k) for k in ref}, 100.0)
    acc = WeightedDeltaSum()
    spent = dict.fromkeys(("inbox", "check", "fold", "norm"), 0.0)
    for c in range(n):
        t0 = time.perf_counter()
        for payload in messages[c]:
            inbox.on_message(topics.update(f"d{c}"), payload)
        ev = inbox.next_event(0)
        t1 = time.perf_counter()
        assert ev is not None and contract.admit(ev.update) is None
        t2 = time.perf_counter()
        acc.add(ev.update.deltas, weights, c)
        t3 = time.perf_counter()
        update_norm(ev.update.deltas)
        t4 = time.perf_counter()
        inbox.release(ev)
        if c >= WARM:
            for k, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                spent[k] += dt
    buf = bytearray(size)
    t = time.perf_counter()
    for _ in range(20):
        hashlib.sha256(buf).hexdigest()
    sha = (time.perf_counter() - t) / 20
    print(f"{args.model}: {size:,}-byte update in {len(messages[0])} chunks of {CHUNK_BYTES:,} "
          f"bytes, {args.updates} updates, ms per update:")
    print("  " + ", ".join(f"{k} {v / args.updates * 1e3:.2f}" for k, v in spent.items())
          + f"; total {sum(spent.values()) / args.updates * 1e3:.2f}"
          + f" (sha256 alone {sha * 1e3:.2f})")


if __name__ == "__main__":
    main()
