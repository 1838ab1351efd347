"""FedYogi (Reddi et al., ICLR 2021): Yogi on the server over FedAvg's mean delta (serveropt.py);
algorithm.server_lr (default 0.01); [algorithm.fedyogi] beta1, beta2, tau."""

import torch

from fedseq.common.algorithms.serveropt import AdaptiveParams, ServerOptimizer


class FedYogi(ServerOptimizer):
    """Yogi's second moment: v = v - (1 - beta2) delta^2 sign(v - delta^2), which grows v no
    faster than Adam's and lets it shrink only additively."""

    name = "fedyogi"
    default_server_lr = 0.01
    adaptive = True
    params_model = AdaptiveParams

    def second_moment(self, v: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
        """Yogi's: v - (1 - beta2) * squared * sign(v - squared), which moves v additively."""
        return v - (1.0 - self.beta2) * squared * torch.sign(v - squared)
