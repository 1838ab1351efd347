"""FedAdam (Reddi et al., ICLR 2021): Adam on the server over FedAvg's mean delta (serveropt.py);
algorithm.server_lr (default 0.01); [algorithm.fedadam] beta1, beta2, tau."""

import torch

from fedseq.common.algorithms.serveropt import AdaptiveParams, ServerOptimizer


class FedAdam(ServerOptimizer):
    """Adam's second moment: v = beta2 v + (1 - beta2) delta^2."""

    name = "fedadam"
    default_server_lr = 0.01
    adaptive = True
    params_model = AdaptiveParams

    def second_moment(self, v: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
        """Adam's: beta2 * v + (1 - beta2) * squared."""
        return self.beta2 * v + (1.0 - self.beta2) * squared
