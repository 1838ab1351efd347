"""The in-process pool: every logical client trained in this process (fedseq-sim without
--workers), and where a simulation's clients train (`on_device`, which the workers use too)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Generator
from typing import Any

import torch

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.data.federated import FederatedData
from fedseq.common.execution import ClientExecutor, InMemory
from fedseq.common.models import BlockModel, Weights, personal_tensors
from fedseq.server.rounds.pool_api import (
    ClientPool,
    EvalOutcome,
    FinetuneOutcome,
    PoolState,
    Progress,
    RoundOutcome,
    ScoreCheck,
    TrainRound,
    UpdateCheck,
)


def on_device(model: BlockModel, data: FederatedData, device: torch.device | None
              ) -> tuple[BlockModel, FederatedData]:
    """The model and images where clients train: on an accelerator a copy of the model and the
    images there too (70,000 28x28 images are 220 MB); labels, updates and personal blocks stay
    on the host."""
    if device is None or device.type == "cpu":
        return model, data
    return copy.deepcopy(model).to(device), dataclasses.replace(data, x=data.x.to(device))


class InProcessPool(ClientPool):
    """All logical clients in this process; their personal blocks are kept in memory."""

    def __init__(
        self, data: FederatedData, model: BlockModel, personal_blocks: tuple[str, ...], seed: int,
        eval_batch: int = 128, device: torch.device | None = None, *, algorithm: str,
    ):
        model, data = on_device(model, data, device)
        self.data = data
        self.personal_blocks = personal_blocks
        initial = personal_tensors(model, personal_blocks)
        # Personal blocks start from the initial global model, as on a device.
        self.personal: dict[int, Weights] = {
            c.client: {k: v.clone() for k, v in initial.items()} for c in data.clients
        }
        self.clients = ClientExecutor(model, data, seed, eval_batch, InMemory(self.personal),
                                      algorithm)

    def __enter__(self) -> InProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing to close: the clients live in this process."""

    def open(self, weights: Weights, personal: tuple[str, ...]) -> None:
        """Nothing to announce: the clients live in this process."""

    def train(self, round: int, clients: list[int], plan: ClientPlan, weights: Weights,
              check: UpdateCheck, enough: int | None = None, secure: Any = None) -> TrainRound:
        return TrainRound(self._train(round, clients, plan, weights, check))

    def _train(self, round: int, clients: list[int], plan: ClientPlan, weights: Weights,
               check: UpdateCheck) -> Generator[ClientUpdate, None, RoundOutcome]:
        for c in clients:
            update = self.clients.train(c, round, plan, weights)
            if check(update) is None:
                yield update
        return RoundOutcome()

    def evaluate(self, weights: Weights, eval_heads: tuple[str, ...], check: ScoreCheck
                 ) -> EvalOutcome:
        return EvalOutcome(self.clients.evaluate(weights, self.personal_blocks, eval_heads))

    def finetune(self, plan: ClientPlan, weights: Weights, eval_heads: tuple[str, ...],
                 check: ScoreCheck, progress: Progress) -> FinetuneOutcome:
        out = FinetuneOutcome({})
        for shard in self.data.clients:
            out.scores[shard.client], diverged = self.clients.finetune(
                shard.client, plan, weights, self.personal_blocks, eval_heads)
            if diverged is not None:
                out.diverged[shard.client] = diverged
            progress(len(out.scores), len(self.data.clients))
        return out

    def snapshot(self) -> PoolState:
        return PoolState(None, self.personal)

    def restore(self, state: PoolState) -> None:
        self.personal.update(state.personal)
