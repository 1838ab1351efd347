"""A demo lab's fedseq plugins: each is a plain object registered by an entry point
(pyproject.toml), written only against fedseq's public API."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.hooks import ClientSide
from fedseq.common.algorithms.robust import Rule
from fedseq.common.config import AlgorithmParams
from fedseq.common.data.datasets import Dataset
from fedseq.common.data.readers import RawDataset


# -- a model: any nn.Module; its top-level children with parameters are its blocks, the last the head
class LabNet(nn.Module):
    def __init__(self, features: int, num_classes: int, hidden: int):
        super().__init__()
        self.body1 = nn.Linear(features, hidden)
        self.body2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.body1(x.flatten(1)))
        x = torch.relu(self.body2(x))
        return self.head(x)


def make_labnet(input_shape, num_classes: int, hidden: int = 32) -> nn.Module:
    """The model entry point: (input shape, classes, **[model.options]) -> nn.Module."""
    c, h, w = input_shape
    return LabNet(c * h * w, num_classes, hidden)


# -- a dataset: describes itself without files, loads its rows from a root
class BlobOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    classes: int = Field(4, ge=2)
    features: int = Field(16, ge=1)
    rows: int = Field(600, ge=10)
    seed: int = 0


class Blobs(Dataset):
    """Gaussian blobs, one centre per class: synthetic rows that a model learns in a few rounds."""

    options_model = BlobOptions

    def describe(self, options: Dict[str, Any]):
        o = BlobOptions.model_validate(options)
        return (1, 1, o.features), o.classes

    def load(self, root, options: Dict[str, Any], rows: Optional[np.ndarray] = None) -> RawDataset:
        o = BlobOptions.model_validate(options)
        rng = np.random.default_rng(o.seed)
        centres = rng.normal(0.0, 2.0, (o.classes, o.features))
        labels = rng.integers(0, o.classes, o.rows)
        x = (centres[labels] + rng.normal(0.0, 1.0, (o.rows, o.features))).astype(np.float32)
        images = x.reshape(o.rows, 1, 1, o.features)
        return RawDataset(images if rows is None else images[rows], labels.astype(np.int64),
                          o.classes, o.rows * 4 // 5)


BLOBS = Blobs()


# -- an algorithm: FedAvg with an L2 penalty on the weights a step trains (a client hook)
class L2Params(AlgorithmParams):
    lam: float = Field(0.01, ge=0, description="The penalty's weight.")


class L2Penalty(ClientSide):
    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        super().__init__(params)
        self.lam = float(self.params.get("lam", 0.0))

    def penalty(self, model, x, feats):
        if self.lam <= 0:
            return None
        return self.lam * sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad)


class FedAvgL2(Algorithm):
    """FedAvg whose clients add lam x ||w||^2 to their loss ([algorithm.fedavg-l2] lam)."""

    name = "fedavg-l2"
    client_class = L2Penalty
    params_model = L2Params

    def client_params(self) -> Dict[str, Any]:
        return {"lam": self.cfg.algorithm.table(self.name, L2Params).lam}


# -- an aggregation rule: (AggregationConfig) -> Aggregator; here FedAvg's own weighted mean
def lab_mean(cfg) -> WeightedDeltaSum:
    return WeightedDeltaSum()


# -- a rule with options and state: the round's weighted mean, then server momentum on it
# (FedAvgM's server step as a rule: m = beta x m + mean delta; the model moves by m). Built once
# for the run; its momentum is its state, checkpointed and resumed.
class MomentumOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    beta: float = Field(0.9, ge=0, lt=1, description="The momentum of the rounds' mean deltas.")


class _MomentumRound:
    """One round of LabMomentum: the mean streams in; `apply` moves the model by the momentum."""

    def __init__(self, rule: LabMomentum):
        self.rule, self.mean = rule, WeightedDeltaSum()

    def add(self, deltas, weight_of, client, device=None):
        self.mean.add(deltas, weight_of, client, device)

    def count(self):
        return self.mean.count()

    def clients_added(self):
        return self.mean.clients_added()

    def apply(self, global_weights):
        new = self.mean.apply(global_weights)  # raises (round refused) before any state changes
        m, beta = self.rule.momentum, self.rule.options.beta
        for k in self.mean.moved():
            if not global_weights[k].is_floating_point():
                continue  # counters (BatchNorm's) move as the mean moves them
            step = new[k] - global_weights[k]
            m[k] = step if k not in m else beta * m[k] + step
            new[k] = global_weights[k] + m[k]
        return new

    def moved(self):
        return self.mean.moved()


class LabMomentum(Rule):
    options_model = MomentumOptions

    def __init__(self, cfg, options):
        super().__init__(cfg, options)
        self.momentum: Dict[str, torch.Tensor] = {}

    def round(self):
        return _MomentumRound(self)

    def state(self):
        return dict(self.momentum)

    def load_state(self, state):
        self.momentum = dict(state)
