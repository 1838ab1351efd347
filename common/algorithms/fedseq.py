"""FedSeq (sequential layer expansion; FedSeq paper, Algorithm 1).

The base is split into K ordered blocks; block k becomes trainable from round t_k on (t >= t_k),
input to output for Vanilla, output to input for Anti. The head is frozen at its initial weights
during federation; only trained base blocks are uploaded and aggregated; at the end every client
fine-tunes base and head (inherited from FedBABU).
"""

from __future__ import annotations

from fedseq.common.algorithms.fedbabu import FedBABU
from fedseq.common.config import ExperimentConfig
from fedseq.common.errors import ConfigError
from fedseq.common.models import ModelSpec


def unfreeze_schedule(rounds: int, k: int, given: list[int]) -> list[int]:
    """t_1..t_K; empty config = evenly spaced over the rounds (t_1 = 0)."""
    if not given:
        return [(i * rounds) // k for i in range(k)]
    if len(given) != k:
        raise ConfigError(
            f"algorithm.unfreeze_rounds has {len(given)} entries, the model has {k} base blocks; "
            f"give {k} ascending rounds, e.g. --set algorithm.unfreeze_rounds="
            f"{unfreeze_schedule(rounds, k, [])}"
        )
    return list(given)


def trainable_blocks(base: tuple[str, ...], schedule: list[int], round: int, anti: bool):
    """Blocks unfrozen at `round`: the first (Vanilla) or last (Anti) n blocks, n = #{t_k <= t}."""
    n = sum(1 for t in schedule if round >= t)
    if n == 0:
        return ()
    return base[len(base) - n:] if anti else base[:n]


class FedSeq(FedBABU):
    """FedSeq-Vanilla: FedBABU whose base blocks are unfrozen input to output at rounds t_1..t_K."""

    name = "fedseq-vanilla"
    anti = False
    global_model_note = "aggregated base + head frozen at its initial weights (before fine-tuning)"

    def __init__(self, cfg: ExperimentConfig, spec: ModelSpec):
        super().__init__(cfg, spec)
        self.schedule = unfreeze_schedule(cfg.rounds, len(spec.base), cfg.algorithm.unfreeze_rounds)

    def trainable_base(self, round: int) -> tuple[str, ...]:
        return trainable_blocks(self.spec.base, self.schedule, round, self.anti)


class FedSeqAnti(FedSeq):
    """FedSeq-Anti: the base blocks are unfrozen output to input."""

    name = "fedseq-anti"
    anti = True
