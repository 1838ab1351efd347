"""Issue 33's peers workload on Flower's simulation engine, for bench/workers.py to run beside
fedseq-sim in the same benchmark run. It needs no fedseq: run it with a Python that has Flower
and its Ray backend (`pip install "torch==2.13.0" "flwr[simulation]==1.42.0"` in a venv of its
own), e.g. `python bench/workers.py --flower-python /tmp/flwr/bin/python`.

The workload, as fedseq's `peers` one: FedAvg, the FedSeq/PFLlib CNN (conv 5x5 1->32, pool,
conv 5x5 32->64, pool, fc 1024->512, fc 512->10), Fashion-MNIST, 30 IID clients of 2,000
training images, 6 a round (fraction_train 0.2), 1 local epoch, batch 20, SGD lr 0.01, no
federated evaluation. Flower's default Ray backend, one CPU per client (`client_resources
num_cpus=1`), so Ray runs as many actors as the cores it is given; each ClientApp trains with one
torch thread, as fedseq's workers do. A round's seconds are the time between the strategy's
server-side evaluation hooks (called before round 1 and after every round; they do nothing), so
they hold the whole round: sending, training, replies, aggregation.

    python bench/flower_peer.py DATA_ROOT ROUNDS CORES   # prints one JSON line: seconds per round
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

CLIENTS, PER_CLIENT, BATCH, LR = 30, 2000, 20, 0.01


_LOADED: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def loaded(root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The images, read once per process: a Ray actor imports this module by name (PYTHONPATH),
    since the ClientApp itself reaches each call as a fresh copy whose own state is lost (a
    closure's cache was empty on every call: each client read the dataset again, ~0.6 s)."""
    if str(root) not in _LOADED:
        _LOADED[str(root)] = images(root)
    return _LOADED[str(root)]


def images(root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    raw = root / "FashionMNIST" / "raw"
    with gzip.open(raw / "train-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(raw / "train-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    return torch.from_numpy(x.astype(np.float32) / 255.0), torch.from_numpy(y.astype(np.int64))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Flatten(), nn.Linear(1024, 512), nn.ReLU())
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc1(self.conv2(self.conv1(x))))


def main() -> None:
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    root, rounds, cores = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os.environ["FLWR_BENCH_ROOT"] = str(root)
    os.environ["PYTHONPATH"] = os.pathsep.join(  # Ray's workers import this module by name
        [str(Path(__file__).resolve().parent)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))
    client_app, server_app = ClientApp(), ServerApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        import flower_peer

        torch.set_num_threads(1)
        x, y = flower_peer.loaded(Path(os.environ["FLWR_BENCH_ROOT"]))
        pid = int(context.node_config["partition-id"])
        rows = slice(pid * PER_CLIENT, (pid + 1) * PER_CLIENT)
        model = CNN()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        order = torch.randperm(PER_CLIENT)
        xs, ys = x[rows], y[rows]
        for i in range(0, PER_CLIENT, BATCH):
            b = order[i:i + BATCH]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs[b]), ys[b]).backward()
            opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": PER_CLIENT})}),
                       reply_to=msg)

    stamps: list[float] = []

    @server_app.main()
    def run(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=0.2, fraction_evaluate=0.0, min_train_nodes=6,
                          min_evaluate_nodes=0, min_available_nodes=CLIENTS)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(CNN().state_dict()),
                       num_rounds=rounds,
                       evaluate_fn=lambda rnd, arrays: stamps.append(time.perf_counter()))

    logging.disable(logging.INFO)
    run_simulation(server_app, client_app, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": cores}})
    print(json.dumps({"round_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                      "samples_per_round": 6 * PER_CLIENT}))


if __name__ == "__main__":
    main()
