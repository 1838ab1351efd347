"""MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, Algorithm 1): each
client's representation is pulled towards the global model's and pushed from its own previous
local model's.

A selected client receives w^t and trains every block on

    CE(head(z), y) + mu * l_con,
    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

per batch (the mean over its rows), where z, z_glob and z_prev are the representations of the
batch by the model being trained, by the global model it received (w^t, frozen) and by its own
model after its previous round (frozen; w^t the first time, where l_con is the constant log 2
and has no gradient), and sim is the cosine similarity (mu: algorithm.moon.mu, tau:
algorithm.moon.tau). The server is FedAvg's.

The paper's models end with a projection head whose output is the representation; fedseq's
models have none, so the representation is the base's output (the features the head reads), as
PFLlib's MOON takes it. The paper's settings: tau = 0.5; mu = 5 on CIFAR-10, 1 on CIFAR-100 and
Tiny-ImageNet (chosen from {0.1, 1, 5, 10}); the defaults here are tau 0.5 and mu 1. The frozen
models compute in evaluation mode without gradients.

A client keeps its previous model's base beside the model as state (block `conv1~prev`, every
base tensor, running statistics included): a client never selected before contrasts with the
global model. A training step costs two extra forward passes of the base, and a client holds
two extra copies of the model while it trains. Runs on the device floor (Python 3.8, torch 1.12).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
import torch.nn.functional as F
from pydantic import Field

from fedseq.common.algorithms.fedavg import FedAvg
from fedseq.common.algorithms.hooks import ClientSide, Job
from fedseq.common.config import AlgorithmParams
from fedseq.common.models import BlockModel, Weights, block_of, set_weights, state_key

if TYPE_CHECKING:
    from fedseq.common.training import TrainStats

PREVIOUS = "prev"  # a client's previous local model's base of block `conv1`: block `conv1~prev`


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor,
                     tau: float) -> torch.Tensor:
    """l_con averaged over the batch: cross-entropy of the positive pair (z, z_glob) against
    the negative (z, z_prev), cosine similarities over tau, as MOON's code computes it."""
    logits = torch.stack([F.cosine_similarity(z, z_glob), F.cosine_similarity(z, z_prev)], 1)
    return F.cross_entropy(logits / tau, torch.zeros(len(z), dtype=torch.long, device=z.device))


def _frozen(model: BlockModel, weights: Optional[Weights] = None) -> BlockModel:
    """A copy of `model` (with `weights` loaded over it) for forward passes alone."""
    out = copy.deepcopy(model)
    if weights:
        set_weights(out, weights)
    out.eval()
    for p in out.parameters():
        p.requires_grad_(False)
    return out


class MoonClient(ClientSide):
    """A MOON client (params: {"mu": ..., "tau": ...}): the model-contrastive term on every step,
    its trained base kept for the next round's negative pair."""

    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        super().__init__(params)
        self.mu = float(self.params.get("mu", 1.0))
        self.tau = float(self.params.get("tau", 0.5))
        self.previous: Weights = {}
        self.glob: Optional[BlockModel] = None
        self.prev: Optional[BlockModel] = None

    def start(self, job: Job) -> None:
        dev = next(job.model.parameters()).device
        self.previous = {k: v.to(dev) for k, v in job.state.get(PREVIOUS, {}).items()}
        return None

    def begin(self, model: BlockModel, counts: Optional[torch.Tensor],
              anchor: Optional[Weights]) -> None:
        if self.mu > 0:
            self.glob = _frozen(model)  # the model as it was received
            self.prev = _frozen(model, self.previous)

    def penalty(self, model: BlockModel, x: torch.Tensor,
                feats: torch.Tensor) -> Optional[torch.Tensor]:
        if self.mu <= 0:
            return None
        assert self.glob is not None and self.prev is not None, "begin() builds the frozen models"
        with torch.no_grad():
            z_glob = self.glob.features(x)
            z_prev = self.prev.features(x)
        return self.mu * contrastive_loss(feats, z_glob, z_prev, self.tau)

    def finish(self, job: Job, stats: TrainStats, deltas: Weights, kept: Weights) -> float:
        base = set(job.model.spec.base)
        kept.update({state_key(k, PREVIOUS): v.detach().cpu().clone()
                     for k, v in job.model.state_dict().items() if block_of(k) in base})
        self.glob = self.prev = None
        return 0.0


class MoonParams(AlgorithmParams):
    """[algorithm.moon]"""

    mu: float = Field(1.0, ge=0, description=(
        "The weight mu of its model-contrastive term (the paper: 5 on CIFAR-10, 1 on CIFAR-100 "
        "and Tiny-ImageNet)."))
    tau: float = Field(0.5, gt=0, description=(
        "The temperature tau of its model-contrastive term (the paper's 0.5)."))


class Moon(FedAvg):
    """MOON: FedAvg's server, clients trained with the model-contrastive term."""

    name = "moon"
    client_class = MoonClient
    params_model = MoonParams

    def client_params(self) -> dict[str, Any]:
        p = self.cfg.algorithm.table(self.name, MoonParams)
        return {"mu": p.mu, "tau": p.tau}
