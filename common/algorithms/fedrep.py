"""FedRep (Collins et al.): head epochs with the base frozen, then base epochs with the head frozen;
only the base is shared."""

from __future__ import annotations

from pydantic import Field

from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.plan import Objective, Phase
from fedseq.common.config import AlgorithmParams


class RepParams(AlgorithmParams):
    """[algorithm.fedrep]"""

    head_epochs: int = Field(1, ge=0, description="Head epochs before the body epochs.")


class FedRep(Algorithm):
    """FedRep (Collins et al.): the personal head trains first (head_epochs), then the shared base."""

    name = "fedrep"
    params_model = RepParams
    global_model_note = "aggregated base + head at its initial weights (heads are personal)"

    def personal_blocks(self) -> tuple[str, ...]:
        return (self.spec.head,)

    def phases(self, round: int) -> tuple[Phase, ...]:
        head = (self.spec.head,)
        phases = []
        epochs = self.cfg.algorithm.table(self.name, RepParams).head_epochs
        if epochs:
            phases.append(Phase(epochs, (Objective(head, head),)))
        phases.append(Phase(self.cfg.train.local_epochs, (Objective(head, self.spec.base),)))
        return tuple(phases)
