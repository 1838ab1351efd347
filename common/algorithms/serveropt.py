"""Server optimizers (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2):
the clients train as in FedAvg, and the server treats the round's mean delta as a pseudo-gradient
that it steps along with an optimizer of its own, keeping that optimizer's state across rounds.

    delta_t = (the round's aggregate) - x_t           any aggregation rule (robust.py)
    m_t     = beta1 m_{t-1} + delta_t                 FedAvgM (Hsu et al. 2019)
            = beta1 m_{t-1} + (1 - beta1) delta_t     FedAdam, FedYogi
    v_t     = beta2 v_{t-1} + (1 - beta2) delta_t^2                       FedAdam
            = v_{t-1} - (1 - beta2) delta_t^2 sign(v_{t-1} - delta_t^2)   FedYogi
    x_{t+1} = x_t + server_lr m_t                     FedAvgM
            = x_t + server_lr m_t / (sqrt(v_t) + tau) FedAdam, FedYogi

m starts at 0 and v at tau^2 (the paper's v_{-1} >= tau^2), with no bias correction, as the
paper writes it. The state is float64, one tensor per parameter, created the first round the
parameter is aggregated; a parameter nobody sent in a round keeps its value and its state.
Running statistics (BatchNorm's running mean and variance) are not gradients: they take the
aggregate as FedAvg does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from fedseq.common.algorithms.aggregate import ServerStep, in_dtype, pseudo_gradients
from fedseq.common.algorithms.fedavg import FedAvg
from fedseq.common.config import AlgorithmParams, ExperimentConfig
from fedseq.common.models import ModelSpec, Weights

if TYPE_CHECKING:
    from fedseq.common.algorithms.robust import Aggregator

F64 = torch.float64


class MomentumParams(AlgorithmParams):
    """[algorithm.fedavgm] (with algorithm.server_lr)"""

    beta1: float = Field(0.9, ge=0, lt=1, description=(
        "The server optimizer's momentum: FedAvgM m = beta1 m + delta; FedAdam, FedYogi the EMA "
        "m = beta1 m + (1 - beta1) delta."))


class AdaptiveParams(MomentumParams):
    """[algorithm.fedadam], [algorithm.fedyogi] (with algorithm.server_lr)"""

    beta2: float = Field(0.99, ge=0, lt=1, description="The second moment's decay.")
    tau: float = Field(1e-3, gt=0, description=(
        "Adaptivity; the second moment starts at tau^2."))


class ServerOptimizer(FedAvg):
    """FedAvg's clients under a server optimizer: FedAvgM as it is; an adaptive subclass sets
    `adaptive` and gives its `second_moment` rule (FedAdam, FedYogi)."""

    default_server_lr = 1.0
    own_server_step = True
    adaptive = False  # keeps a second moment v
    params_model: type[MomentumParams] = MomentumParams

    def __init__(self, cfg: ExperimentConfig, spec: ModelSpec):
        super().__init__(cfg, spec)
        a = cfg.algorithm
        self.lr = a.server_lr if a.server_lr is not None else self.default_server_lr
        p = a.table(self.name, self.params_model)
        q = p if isinstance(p, AdaptiveParams) else AdaptiveParams()  # FedAvgM: unused
        self.beta1, self.beta2, self.tau = p.beta1, q.beta2, q.tau
        self.m: Weights = {}
        self.v: Weights = {}

    def server_update(self, global_weights: Weights, aggregate: Aggregator) -> ServerStep:
        """m (and v) from the round's pseudo-gradients, then x + server_lr m (/ (sqrt(v) +
        tau)); the state changes only when every tensor came out finite."""
        mean = aggregate.apply(global_weights)  # FedAvg's new model under the aggregation rule
        out, m, v = dict(mean), {}, {}
        for k, g, delta in pseudo_gradients(global_weights, mean, aggregate.moved()):
            before_m = self.m[k] if k in self.m else torch.zeros_like(delta)
            m[k] = self.beta1 * before_m + self.momentum_gain() * delta
            if self.adaptive:
                before = self.v[k] if k in self.v else torch.full_like(delta, self.tau ** 2)
                v[k] = self.second_moment(before, delta * delta)
                step = self.lr * m[k] / (v[k].sqrt() + self.tau)
            else:
                step = self.lr * m[k]
            out[k] = in_dtype(k, g.to(F64) + step, g.dtype)  # AggregationError: state untouched
        self.m.update(m)
        self.v.update(v)
        return ServerStep(out, frozenset(aggregate.moved()))

    def momentum_gain(self) -> float:
        """What delta is scaled by in m (FedAvgM: 1; the adaptive ones' EMA: 1 - beta1)."""
        return 1.0 - self.beta1 if self.adaptive else 1.0

    def second_moment(self, v: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
        """The next second moment from the last one `v` and the squared mean delta: FedAdam's and
        FedYogi's rules differ only here."""
        raise NotImplementedError

    def server_state(self) -> Weights:
        return {**{f"m/{k}": t for k, t in self.m.items()},
                **{f"v/{k}": t for k, t in self.v.items()}}

    def load_server_state(self, state: Weights) -> None:
        self.m = {k[2:]: t.to(F64) for k, t in state.items() if k.startswith("m/")}
        self.v = {k[2:]: t.to(F64) for k, t in state.items() if k.startswith("v/")}
