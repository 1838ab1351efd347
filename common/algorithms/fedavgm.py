"""FedAvgM (Hsu et al. 2019, as Reddi et al. 2021 write it): server momentum on FedAvg's mean
delta, m = beta1 m + delta, x += server_lr m (algorithm.server_lr, default 1; algorithm.fedavgm.beta1)."""

from fedseq.common.algorithms.serveropt import ServerOptimizer


class FedAvgM(ServerOptimizer):
    """FedAvg with server momentum (serveropt.py)."""

    name = "fedavgm"
