"""Ditto (Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization", ICML
2021, Algorithm 1): a global model trained as FedAvg's, and beside it every client's own model
v_k, regularized towards the global one.

A selected client receives w^t and (1) trains a copy of it for train.local_epochs, whose delta it
uploads (FedAvg's part), and (2) trains its own v_k for algorithm.ditto_epochs (FedReG's
"personal local step", 5) on

    F_k(v) + lambda/2 ||v - w^t||^2                              (lambda: algorithm.ditto_lambda)

from where v_k was (w^t the first time it is selected), w^t being the global model it received
(PFLlib's clientditto: the same anchor, its personal steps before the global ones; the two are
independent, so the order changes nothing). The client's personalized model is v_k: its
evaluation and P use it; a client never selected yet is evaluated with the global model (PFLlib
evaluates its untrained copy of the initial model). The global model is FedAvg's. Both trainings
use the run's optimizer (train.momentum); PFLlib's personal optimizer has no momentum.

v_k is kept beside the model as a client's personal state (block `conv1~pm`, one tensor per
model tensor, running statistics included), which the executor's evaluation reads in place of
the shared blocks (common/execution.py). The local training's random streams are the round's
"batches" for w and "personal" for v_k.
"""

from __future__ import annotations

from dataclasses import replace

from fedseq.common.algorithms.fedavg import FedAvg
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.models import Weights, split_state

PERSONAL_MODEL = "pm"  # a client's own model of block `conv1`: block `conv1~pm`


def personal_view(held: Weights) -> Weights:
    """The model tensors a client is evaluated with from what it holds: its personal blocks,
    overridden by its own whole model where it keeps one (Ditto's v_k)."""
    model, state = split_state(held)
    return {**model, **state.get(PERSONAL_MODEL, {})}


class Ditto(FedAvg):
    """Ditto: FedAvg's global model and each client's proximally regularized own model."""

    name = "ditto"

    def plan(self, round: int) -> ClientPlan:
        a = self.cfg.algorithm
        return replace(super().plan(round), personal_epochs=a.ditto_epochs,
                       personal_prox=a.ditto_lambda)
