"""Local-only control: every client trains alone, nothing is federated.

The same round loop, selection and local epochs as the federated algorithms (so each client
spends the compute it would spend in a federated run), but every block is personal: a client
continues its own model each time it is selected and never uploads. With
algorithm.finetune_epochs > 0 every client then fine-tunes its own model as FedBABU and FedSeq
do at the end (0 = not fine-tuned). It measures what federation adds: P of `local` against P of a
federated run of the same config. A client never selected keeps the initial model until then.
"""

from __future__ import annotations

from fedseq.common.algorithms.base import Algorithm


class Local(Algorithm):
    """Every client trains its own model alone (no aggregation); fine-tunes at the end if asked."""

    name = "local"
    fine_tunes = True
    global_model_note = "the initial model: nothing is federated (local-only control)"

    def personal_blocks(self) -> tuple[str, ...]:
        return self.spec.blocks
