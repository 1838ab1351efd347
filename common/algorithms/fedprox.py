"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020): FedAvg plus
a proximal term mu/2 ||w - w_global||^2 on the trained parameters of every local step
(algorithm.fedprox.mu).

Its client side (`Proximal`) also serves FedDyn (the same term, weight alpha) and Ditto's
training of a client's own model (weight lambda, towards the global model it received). Runs on
the device floor (Python 3.8, torch 1.12).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch
from pydantic import Field

from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.hooks import ClientSide
from fedseq.common.config import AlgorithmParams
from fedseq.common.models import BlockModel, Weights


class Proximal(ClientSide):
    """mu/2 ||w - anchor||^2 over the parameters a step trains, anchor: the model as the pass
    starts, or the pass's anchor (params: {"mu": weight}; 0: no term)."""

    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        super().__init__(params)
        self.mu = float(self.params.get("mu", 0.0))
        self.anchor: Dict[str, torch.Tensor] = {}

    def begin(self, model: BlockModel, counts: Optional[torch.Tensor],
              anchor: Optional[Weights]) -> None:
        if self.mu > 0:
            dev = next(model.parameters()).device
            self.anchor = {k: v.detach().clone() if anchor is None else anchor[k].to(dev)
                           for k, v in model.named_parameters()}

    def penalty(self, model: BlockModel, x: torch.Tensor,
                feats: torch.Tensor) -> Optional[torch.Tensor]:
        if self.mu <= 0:
            return None
        prox = sum(
            (p - self.anchor[name]).pow(2).sum()
            for name, p in model.named_parameters()
            if p.requires_grad
        )
        return 0.5 * self.mu * prox  # type: ignore[return-value]


class ProxParams(AlgorithmParams):
    """[algorithm.fedprox]"""

    mu: float = Field(0.001, ge=0, description="The proximal term's weight mu.")


class FedProx(Algorithm):
    """FedProx (Li et al.): FedAvg with a proximal term mu/2 ||w - w_global||^2
    (algorithm.fedprox.mu)."""

    name = "fedprox"
    client_class = Proximal
    params_model = ProxParams

    def client_params(self) -> dict[str, Any]:
        return {"mu": self.cfg.algorithm.table(self.name, ProxParams).mu}
