"""One module per algorithm; `make_algorithm` maps config names to them."""

from __future__ import annotations

from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.ditto import Ditto
from fedseq.common.algorithms.fedadam import FedAdam
from fedseq.common.algorithms.fedavg import FedAvg
from fedseq.common.algorithms.fedavgm import FedAvgM
from fedseq.common.algorithms.fedbabu import FedBABU
from fedseq.common.algorithms.feddyn import FedDyn
from fedseq.common.algorithms.fednova import FedNova
from fedseq.common.algorithms.fedper import FedPer
from fedseq.common.algorithms.fedprox import FedProx
from fedseq.common.algorithms.fedreg import FedReG
from fedseq.common.algorithms.fedrep import FedRep
from fedseq.common.algorithms.fedrod import FedRoD
from fedseq.common.algorithms.fedseq import FedSeq, FedSeqAnti
from fedseq.common.algorithms.fedyogi import FedYogi
from fedseq.common.algorithms.gpfl import GPFL
from fedseq.common.algorithms.lgfedavg import LGFedAvg
from fedseq.common.algorithms.local import Local
from fedseq.common.algorithms.moon import Moon
from fedseq.common.algorithms.scaffold import Scaffold
from fedseq.common.config import ExperimentConfig
from fedseq.common.models import ModelSpec

REGISTRY: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (FedAvg, FedAvgM, FedAdam, FedYogi, Scaffold, FedProx, FedDyn, Ditto, FedPer,
                FedRep, LGFedAvg, FedBABU, GPFL, FedRoD, FedReG, FedSeq, FedSeqAnti, Local, Moon,
                FedNova)
}


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under a config name (algorithm.name)."""
    return REGISTRY[name]


def model_layout(name: str) -> dict[str, bool]:
    """What algorithm `name` adds to any model, as build_model's and model_spec's keywords:
    a personal second head (two_heads: FedRoD, FedReG), GPFL's CoV and GCE (valve)."""
    cls = REGISTRY[name]
    return {"two_heads": cls.two_heads, "valve": cls.valve}


def make_algorithm(cfg: ExperimentConfig, spec: ModelSpec) -> Algorithm:
    """The configured algorithm for a model's block layout."""
    return REGISTRY[cfg.algorithm.name](cfg, spec)


__all__ = ["Algorithm", "REGISTRY", "algorithm_class", "make_algorithm", "model_layout"]
