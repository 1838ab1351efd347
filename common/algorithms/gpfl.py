"""GPFL (Zhang et al., "GPFL: Simultaneously Learning Global and Personalized Feature Information
for Personalized Federated Learning", ICCV 2023), as FedReG runs it from GPFL's code (PFLlib's
clientgpfl.py and servergpfl.py).

Between the base and the head sit two shared modules (common/models.py `add_valve`): the
Conditional Valve `cov` and the Global Category Embedding `gce` (one row E_c per class). Each
client makes two conditional inputs from the GCE it received: the generic g = mean_c E_c and its
personalized p = sum_c a_c E_c, a_c its training rows' share of class c. On base features f,
a selected client trains every block on

    CE(head(CoV(f, p)), y)                                        the personalized prediction
    + CE(cos(CoV(f, g), E), y)                                    angle-level guidance
    + lambda ||CoV(f, g) - E'_y||                                 magnitude-level guidance
    + mu/2 (||CoV||^2 + ||GCE||^2)                                the modules' L2 regularization

(cos: the cosine of each row with every class's embedding, unscaled; E': the GCE as received,
frozen; the norm is over the whole batch, unsquared, as GPFL's code writes it; lambda:
algorithm.gpfl.lam, mu: algorithm.gpfl.mu, GPFL's code's weight decay of the two modules).
The head is personal; the base, CoV and GCE are aggregated (sample-weighted, as FedAvg's). A
client's personalized model is head(CoV(base(x), p)). GPFL has no global classifier besides the
GCE: the global model here predicts the class whose embedding is nearest in angle to
CoV(base(x), g), the angle-level guidance's own prediction.

FedReG (section 4.2) sets lambda = 0.1 and eta = 0.001, "as per the provided source code"; eta
is read here as the code's mu (FedReG calls FedProx's mu eta too). GPFL's own run_me.sh gives
its 4-layer CNN lam 0.01 and mu 0.1.

Where PFLlib's code differs: it makes g and p from the client's GCE before overwriting it with
the round's aggregate (a round older, or the client's own trained copy); here both come from
the GCE the client is sent (a client holds no GCE between rounds). Its two modules train with
their own optimizers without momentum; here every block trains with the run's optimizer
(train.momentum), and the regularization is the loss term that equals that weight decay
without momentum; under momentum 0.9 it decays them about 10x as fast (docs/results.md, FedReG
Table 2's Fashion-MNIST column: GPFL's P falls after round 30 at mu 0.001, not at 0.0001 or 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from pydantic import Field

from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.hooks import ClientSide
from fedseq.common.algorithms.plan import Objective, Phase
from fedseq.common.config import AlgorithmParams
from fedseq.common.models import VALVE, BlockModel, Weights


@dataclass(frozen=True)
class Conditions:
    """A client's conditional inputs, from the GCE `table` it was sent (kept, frozen, for the
    magnitude-level guidance)."""

    generic: torch.Tensor  # g: the mean class embedding
    personal: torch.Tensor  # p: the class embeddings weighted by the client's class shares
    table: torch.Tensor  # E', class x feature


def conditions(table: torch.Tensor, class_counts: torch.Tensor) -> Conditions:
    """g and p from a GCE's embedding table and a client's training rows per class."""
    table = table.detach().clone()
    counts = class_counts.to(table)
    share = counts / counts.sum().clamp_min(1)
    return Conditions(table.mean(0), share @ table, table)


def gpfl_loss(model: BlockModel, head: str, feats: torch.Tensor, y: torch.Tensor,
              cond: Conditions, lam: float, mu: float) -> torch.Tensor:
    """GPFL's local loss on one batch's base features (module docstring)."""
    loss = F.cross_entropy(getattr(model, head)(model.cov(feats, cond.personal)), y)
    generic = model.cov(feats, cond.generic)
    loss = loss + F.cross_entropy(cosines(generic, model.gce.weight), y)
    if lam:
        loss = loss + lam * (generic - cond.table[y]).pow(2).sum().sqrt()
    if mu:
        params = [p for name in VALVE for p in getattr(model, name).parameters()]
        loss = loss + 0.5 * mu * sum(p.pow(2).sum() for p in params)
    return loss


def cosines(feats: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The cosine of each feature row with each class embedding (rows x classes)."""
    return F.linear(F.normalize(feats), F.normalize(table))


