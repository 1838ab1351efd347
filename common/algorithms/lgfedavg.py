"""LG-FedAvg (Liang et al.): local representations (personal base), global head."""

from __future__ import annotations

from fedseq.common.algorithms.base import Algorithm


class LGFedAvg(Algorithm):
    """LG-FedAvg (Liang et al.): local representations, global head: the base stays personal."""

    name = "lg-fedavg"
    global_model_note = "base at its initial weights + aggregated head (bases are personal)"

    def personal_blocks(self) -> tuple[str, ...]:
        return self.spec.base
