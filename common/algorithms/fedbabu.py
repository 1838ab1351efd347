"""FedBABU (Oh et al.): the head stays at its random init during federation, only the body is
trained and aggregated; every client fine-tunes the whole model after the last round (or its head
alone: algorithm.finetune_blocks = "head", how FedReG section 5 describes FedBABU's re-tuning).

The paper zeroes the head's learning rate (gradient computed, not applied); here the head has
requires_grad=False, which gives the same weights without computing the head's gradient.
"""

from __future__ import annotations

from fedseq.common.algorithms.base import Algorithm, base_only_phase
from fedseq.common.algorithms.plan import Phase


class FedBABU(Algorithm):
    """FedBABU: the body is federated under a frozen random head; every client fine-tunes at the end."""

    name = "fedbabu"
    fine_tunes = True
    global_model_note = "aggregated base + head frozen at its initial weights (before fine-tuning)"

    def trainable_base(self, round: int) -> tuple[str, ...]:
        """The base blocks trained in `round` (all of them; FedSeq unfreezes them in stages)."""
        return self.spec.base

    def phases(self, round: int) -> tuple[Phase, ...]:
        return (base_only_phase(self.spec, self.trainable_base(round), self.cfg.train.local_epochs),)
