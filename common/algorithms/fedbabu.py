"""FedBABU (Oh et al.): the head stays at its random init during federation, only the body is
trained and aggregated; every client fine-tunes the whole model after the last round.

The paper zeroes the head's learning rate (gradient computed, not applied); here the head has
requires_grad=False, which gives the same weights without computing the head's gradient.
"""

from __future__ import annotations

from fedseq.common.algorithms.base import Algorithm, base_only_phase
from fedseq.common.algorithms.plan import ClientPlan, Objective, Phase


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

    def finetune_plan(self) -> ClientPlan | None:
        if not self.finetunes(self.cfg):
            return None
        epochs = self.cfg.algorithm.finetune_epochs
        t = self.cfg.train
        phase = Phase(epochs, (Objective((self.spec.head,), self.spec.blocks),))
        return ClientPlan((phase,), upload=(), personal=self.spec.blocks, lr=t.lr,
                          momentum=t.momentum, batch_size=t.batch_size)
