"""FedPer (Arivazhagan et al.): the whole model trains locally, the head stays personal."""

from __future__ import annotations

from pydantic import Field

from fedseq.common.algorithms.base import Algorithm
from fedseq.common.config import AlgorithmParams, ExperimentConfig
from fedseq.common.errors import ConfigError
from fedseq.common.models import ModelSpec


class PerParams(AlgorithmParams):
    """[algorithm.fedper]"""

    personal_layers: int = Field(1, ge=1, description=(
        "K_P: the personalization layers in blocks, the head and the last K_P - 1 base blocks "
        "(1: the head alone, FedPer's default; its section 4.3 tries 1 to 4)."))


class FedPer(Algorithm):
    """FedPer (Arivazhagan et al.): the base is federated, the personalization layers stay
    personal: the head and, with algorithm.fedper.personal_layers = K_P > 1, the last K_P - 1
    base blocks (FedPer section 4.3 counts K_P in basic blocks: K_P = 1 is the classifier
    alone)."""

    name = "fedper"
    params_model = PerParams
    global_model_note = "aggregated base + head at its initial weights (heads are personal)"

    def __init__(self, cfg: ExperimentConfig, spec: ModelSpec):
        super().__init__(cfg, spec)
        k = self.k = cfg.algorithm.table(self.name, PerParams).personal_layers
        if k > len(spec.base):
            raise ConfigError(
                f"algorithm.fedper.personal_layers = {k}: the model's {len(spec.base)} base blocks "
                f"({', '.join(spec.base)}) and its head leave nothing federated at K_P > "
                f"{len(spec.base)}; use 1 (the head alone) to {len(spec.base)}")
        if k > 1:
            self.global_model_note = (f"aggregated {', '.join(self.shared_blocks())} + the "
                                      f"personal {', '.join(self.personal_blocks())} at their "
                                      "initial weights")

    def personal_blocks(self) -> tuple[str, ...]:
        k = self.k
        return (*self.spec.base[len(self.spec.base) - (k - 1):], self.spec.head)
