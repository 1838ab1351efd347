"""Accuracy of the global model and of every client's personalized model on test rows.

When clients share the global base (all algorithms but LG-FedAvg), the base features of all test
rows are computed once and each client's heads are applied to its own rows: personalized
evaluation of 30 clients then costs one forward pass, not 30.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedseq.common.algorithms.hooks import ClientSide
from fedseq.common.data.federated import FederatedData
from fedseq.common.models import BlockModel, Weights, block_of, set_weights


@dataclass
class EvalReport:
    """Scores of one evaluation: the global model on the union of the clients' test rows (None where
    it was not scored) and every client's personalized model on its own rows."""

    global_correct: int | None
    global_total: int | None
    per_client: dict[int, tuple[int, int]]  # client -> (correct, total)
    #: data.placement = "device": the global model on the clients' own test rows, pooled (the
    #: devices' scores; global_* is then the validation set's, or None)
    federated: tuple[int, int] | None = None

    @property
    def federated_acc(self) -> float | None:
        """Accuracy pooled over the devices' reported scores on their own test rows (data on the
        devices), or None."""
        return pooled_accuracy([self.federated]) if self.federated is not None else None

    @property
    def global_acc(self) -> float | None:
        """Global accuracy, or None when the global model was not scored."""
        if not self.global_total:
            return None
        return self.global_correct / self.global_total  # type: ignore[operator]

    @property
    def personal_acc(self) -> float | None:
        """Personalized accuracy pooled over clients: sum correct / sum total."""
        return pooled_accuracy(self.per_client.values())


def pooled_accuracy(scores: Iterable[tuple[int, int]]) -> float | None:
    """sum correct / sum total over (correct, total) pairs, or None when there is nothing."""
    pairs = list(scores)
    total = sum(t for _, t in pairs)
    return sum(c for c, _ in pairs) / total if total else None


@torch.inference_mode()
def features(model: BlockModel, x: torch.Tensor, batch: int) -> torch.Tensor:
    """Base features of `x` in batches on the model's device, returned on the host."""
    dev = next(model.parameters()).device
    out = [model.features(x[i : i + batch].to(dev)).cpu() for i in range(0, len(x), batch)]
    return torch.cat(out) if out else torch.empty(0)


def _head_logits(feats: torch.Tensor, heads: tuple[str, ...], weights: Weights) -> torch.Tensor:
    out = None
    for h in heads:
        part = F.linear(feats, weights[f"{h}.weight"].cpu(), weights[f"{h}.bias"].cpu())
        out = part if out is None else out + part
    assert out is not None
    return out


@torch.inference_mode()
def score_global(model: BlockModel, data: FederatedData, weights: Weights, rows: torch.Tensor,
                 batch: int = 128, side: ClientSide | None = None) -> tuple[int, int]:
    """(correct, total) of the global model on dataset `rows` (data.validation's)."""
    side = ClientSide() if side is None else side
    model.eval()
    set_weights(model, weights)
    feats = features(model, data.images(rows), batch)
    pred = side.global_prediction(model, feats)
    if pred is None:
        pred = _head_logits(feats, (model.spec.head,), weights).argmax(1)
    return int((pred == data.y[rows]).sum()), len(rows)


@torch.inference_mode()
def evaluate(
    model: BlockModel,
    data: FederatedData,
    global_weights: Weights,
    personal: dict[int, Weights],
    eval_heads: tuple[str, ...],
    clients: list[int] | None = None,
    batch: int = 128,
    with_global: bool = True,
    side: ClientSide | None = None,
) -> EvalReport:
    """Global model on the union of the clients' test rows, and each client's model (global
    blocks overridden by its personal blocks, logits of `eval_heads` summed) on its own rows.
    `side`: the algorithm's client side, where the heads read something else than the base
    features (`head_features`) and the global model predicts otherwise than by its head
    (`global_prediction`): GPFL's valve and GCE (common/algorithms/gpfl.py)."""
    spec = model.spec
    side = ClientSide() if side is None else side
    clients = list(range(len(data.clients))) if clients is None else clients
    model.eval()  # running statistics (model.norm) normalize, and stay as they are
    set_weights(model, global_weights)
    personal_base = any(block_of(k) in spec.base for w in personal.values() for k in w)
    shared_feats = with_global or not personal_base
    per_client: dict[int, tuple[int, int]] = {}
    g_correct = g_total = 0
    if shared_feats:
        rows = torch.cat([data.clients[c].test for c in clients])
        if model.batch_stats:  # batches never mix clients: any sharding scores the same
            feats = torch.cat([features(model, data.images(data.clients[c].test), batch)
                               for c in clients])
        else:
            feats = features(model, data.images(rows), batch)
        y = data.y[rows]
        if with_global:
            pred = side.global_prediction(model, feats)
            if pred is None:
                pred = _head_logits(feats, (spec.head,), global_weights).argmax(1)
            g_correct, g_total = int((pred == y).sum()), len(y)
    offset = 0
    for c in clients:
        test = data.clients[c].test
        n = len(test)
        w = {**global_weights, **personal.get(c, {})}
        if personal_base:
            set_weights(model, personal.get(c, {}))
            f_c = features(model, data.images(test), batch)
            set_weights(model, {k: v for k, v in global_weights.items() if k in personal.get(c, {})})
        else:
            f_c = feats[offset : offset + n]
        if side.needs_counts:
            f_c = side.head_features(model, f_c, data.clients[c].train_class_counts(
                data.y, data.num_classes))
        pred = _head_logits(f_c, eval_heads, w).argmax(1)
        per_client[c] = (int((pred == data.y[test]).sum()), n)
        offset += n
    return EvalReport(g_correct if with_global else None, g_total if with_global else None,
                      per_client)
