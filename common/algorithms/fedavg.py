"""FedAvg (McMahan et al.): every block trained and averaged by sample count."""

from fedseq.common.algorithms.base import Algorithm


class FedAvg(Algorithm):
    """FedAvg (McMahan et al.): every block trained and averaged by sample count (the base defaults)."""

    name = "fedavg"
