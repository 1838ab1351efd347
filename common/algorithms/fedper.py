"""FedPer (Arivazhagan et al.): the whole model trains locally, the head stays personal."""

from __future__ import annotations

from fedseq.common.algorithms.base import Algorithm


class FedPer(Algorithm):
    """FedPer (Arivazhagan et al.): the base is federated, the head stays personal."""

    name = "fedper"
    global_model_note = "aggregated base + head at its initial weights (heads are personal)"

    def personal_blocks(self) -> tuple[str, ...]:
        return (self.spec.head,)
