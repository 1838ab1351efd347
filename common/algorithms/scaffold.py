"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Algorithm 1 with option II): control variates correct each client's drift.

The server keeps a control variate c and every client one of its own, c_i (0 at the start), one
tensor per shared parameter. A selected client receives x and c, and takes its K local SGD steps
on the corrected gradient g_i(y) - c_i + c. Then

    c_i+ = c_i - c + (x - y) / (K lr)          option II; the client keeps c_i+
         = (1/K) sum_k g_i(y_k)                the same under plain SGD: what is computed
    uploads  dy_i = y - x,  dc_i = c_i+ - c_i  both directions on the wire
    x <- x + server_lr * mean_i dy_i           (server_lr: algorithm.server_lr, default 1)
    c <- c + (|S| / N) mean_i dc_i             S: the round's counted updates, N: every client

On the wire and in state, a control variate is a block beside the model's: the server's c of
block `conv1` travels as block `conv1~c` (published, versioned and checkpointed as the model's
blocks are), a client's c_i is kept among its personal tensors as `conv1~ci`, and dc_i is uploaded
under the server's names. The deltas dy_i are weighted by sample count as FedAvg's (the paper's
mean is unweighted; this keeps SCAFFOLD FedAvg's update plus the correction); dc_i are weighted
equally, as the paper's c update is. Option II's c_i+ is the mean of the K stochastic gradients
the client computed (its corrections cancel), and the trainer sums exactly those: under plain
SGD this is the paper's value; under momentum (train.momentum > 0, the correction entering the
gradient before the momentum buffer) the formula (x - y) / (K lr) would count each gradient
about 1 / (1 - momentum) times (10x at 0.9) and over-correct, which the mean does not.
Running statistics are not gradients: they have no control variate and are averaged as
FedAvg's.

The client's half (`ControlClient`: `corrections`, `new_controls`, c and c_i among the round's
state blocks) runs on the device floor (Python 3.8, torch 1.12).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from fedseq.common.algorithms.aggregate import ClientUpdate, ServerStep, in_dtype, pseudo_gradients
from fedseq.common.algorithms.fedavg import FedAvg
from fedseq.common.algorithms.hooks import ClientSide, Job
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.config import ExperimentConfig
from fedseq.common.models import ModelSpec, Weights, block_of, is_statistic, state_block, state_key

if TYPE_CHECKING:
    from fedseq.common.algorithms.robust import Aggregator
    from fedseq.common.training import TrainStats

SERVER = "c"  # the server's control variate of a block: block `conv1~c`
CLIENT = "ci"  # a client's own: block `conv1~ci`, kept with its personal tensors


def control_key(key: str, tag: str = SERVER) -> str:
    """The control variate's name for model tensor `key`: conv1.weight -> conv1~c.weight."""
    return state_key(key, tag)


def is_server_control(block: str) -> bool:
    """Whether `block` holds the server's control variates (`conv1~c`)."""
    return block.endswith(state_block("", SERVER))


def corrections(server: Weights, client: Weights, params: Dict[str, torch.Tensor]
                ) -> Dict[str, torch.Tensor]:
    """c - c_i for every parameter in `params` (name -> the model's parameter, for device and
    dtype) that has a server control variate; a client without c_i yet holds 0."""
    out = {}
    for name, p in params.items():
        if name in server:
            c = server[name].to(p.device, p.dtype)
            ci = client.get(name)
            out[name] = c - ci.to(p.device, p.dtype) if ci is not None else c.clone()
    return out


def new_controls(client: Weights, gradients: Weights, steps: int) -> Tuple[Weights, Weights]:
    """Option II after `steps` local steps whose raw stochastic gradients sum to `gradients`
    (parameter name -> sum, on the host): (dc_i under the server's names, c_i+ under the
    client's names)."""
    up: Weights = {}
    kept: Weights = {}
    for name, total in gradients.items():
        ci = client.get(name)
        before = ci if ci is not None else torch.zeros_like(total)
        after = total / steps if steps else before
        up[control_key(name)] = after - before
        kept[control_key(name, CLIENT)] = after
    return up, kept


class ControlClient(ClientSide):
    """A SCAFFOLD client: c - c_i added to every gradient; dc_i uploaded, c_i+ kept."""

    def start(self, job: Job) -> Optional[Dict[str, torch.Tensor]]:
        return corrections(job.state.get(SERVER, {}), job.state.get(CLIENT, {}), job.trained)

    def finish(self, job: Job, stats: TrainStats, deltas: Weights, kept: Weights) -> float:
        sent, own = new_controls(job.state.get(CLIENT, {}), stats.gradients, stats.batches)
        deltas.update(sent)
        kept.update(own)
        return 0.0


class Scaffold(FedAvg):
    """SCAFFOLD: FedAvg's plan with drift-corrected local steps and both control variates."""

    name = "scaffold"
    own_server_step = True
    client_class = ControlClient
    site_rounds_problem = ("its control variates move with one round's client corrections, made "
                           "with the server's c and x; a site's k site rounds move them k times")
    async_problem = ("its control variates assume every client of a round corrects its steps "
                     "with the current c and x; a stale c_i breaks the variance reduction")

    def __init__(self, cfg: ExperimentConfig, spec: ModelSpec):
        super().__init__(cfg, spec)
        lr = cfg.algorithm.server_lr
        self.lr = 1.0 if lr is None else lr
        self.c: Weights = {}  # the server's control variate, under its wire names (conv1~c.*)

    def plan(self, round: int) -> ClientPlan:
        plan = super().plan(round)
        controls = tuple(state_block(b, SERVER) for b in plan.upload)
        return replace(plan, upload=plan.upload + controls)

    def aggregation_weights(self, update: ClientUpdate) -> Dict[str, float]:
        weights = super().aggregation_weights(update)
        return {b: 1.0 if is_server_control(b) else w for b, w in weights.items()}

    def broadcast(self, shared: Weights) -> Weights:
        """c, created as zeros (float32 as the model's parameters) for every shared parameter
        the first time it is asked for."""
        if not self.c:
            self.c = {control_key(k): torch.zeros_like(v) for k, v in shared.items()
                      if v.is_floating_point() and not is_statistic(k)}
        return self.c

    def upload_bound(self, key: str, bound: float) -> float:
        """dc_i = (x - y) / (K lr) - c under plain SGD, elementwise at most bound / lr + max|c|
        when every |y - x| <= bound: a control variate's bound follows from the model's."""
        if not is_server_control(block_of(key)):
            return bound
        c = self.c.get(key)
        return bound / self.cfg.train.lr + (float(c.abs().max()) if c is not None and c.numel()
                                            else 0.0)

    def server_update(self, global_weights: Weights, aggregate: Aggregator) -> ServerStep:
        both = aggregate.apply({**global_weights, **self.c})  # AggregationError: c untouched
        moved = aggregate.moved()
        new = {k: both[k] for k in global_weights}
        if self.lr != 1.0:
            for k, g, delta in pseudo_gradients(global_weights, dict(new), moved):
                new[k] = in_dtype(k, g.double() + self.lr * delta, g.dtype)
        share = aggregate.count() / self.cfg.data.num_clients
        c = {}
        for k, old in self.c.items():
            c[k] = old if k not in moved else in_dtype(
                k, old.double() + share * (both[k].double() - old.double()), old.dtype)
        self.c = c
        # the moved control variate's tensors are broadcast ones: their blocks get new versions
        return ServerStep(new, frozenset(moved))

    def server_state(self) -> Weights:
        return dict(self.c)

    def load_server_state(self, state: Weights) -> None:
        self.c = dict(state)
