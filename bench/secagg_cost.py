"""What [secagg] (SecAgg+, common/secagg.py) costs a round: per client, the bytes it sends in the
four stages against the plain float32 upload, and its CPU seconds per stage (key agreement and
sharing, masking, unmasking); on the coordinator, its CPU seconds (relaying, summing, recovering
the dropped clients' masks and the survivors' self-masks); for n clients in a round, with no
dropout and with a share of the clients dropping after they shared their keys (the costly case:
each one's masks are recomputed from its neighbours' shares).

The vector is the testbed ConvNet's whole upload (FedAvg: every block, one weight per tensor),
its values a random update in [-0.01, 0.01]. One process, one thread, every client in turn, so the
per-client figures are each client's own; the plain round's client CPU is what it costs to train
(bench/dp_cost.py), not measured here.

    python bench/secagg_cost.py [--clients 10 30 100 300] [--dropout 0 0.1] [--bits 32 16]
                                [--checks on off] [--junk 0 1 3]

`--bits 16`: the 16-bit ring that wire.up = "int8" masks in (2 bytes a value). `--checks off`:
shares without their owners' checks (a round of devices of an older fedseq), whose secrets
the coordinator finds by trying subsets. `--junk J`: the J lowest client ids reveal a random
share of the right kind for every neighbour in stage 4 (the audit's attack); a round that
cannot be unmasked then says so in its line.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fedseq.common import secagg as S
from fedseq.common.models import build_model
from fedseq.common.protocol.tensors import frame_size


def measure(n: int, dropout: float, layout: S.Layout, plain_bytes: int, bits: int,
            checked: bool = True, junk: int = 0) -> str:
    clients = list(range(n))
    k = S.degree_for(n)
    t = S.threshold_for(k, 0.5)
    setup = S.Setup(round=0, graph=S.neighbours(clients, k, 0), threshold=t,
                    length=S.vector_length(layout), scale=S.scale_for(n, 1324.0, 1.0, bits),
                    clip_range=1.0, ring_bits=bits, checked=checked)
    rng = np.random.default_rng(0)
    x = S.encode(rng.uniform(-0.01, 0.01, setup.length) * 1324.0, setup.scale, bits)
    cpu = {"keys": 0.0, "mask": 0.0, "unmask": 0.0}
    sent = {c: 0 for c in clients}
    server_s = 0.0

    def timed(stage, f, *args):
        t0 = time.process_time()
        out = f(*args)
        cpu[stage] += time.process_time() - t0
        return out

    t0 = time.process_time()
    devices = {c: S.SecAggClient(c, setup) for c in clients}
    cpu["keys"] += time.process_time() - t0
    server = S.SecAggServer(setup)
    ads = {c: devices[c].advertise() for c in clients}
    for c in clients:
        sent[c] += 2 * S.KEY_BYTES
    s0 = time.process_time()
    keys = server.advertised(ads)
    server_s += time.process_time() - s0
    shares = {}
    for c in clients:
        shares[c] = timed("keys", devices[c].share_keys, keys[c])
        sent[c] += len(shares[c][0]) * (S.CIPHER_BYTES + (64 if checked else 0)) + 32
    s0 = time.process_time()
    routed = server.shared(shares)
    server_s += time.process_time() - s0
    gone = set(rng.choice(clients, int(round(dropout * n)), replace=False).tolist())
    for c in clients:
        if c in gone:
            continue
        y = timed("mask", devices[c].masked_input, x, routed[c], server.checks_for(c))
        sent[c] += y.nbytes
        s0 = time.process_time()
        server.add_masked(c, y)
        server_s += time.process_time() - s0
    answers = {}
    junk_rng = np.random.default_rng(1)
    for c, (alive, dropped) in server.unmask_requests().items():
        answers[c] = timed("unmask", devices[c].unmask, alive, dropped)
        sent[c] += len(answers[c]) * (S.SHARE_BYTES + 5)
        if c < junk:
            answers[c] = {v: (kind, int.from_bytes(junk_rng.bytes(65), "big") % S.PRIME)
                          for v, (kind, _) in answers[c].items()}
    head = (f"ring {bits} bits n={n:4d} k={k:2d} t={t:2d} dropout={dropout:.0%} checks "
            f"{'on' if checked else 'off'} junk {junk}: ")
    s0 = time.process_time()
    try:
        total = server.unmasked(answers)
    except S.SecAggError as exc:
        return head + f"the round fails after {time.process_time() - s0:.3f} s ({exc})"
    server_s += time.process_time() - s0
    assert sorted(server.blamed) == [c for c in range(junk) if c in answers], server.blamed
    expected = sum((x for c in clients if c not in gone), np.zeros_like(x))
    assert np.array_equal(total, expected), "the unmasked sum is not the plain sum"
    survivors = [c for c in clients if c not in gone]
    per_client = np.mean([sent[c] for c in survivors])
    return (head + f"bytes/client "
            f"{per_client / 1e6:.3f} MB = {per_client / plain_bytes:.4f} x plain "
            f"({plain_bytes / 1e6:.3f} MB); client "
            f"CPU s (mean) keys {cpu['keys'] / n:.4f} mask {cpu['mask'] / len(survivors):.4f} "
            f"unmask {cpu['unmask'] / len(survivors):.4f}; coordinator CPU s {server_s:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 30, 100, 300])
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--model", default="convnet")
    ap.add_argument("--bits", type=int, nargs="+", default=[32], choices=sorted(S.RINGS))
    ap.add_argument("--checks", nargs="+", default=["on"], choices=["on", "off"])
    ap.add_argument("--junk", type=int, nargs="+", default=[0])
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.model, (1, 28, 28), 10, generator_seed=0)
    weights = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    layout = [(k, v.numel()) for k, v in weights.items()]
    plain = frame_size(weights)  # the plain upload's frame: every tensor, float32
    print(f"{args.model}: {sum(n for _, n in layout):,} values in {len(layout)} tensors")
    for bits in args.bits:
        for n in args.clients:
            for d in args.dropout:
                for junk in args.junk:
                    for checks in args.checks:
                        print(measure(n, d, layout, plain, bits, checks == "on", junk),
                              flush=True)


if __name__ == "__main__":
    main()