def through_valve(model: BlockModel, feats: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """CoV(feats, cond) on the model's device, returned where `feats` were."""
    dev = next(model.parameters()).device
    return model.cov(feats.to(dev), cond.to(dev)).to(feats.device)


def personal_features(model: BlockModel, feats: torch.Tensor,
                      class_counts: torch.Tensor) -> torch.Tensor:
    """What a client's head reads: CoV(f, p), p from the model's GCE and the client's counts."""
    return through_valve(model, feats, conditions(model.gce.weight, class_counts).personal)


def global_prediction(model: BlockModel, feats: torch.Tensor) -> torch.Tensor:
    """The global model's classes: the GCE row nearest in angle to CoV(f, g)."""
    table = model.gce.weight.detach()
    generic = through_valve(model, feats, table.mean(0))
    return cosines(generic, table.to(generic.device)).argmax(1)


class GPFLClient(ClientSide):
    """A GPFL client (params: {"lambda": ..., "mu": ...}): its loss through the valve, from the
    conditional inputs of the GCE it was sent; its heads read its personalized valve."""

    needs_counts = True

    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        super().__init__(params)
        self.lam = float(self.params.get("lambda", 0.0))
        self.mu = float(self.params.get("mu", 0.0))
        self.cond: Optional[Conditions] = None

    def begin(self, model: BlockModel, counts: Optional[torch.Tensor],
              anchor: Optional[Weights]) -> None:
        if counts is not None:  # GPFL's inputs, from the GCE as it was sent
            self.cond = conditions(model.gce.weight, counts)

    def loss(self, model: BlockModel, obj: Objective, feats: torch.Tensor,
             y: torch.Tensor) -> Optional[torch.Tensor]:
        if obj.loss != "gpfl":
            return None
        assert self.cond is not None, "GPFL's loss needs its conditional inputs"
        return gpfl_loss(model, obj.heads[0], feats, y, self.cond, self.lam, self.mu)

    def head_features(self, model: BlockModel, feats: torch.Tensor,
                      counts: torch.Tensor) -> torch.Tensor:
        return personal_features(model, feats, counts)

    def global_prediction(self, model: BlockModel,
                          feats: torch.Tensor) -> Optional[torch.Tensor]:
        return global_prediction(model, feats)


class GPFLParams(AlgorithmParams):
    """[algorithm.gpfl]"""

    lam: float = Field(0.1, ge=0, description=(
        "lambda: the weight of its magnitude-level global guidance (FedReG section 4.2: 0.1, "
        "from GPFL's code)."))
    mu: float = Field(0.001, ge=0, description=(
        "The L2 regularization (weight decay) of its CoV and GCE (FedReG section 4.2's eta: "
        "0.001)."))


class GPFL(Algorithm):
    """GPFL: a shared base, CoV and GCE, a personal head on the personalized valve's output."""

    name = "gpfl"
    valve = True
    client_class = GPFLClient
    params_model = GPFLParams
    global_model_note = ("aggregated base and CoV, the class whose aggregated GCE embedding is "
                         "nearest in angle (heads are personal)")

    def personal_blocks(self) -> tuple[str, ...]:
        return (self.spec.head,)

    def phases(self, round: int) -> tuple[Phase, ...]:
        s = self.spec
        return (Phase(self.cfg.train.local_epochs, (Objective((s.head,), s.blocks, "gpfl"),)),)

    def client_params(self) -> dict[str, Any]:
        p = self.cfg.algorithm.table(self.name, GPFLParams)
        return {"lambda": p.lam, "mu": p.mu}
