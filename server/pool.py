"""Client pools: who trains the selected clients. The coordinator's round loop talks only to this
interface, so the in-process simulation and the MQTT fleet share it."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.data.federated import FederatedData
from fedseq.common.evaluation import EvalReport, evaluate
from fedseq.common.models import BlockModel, Weights, build_model, get_blocks
from fedseq.common.protocol.tensors import frame_size
from fedseq.common.training import finetune_and_score, run_client_round

UpdateCheck = Callable[[ClientUpdate], "str | None"]


class ClientPool(Protocol):
    def train(
        self, round: int, clients: list[int], plan: ClientPlan, weights: Weights, check: UpdateCheck
    ) -> Iterator[ClientUpdate]:
        """Train the selected clients; yields at most one update per client, only updates for
        which `check` returned None (it logs and records the others); failures are missing."""
        ...

    def evaluate(self, weights: Weights, eval_heads: tuple[str, ...]) -> EvalReport: ...

    def finetune(self, plan: ClientPlan, weights: Weights, eval_heads: tuple[str, ...]) -> EvalReport:
        """Every client fine-tunes from `weights` and reports accuracy on its own test rows."""
        ...


class InProcessPool:
    """All logical clients in this process; personal blocks kept in memory."""

    def __init__(
        self, data: FederatedData, model: BlockModel, personal_blocks: tuple[str, ...], seed: int,
        eval_batch: int = 128, device: torch.device | None = None,
    ):
        if device is not None and device.type != "cpu":
            # the pool trains a copy on the accelerator, with the images there too (70,000 28x28
            # images are 220 MB); labels, updates and personal blocks stay on the host
            model = copy.deepcopy(model).to(device)
            data = dataclasses.replace(data, x=data.x.to(device))
        self.data = data
        self.model = model
        self.seed = seed
        self.eval_batch = eval_batch
        initial = get_blocks(model, personal_blocks)
        # Personal blocks start from the initial global model, as on a device.
        self.personal: dict[int, Weights] = {
            c.client: {k: v.clone() for k, v in initial.items()} for c in data.clients
        }
        #: called with (clients done, clients in all) while fine-tuning
        self.progress: Callable[[int, int], None] = lambda done, total: None

    def train(
        self, round: int, clients: list[int], plan: ClientPlan, weights: Weights, check: UpdateCheck
    ) -> Iterator[ClientUpdate]:
        for c in clients:
            start = {**weights, **self.personal[c]}
            update, personal = run_client_round(
                self.model, start, plan, self.data, self.data.clients[c], self.seed, round)
            self.personal[c] = personal
            update.bytes_up = sum(
                frame_size({k: v for k, v in update.deltas.items() if k.split(".", 1)[0] == b})
                for b in plan.upload
            )
            if check(update) is None:
                yield update

    def evaluate(self, weights: Weights, eval_heads: tuple[str, ...]) -> EvalReport:
        return evaluate(self.model, self.data, weights, self.personal, eval_heads,
                        batch=self.eval_batch)

    def finetune(self, plan: ClientPlan, weights: Weights, eval_heads: tuple[str, ...]) -> EvalReport:
        per_client = {}
        for shard in self.data.clients:
            per_client[shard.client] = finetune_and_score(
                self.model, {**weights, **self.personal[shard.client]}, plan, self.data, shard,
                self.seed, eval_heads, self.eval_batch)
            self.progress(len(per_client), len(self.data.clients))
        return EvalReport(None, None, per_client)


def make_model(name: str, data: FederatedData, two_heads: bool, seed: int) -> BlockModel:
    from fedseq.common.seeding import derive_seed

    return build_model(name, data.input_shape, data.num_classes, two_heads,
                       generator_seed=derive_seed(seed, "init"))
