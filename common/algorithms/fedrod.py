"""FedRoD (Chen & Chao): a generic head trained with the balanced-softmax loss and aggregated with
the base, plus a personal head trained on the detached features with plain cross-entropy on
(generic + personal) logits. Personal prediction = generic + personal logits."""

from __future__ import annotations

from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.plan import Objective, Phase


class FedRoD(Algorithm):
    """FedRoD (Chen and Chao): a generic head with balanced softmax and a personal head on its features."""

    name = "fedrod"
    two_heads = True

    def personal_blocks(self) -> tuple[str, ...]:
        assert self.spec.personal_head is not None
        return (self.spec.personal_head,)

    def shared_blocks(self) -> tuple[str, ...]:
        return self.spec.base + (self.spec.head,)

    def eval_heads(self) -> tuple[str, ...]:
        return self.spec.heads

    def phases(self, round: int) -> tuple[Phase, ...]:
        s = self.spec
        generic = Objective((s.head,), s.base + (s.head,), loss="balanced_ce")
        personal = Objective(s.heads, self.personal_blocks(), reuse_features=True)
        return (Phase(self.cfg.train.local_epochs, (generic, personal)),)
