"""Issue 33's peers workload on Apple's pfl-research, for bench/workers.py to run beside fedseq-sim
in the same benchmark run. It needs no fedseq: run it under torchrun with a Python that has pfl
(`pip install "torch==2.13.0" "pfl[pytorch]==0.6.0"` in a venv of its own), e.g.
`python bench/workers.py --pfl-python /tmp/pfl/bin/python`, which runs

    PYTHON -m torch.distributed.run --nproc-per-node CORES bench/pfl_peer.py DATA_ROOT ROUNDS

The workload, as fedseq's `peers` one (and bench/flower_peer.py's): FedAvg, the FedSeq/PFLlib CNN,
Fashion-MNIST, 30 IID clients of 2,000 training images, a cohort of 6 a round, 1 local epoch,
batch 20, local SGD lr 0.01, central SGD lr 1 (plain averaging), no evaluation. pfl's simulated
backend under torchrun: each process trains its share of the cohort with one torch thread and the
statistics are summed over torch.distributed (Gloo), pfl's recommended multi-process setting on
CPU. A round's seconds are the time between two central iterations as rank 0 sees them.

Prints one JSON line from rank 0: seconds per round.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from flower_peer import CLIENTS, CNN, LR, PER_CLIENT, images  # noqa: E402


class Model(CNN):
    """pfl's PyTorch model protocol: loss and metrics on a user's raw data."""

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(x), y)

    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> dict:
        from pfl.metrics import Weighted

        self.eval() if eval else self.train()
        with torch.no_grad():
            loss = nn.functional.cross_entropy(self(x), y, reduction="sum").item()
        return {"loss": Weighted(loss, len(x))}


def main() -> None:
    torch.set_num_threads(1)
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    root, rounds = sys.argv[1], int(sys.argv[2])
    x, y = images(__import__("pathlib").Path(root))
    users = list(range(CLIENTS))

    def user(uid: int) -> Dataset:
        rows = slice(uid * PER_CLIENT, (uid + 1) * PER_CLIENT)
        return Dataset(raw_data=[x[rows], y[rows]], user_id=str(uid))

    def data() -> FederatedDataset:
        return FederatedDataset(user, get_user_sampler("minimize_reuse", users),
                                user_id_to_weight={u: PER_CLIENT for u in users})

    net = Model()
    model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    stamps: list[float] = []

    class Stamp(TrainingProcessCallback):
        def on_train_begin(self, *, model):  # noqa: ANN001
            stamps.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # noqa: ANN001
            stamps.append(time.perf_counter())
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                           evaluation_frequency=rounds + 1,
                                           train_cohort_size=6, val_cohort_size=0),
        backend=SimulatedBackend(training_data=data(), val_data=data()),
        model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=1, local_learning_rate=LR,
                                              local_batch_size=20),
        model_eval_params=NNEvalHyperParams(local_batch_size=256),
        callbacks=[Stamp()], send_metrics_to_platform=False)
    if get_default_framework_module().distributed.global_rank == 0:
        print(json.dumps({"round_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                          "samples_per_round": 6 * PER_CLIENT}), flush=True)


if __name__ == "__main__":
    main()
