"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021,
Algorithm 1): a dynamic regularizer aligns each client's local optimum with the global one.

Every client k keeps g_k, its last local gradient (0 at the start), one tensor per shared
parameter. A selected client receives theta and minimizes

    L_k(w) - <g_k, w> + alpha/2 ||w - theta||^2                  (alpha: algorithm.feddyn.alpha)

by local SGD (the linear term enters every step's gradient as -g_k, the proximal term as FedProx's
does), uploads w - theta and keeps

    g_k <- g_k - alpha (w - theta).

The server keeps h (0 at the start) and, with P the round's counted updates and m every client,

    h     <- h - alpha (|P| / m) mean_P (w_k - theta)
    theta <- theta + mean_P (w_k - theta) - h / alpha.

The mean over P is unweighted, as the paper's. PFLlib's client (which FedReG's baselines build
on) writes the proximal term as alpha/2 ||w - theta|| without the square; this is the paper's.
On the wire and in state g_k is a block beside the model's (`conv1~dyn`), kept with the
client's personal tensors; running statistics have none and are averaged as FedAvg's. FedReG
section 4.2 sets alpha = 0.01 from FedDyn's code.

The client's half (`DynClient`: FedProx's proximal term, `dyn_corrections`, `new_dyn_state`)
runs on the device floor (Python 3.8, torch 1.12).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

import torch
from pydantic import Field

from fedseq.common.algorithms.aggregate import ClientUpdate, ServerStep, in_dtype, pseudo_gradients
from fedseq.common.algorithms.fedavg import FedAvg
from fedseq.common.algorithms.fedprox import Proximal
from fedseq.common.algorithms.hooks import Job
from fedseq.common.config import AlgorithmParams, ExperimentConfig
from fedseq.common.models import ModelSpec, Weights, block_of, is_statistic, state_key

if TYPE_CHECKING:
    from fedseq.common.algorithms.robust import Aggregator
    from fedseq.common.training import TrainStats

DYN = "dyn"  # a client's g_k of block `conv1`: block `conv1~dyn`, with its personal tensors


def dyn_corrections(g: Weights, params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """-g_k for every parameter in `params` the client holds a g_k for (the linear term's
    gradient); a client without one yet has g_k = 0 and needs none."""
    return {name: -g[name].to(p.device, p.dtype) for name, p in params.items() if name in g}


def new_dyn_state(g: Weights, deltas: Weights, alpha: float) -> Weights:
    """g_k - alpha (w - theta) for every trained parameter's delta, under the state's names."""
    out = {}
    for name, d in deltas.items():
        if not d.is_floating_point() or is_statistic(name):
            continue
        before = g.get(name)
        moved = -alpha * d if before is None else before - alpha * d
        out[state_key(name, DYN)] = moved
    return out


class DynClient(Proximal):
    """A FedDyn client (params: {"alpha": alpha}): the proximal term alpha/2 ||w - theta||^2,
    -g_k added to every gradient, and g_k updated and kept."""

    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        super().__init__(params)
        self.alpha = self.mu = float(self.params.get("alpha", 0.0))

    def start(self, job: Job) -> Optional[Dict[str, torch.Tensor]]:
        return dyn_corrections(job.state.get(DYN, {}), job.trained) if self.alpha > 0 else None

    def finish(self, job: Job, stats: TrainStats, deltas: Weights, kept: Weights) -> float:
        if self.alpha > 0:
            kept.update(new_dyn_state(job.state.get(DYN, {}), deltas, self.alpha))
        return 0.0


class DynParams(AlgorithmParams):
    """[algorithm.feddyn]"""

    alpha: float = Field(0.01, gt=0, description=(
        "The dynamic regularizer's weight alpha (FedReG section 4.2: 0.01, from FedDyn's code)."))


class FedDyn(FedAvg):
    """FedDyn: FedAvg's plan with the dynamic regularizer, and the server's h."""

    name = "feddyn"
    own_server_step = True
    client_class = DynClient
    params_model = DynParams
    site_rounds_problem = ("its server state h steps with the mean of one round's client updates, "
                           "each from the global model; a site's k site rounds are no such update")
    async_problem = ("its server state h and each client's g_k assume every update starts from "
                     "the current global model")

    def __init__(self, cfg: ExperimentConfig, spec: ModelSpec):
        super().__init__(cfg, spec)
        self.alpha = cfg.algorithm.table(self.name, DynParams).alpha
        self.h: Weights = {}

    def client_params(self) -> dict[str, Any]:
        return {"alpha": self.alpha}

    def aggregation_weights(self, update: ClientUpdate) -> Dict[str, float]:
        return {block_of(k): 1.0 for k in update.deltas}

    def server_update(self, global_weights: Weights, aggregate: Aggregator) -> ServerStep:
        new = aggregate.apply(global_weights)  # AggregationError: h untouched
        share = aggregate.count() / self.cfg.data.num_clients
        h = dict(self.h)
        for k, g, mean in pseudo_gradients(global_weights, new, aggregate.moved()):
            old = h.get(k)
            hk = -self.alpha * share * mean if old is None else old.double() - (
                self.alpha * share * mean)
            h[k] = in_dtype(k, hk, g.dtype)
            new[k] = in_dtype(k, g.double() + mean - hk / self.alpha, g.dtype)
        self.h = h
        return ServerStep(new, frozenset(aggregate.moved()))

    def server_state(self) -> Weights:
        return dict(self.h)

    def load_server_state(self, state: Weights) -> None:
        self.h = dict(state)
