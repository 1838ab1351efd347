"""Training FLOPs of a client plan, measured with torch.utils.flop_counter on the coordinator.

FLOPs depend on shapes alone, so they are counted once per (phase objectives, batch size) on a
throwaway copy of the model with a zero batch, exactly as the trainer steps it (frozen blocks
cost what autograd really does for them), and multiplied by the batches the plan runs. Devices
never count: the flop counter's import pulls in torch._dynamo and sympy (~95 MB resident).
"""

from __future__ import annotations

import copy
import json

import torch

from fedseq.common.algorithms.hooks import client_side
from fedseq.common.algorithms.plan import ClientPlan, Objective, Phase
from fedseq.common.data.federated import ClientShard, FederatedData
from fedseq.common.models import BlockModel

FlopCache = dict[tuple[tuple[Objective, ...], int, str, str], int]


def phase_rows(plan: ClientPlan, data: FederatedData, shard: ClientShard) -> list[int]:
    """Rows each phase of `plan` iterates over for this client: its training rows, or as many
    as its algorithm's own data source holds (`ClientSide.phase_size`: FedReG's rebalanced set,
    Q rows of each class the client has)."""
    side = client_side(plan)
    out = []
    for phase in plan.phases:
        if phase.data == "local":
            out.append(shard.num_train)
            continue
        n = side.phase_size(phase, shard.train_class_counts(data.y, data.num_classes))
        if n is None:
            raise ValueError(f"{plan.algorithm}'s client side makes no data source {phase.data!r}")
        out.append(n)
    return out


def _runs(plan: ClientPlan, data: FederatedData, shard: ClientShard
          ) -> list[tuple[ClientPlan, Phase, int]]:
    """(the plan it runs under, phase, rows) of everything a client trains executing `plan`:
    its phases, then the further trainings of its algorithm's client side (Ditto's own model:
    `ClientSide.extra_plans`)."""
    runs = []
    for p in (plan, *client_side(plan).extra_plans(plan)):
        runs += [(p, phase, n) for phase, n in zip(p.phases, phase_rows(p, data, shard),
                                                     strict=True)]
    return runs


def plan_steps(plan: ClientPlan, data: FederatedData, shard: ClientShard) -> int:
    """Local optimizer steps of one client executing `plan`: every phase's epochs x its batches x
    its objectives that train something (a FedRep phase is one objective, FedReG's two), Ditto's
    own model's included."""
    total = 0
    for p, phase, n in _runs(plan, data, shard):
        training = sum(1 for obj in phase.objectives if obj.trainable)
        total += phase.epochs * -(-n // p.batch_size) * training
    return total


def _batch_flops(model: BlockModel, plan: ClientPlan, phase: Phase, size: int,
                 in_shape: tuple[int, int, int], num_classes: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    from fedseq.common.training import Sgd, set_trainable, train_step

    m = copy.deepcopy(model).cpu()
    x = torch.zeros(size, *in_shape)
    y = torch.zeros(size, dtype=torch.int64)
    log_prior = torch.zeros(1, num_classes) if plan.class_counts_needed else None
    side = client_side(plan)
    side.begin(m, torch.ones(num_classes) if plan.class_counts_needed else None, None)
    cache: dict[str, torch.Tensor] = {}
    with FlopCounterMode(display=False) as counter:
        for obj in phase.objectives:
            params = set_trainable(m, obj.trainable)
            if params:
                train_step(m, obj, Sgd(params, plan.lr, plan.momentum), x, y, cache, log_prior,
                           side)
    return int(counter.get_total_flops())


def plan_flops(model: BlockModel, plan: ClientPlan, data: FederatedData, shard: ClientShard,
               cache: FlopCache) -> int:
    """FLOPs of one client executing `plan`: every phase's epochs x its batches (and Ditto's
    training of the client's own model)."""
    total = 0
    for p, phase, n in _runs(plan, data, shard):
        bs = p.batch_size
        per_epoch = 0
        # full batches, then the last partial one: O(1) whatever the rows (a device's count)
        for size, times in ((bs, n // bs), (n % bs, 1)):
            if not size or not times:
                continue
            key = (phase.objectives, size, p.algorithm, json.dumps(p.params, sort_keys=True))
            if key not in cache:
                cache[key] = _batch_flops(model, p, phase, size, data.input_shape,
                                          data.num_classes)
            per_epoch += times * cache[key]
        total += phase.epochs * per_epoch
    return total
