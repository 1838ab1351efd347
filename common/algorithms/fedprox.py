"""FedProx (Li et al.): FedAvg plus a proximal term mu/2 * ||w - w_global||^2 on trained blocks."""

from __future__ import annotations

from fedseq.common.algorithms.base import Algorithm


class FedProx(Algorithm):
    """FedProx (Li et al.): FedAvg with a proximal term mu/2 ||w - w_global||^2 (algorithm.mu)."""

    name = "fedprox"

    def prox_mu(self) -> float:
        return self.cfg.algorithm.mu
