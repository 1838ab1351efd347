"""The coordinator's serial cost for one 2.3 MB FedAvg update of the CNN (Fashion-MNIST testbed):
reassembly of its chunks, sha256, decode, validation against the round's contract, and the
aggregation step, each timed separately over many updates. Target: under 5 ms per update.
Then what a device does per client and round beyond training: decode the received weights,
load them, copy the blocks before and after, the deltas, encode, sha256 and chunking.

    python bench/validation.py [--updates 60] [--rule mean]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.robust import build_rule
from fedseq.common.config import AggregationConfig
from fedseq.common.data.federated import ClientShard, FederatedData
from fedseq.common.models import build_model, get_blocks
from fedseq.common.protocol.frames import FramePool, split_frame
from fedseq.common.protocol.link import keep_large_buffers
from fedseq.common.protocol.messages import UpdateHeader
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors
from fedseq.server.rounds.contract import round_contract


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=60)
    ap.add_argument("--rule", default="mean", choices=["mean", "clipped-mean", "trimmed-mean", "median"])
    args = ap.parse_args()
    torch.set_num_threads(1)  # the coordinator's network/round thread is one thread
    keep_large_buffers()  # as in the coordinator and the daemon (their Link sets it)
    model = build_model("cnn", (1, 28, 28), 10, generator_seed=0)
    blocks = model.spec.blocks
    weights = get_blocks(model, blocks)
    n_train = 1500
    data = FederatedData(torch.zeros(1, 1, 28, 28), torch.zeros(n_train, dtype=torch.int64), 10,
                         (ClientShard(0, torch.arange(n_train), torch.arange(0)),))
    contract = round_contract(0, [0], blocks, weights, data, None, 1e4)
    g = torch.Generator().manual_seed(0)
    deltas = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in weights.items()}
    frame = encode_tensors(deltas)
    digest = hashlib.sha256(frame).hexdigest()
    parts = [bytes(p) for p in split_frame(frame)]
    heads = [UpdateHeader(run_id="r", seq=1, round=0, client=0, device="d", num_samples=n_train,
                          chunk=i, chunks=len(parts), size=len(frame), sha256=digest)
             for i in range(len(parts))]
    times: dict[str, list[float]] = {"reassemble+sha256": [], "decode": [], "validate": [],
                                     "aggregate": []}
    agg = build_rule(AggregationConfig(rule=args.rule)).round()
    pool = FramePool(max_frame=len(frame) + 4096, per_sender=4 * len(frame))
    for i in range(args.updates):
        t0 = time.perf_counter()
        for h, p in zip(heads, parts, strict=True):
            out = pool.add("d", (0, i), h, p)
        t1 = time.perf_counter()
        assert out is not None
        tensors = decode_tensors(out, copy=False, check_finite=False)
        t2 = time.perf_counter()
        update = ClientUpdate(0, 0, tensors, n_train)
        assert contract.admit(update) is None
        t3 = time.perf_counter()
        agg.add(tensors, {b: float(n_train) for b in blocks}, i)
        t4 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[k].append(v * 1000)
    applies = []
    for _ in range(7):
        t5 = time.perf_counter()
        agg.apply(weights)
        applies.append((time.perf_counter() - t5) * 1000)
    apply_ms = statistics.median(applies)
    print(f"update frame: {len(frame):,} bytes in {len(parts)} chunks; {args.updates} updates; "
          f"rule {args.rule}; 1 thread")
    total = print_times(times, "total per update")
    print(f"  apply after the last update: median {apply_ms:.2f} ms (once per round)")
    print(f"coordinator per update: {total:.2f} ms, target < 5 ms: "
          f"{'met' if total < 5 else 'NOT met'}")
    device_side(model, weights, frame, args.updates)


def device_side(model, weights, frame: bytes, n: int) -> None:
    from fedseq.common.models import set_weights

    blocks = model.spec.blocks
    # what the coordinator published (all blocks: FedAvg), in a writable buffer as the daemon's
    # frame pool hands it over
    received = bytearray(encode_tensors(weights))
    times: dict[str, list[float]] = {"decode weights": [], "load into model": [],
                                     "copy before/after": [], "deltas": [],
                                     "encode": [], "sha256+chunks": []}
    for _ in range(n):
        t0 = time.perf_counter()
        w = decode_tensors(received, copy=False)
        t1 = time.perf_counter()
        set_weights(model, w)
        t2 = time.perf_counter()
        before = get_blocks(model, blocks)
        after = get_blocks(model, blocks)  # (training happens between these two)
        t3 = time.perf_counter()
        deltas = {k: after[k] - before[k] for k in after}
        t4 = time.perf_counter()
        out = encode_tensors(deltas)
        t5 = time.perf_counter()
        hashlib.sha256(out).hexdigest()
        _ = [bytes(p) for p in split_frame(out)]
        t6 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
            times[k].append(v * 1000)
    print(f"device, per client and round beyond training ({len(frame):,}-byte update, 1 thread):")
    print_times(times, "total")
    print("  (plus paho's own copies and socket writes)")


def print_times(times: dict[str, list[float]], total_name: str) -> float:
    """Median and p90 of each part; returns the sum of the medians."""
    total = 0.0
    for k, v in times.items():
        med = statistics.median(v)
        total += med
        print(f"  {k:<18} median {med:6.2f} ms   p90 {sorted(v)[int(0.9 * len(v))]:6.2f} ms")
    print(f"  {total_name:<18} median {total:6.2f} ms")
    return total


if __name__ == "__main__":
    main()
