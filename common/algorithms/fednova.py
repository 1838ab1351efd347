"""FedNova (Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020): normalized averaging, so that clients who
take more local steps do not pull the global model towards their own objective.

Client i takes tau_i local steps (its epochs x its batches: clients with more rows take more)
of SGD with momentum rho (train.momentum). Its update is the sum of its gradients weighted by
a_i, with ||a_i||_1 = sum_{k=1}^{tau_i} (1 - rho^k) / (1 - rho) (tau_i without momentum), and
it uploads the normalized update

    d_i = (y_i - x) / ||a_i||_1.

With p_i = n_i / sum_S n_j over the round's counted clients S (sample weights, FedAvg's),

    x <- x + tau_eff sum_S p_i d_i,        tau_eff = sum_S p_i ||a_i||_1.

The client normalizes (`NovaClient`); the server takes the sample-weighted mean of the d_i under
the aggregation rule and steps it by tau_eff, computed from each counted client's training-set
size and the plan (a valid update's steps are the plan's: the round's contract checks its
sample count, so a device cannot claim more work). Running statistics are not gradients: they
are neither normalized nor stepped, and take FedAvg's mean. The client's half runs on the
device floor (Python 3.8, torch 1.12).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedseq.common.algorithms.aggregate import ServerStep, in_dtype, pseudo_gradients
from fedseq.common.algorithms.fedavg import FedAvg
from fedseq.common.algorithms.hooks import ClientSide, Job
from fedseq.common.models import Weights, is_statistic

if TYPE_CHECKING:
    from fedseq.common.algorithms.robust import Aggregator
    from fedseq.common.training import TrainStats


def normalizer(steps: int, momentum: float) -> float:
    """||a_i||_1 of `steps` local steps under `momentum` (FedNova's code counts it step by
    step: counter <- rho counter + 1, a += counter)."""
    if momentum == 0:
        return float(steps)
    total = counter = 0.0
    for _ in range(steps):
        counter = momentum * counter + 1.0
        total += counter
    return total


class NovaClient(ClientSide):
    """A FedNova client: its deltas divided by ||a_i||_1 of the steps it took."""

    def finish(self, job: Job, stats: TrainStats, deltas: Weights, kept: Weights) -> float:
        a = normalizer(stats.batches, job.plan.momentum)
        if a > 0:
            for k, d in deltas.items():
                if d.is_floating_point() and not is_statistic(k):
                    deltas[k] = d / a
        return 0.0


class FedNova(FedAvg):
    """FedNova: clients upload normalized updates; the server steps their mean by tau_eff."""

    name = "fednova"
    client_class = NovaClient
    own_server_step = True
    site_rounds_problem = ("its step tau_eff normalizes one round's client updates by their local "
                           "steps; a site's k site rounds are no such update")
    async_problem = ("its step tau_eff weighs the updates of one round's clients against each "
                     "other; buffered updates trained on older models have no such round")

    def prepare(self, train_sizes: list[int]) -> None:
        self.sizes = list(train_sizes)

    def local_steps(self, client: int) -> int:
        """tau_i: the local steps of `client`'s plan (epochs x batches of its rows)."""
        t = self.cfg.train
        return t.local_epochs * -(-self.sizes[client] // t.batch_size)

    def server_update(self, global_weights: Weights, aggregate: Aggregator) -> ServerStep:
        mean = aggregate.apply(global_weights)  # x + sum_S p_i d_i under the aggregation rule
        clients = aggregate.clients_added()
        n = sum(self.sizes[c] for c in clients)
        momentum = self.cfg.train.momentum
        tau_eff = sum(self.sizes[c] * normalizer(self.local_steps(c), momentum)
                      for c in clients) / n if n else 0.0
        out = dict(mean)
        for k, g, step in pseudo_gradients(global_weights, mean, aggregate.moved()):
            out[k] = in_dtype(k, g.double() + tau_eff * step, g.dtype)
        return ServerStep(out, frozenset(aggregate.moved()))
