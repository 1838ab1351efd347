"""What handing one step to the workers costs (`fedseq-sim --workers`): rank 0 and N workers in a
Gloo group on loopback, the step a FedAvg round of the CNN sends (its 2.3 MB of weights), sent
by `broadcast_step` (its packed bytes, their size first) and by torch's `broadcast_object_list`
of the same packed bytes (how steps went before), alternated.

    python bench/step_broadcast.py [--workers 2] [--steps 40] [--passes 3]

Prints per pass and way the milliseconds from rank 0's send until every worker holds the step
unpacked (a barrier after each), and checks the workers got the weights bitwise.
"""

from __future__ import annotations

import argparse
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fedseq.common.models import CNN
from fedseq.server.pools import distributed as D


def the_step() -> tuple[str, dict[str, Any]]:
    torch.manual_seed(0)  # every rank builds the same step, so the workers can check theirs
    model = CNN((1, 28, 28), 10, two_heads=False)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return "train", {"weights": weights, "shares": [[1, 2, 3], [4, 5, 6]], "round": 3}


def send(way: str, step: Any) -> None:
    if way == "broadcast_step":
        D.broadcast_step(step)
    else:
        dist.broadcast_object_list([D.pack(step)], src=0, group=D.steps_group())


def receive(way: str) -> Any:
    if way == "broadcast_step":
        return D.receive_step()
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=D.steps_group())
    return D.unpack(box[0])


def rank_main(rank: int, world: int, port: int, steps: int, passes: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    step = the_step()
    for p in range(passes):
        for way in ("broadcast_object_list", "broadcast_step"):
            dist.barrier(group=D.steps_group())
            start = time.perf_counter()
            for _ in range(steps):
                if rank == 0:
                    send(way, step)
                else:
                    got = receive(way)
                dist.barrier(group=D.steps_group())
            ms = (time.perf_counter() - start) / steps * 1000
            if rank:
                same = all(torch.equal(got[1]["weights"][k], v) for k, v in step[1]["weights"].items())
                assert same, f"rank {rank} got other weights by {way}"
            else:
                print(f"pass {p + 1}  {way:22s} {ms:6.2f} ms a step", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"torch {torch.__version__}, rank 0 + {args.workers} workers, Gloo on loopback, "
          f"a {sum(v.numel() * v.element_size() for v in the_step()[1]['weights'].values()) / 1e6:.1f}"
          " MB step")
    mp.spawn(rank_main, args=(args.workers + 1, port, args.steps, args.passes),
             nprocs=args.workers + 1)


if __name__ == "__main__":
    main()
