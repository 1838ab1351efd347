"""Ditto (Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization", ICML
2021, Algorithm 1): a global model trained as FedAvg's, and beside it every client's own model
v_k, regularized towards the global one.

A selected client receives w^t and (1) trains a copy of it for train.local_epochs, whose delta it
uploads (FedAvg's part), and (2) trains its own v_k for algorithm.ditto.epochs (FedReG's
"personal local step", 5) on

    F_k(v) + lambda/2 ||v - w^t||^2                              (lambda: algorithm.ditto.lam)

from where v_k was (w^t the first time it is selected), w^t being the global model it received
(PFLlib's clientditto: the same anchor, its personal steps before the global ones; the two are
independent, so the order changes nothing). The client's personalized model is v_k: its
evaluation and P use it; a client never selected yet is evaluated with the global model (PFLlib
evaluates its untrained copy of the initial model). The global model is FedAvg's. Both trainings
use the run's optimizer (train.momentum); PFLlib's personal optimizer has no momentum.

v_k is kept beside the model as a client's personal state (block `conv1~pm`, one tensor per
model tensor, running statistics included), which the client's evaluation reads in place of
the shared blocks (`DittoClient.view`). The local training's random streams are the round's
"batches" for w and "personal" for v_k.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

from pydantic import Field

from fedseq.common.algorithms.fedavg import FedAvg
from fedseq.common.algorithms.fedprox import Proximal
from fedseq.common.algorithms.hooks import ClientSide, Job
from fedseq.common.algorithms.plan import ClientPlan, Phase
from fedseq.common.config import AlgorithmParams
from fedseq.common.models import Weights, set_weights, split_state, state_key

if TYPE_CHECKING:
    from fedseq.common.training import TrainStats

PERSONAL_MODEL = "pm"  # a client's own model of block `conv1`: block `conv1~pm`


class DittoClient(ClientSide):
    """A Ditto client (params: {"epochs": its own model's epochs, "lambda": their proximal
    weight}): after the round's training, v_k's; evaluated with v_k."""

    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        super().__init__(params)
        self.epochs = int(self.params.get("epochs", 0))
        self.lam = float(self.params.get("lambda", 0.0))

    def extra_plans(self, plan: ClientPlan) -> Tuple[ClientPlan, ...]:
        return (self.own_plan(plan),) if self.epochs else ()

    def own_plan(self, plan: ClientPlan) -> ClientPlan:
        """The training of the client's own model: `epochs` over its rows with the round's
        objectives, FedProx's proximal term of weight lambda, nothing else of the round's."""
        return replace(plan, phases=(Phase(self.epochs, plan.phases[0].objectives),),
                       score_heads=(), algorithm="fedprox", params={"mu": self.lam})

    def finish(self, job: Job, stats: TrainStats, deltas: Weights, kept: Weights) -> float:
        if not self.epochs or stats.diverged_at is not None:
            return 0.0
        from fedseq.common.training import train_plan

        model = job.model
        set_weights(model, {**job.weights, **job.state.get(PERSONAL_MODEL, {})})  # v_k (w^t
        # the first time)
        own = self.own_plan(job.plan)
        p_stats = train_plan(model, job.data, job.shard, own, job.seed, job.round, "personal",
                             anchor_weights=job.weights, side=Proximal(own.params))
        if p_stats.diverged_at is None:  # else v_k stays as it was
            kept.update({state_key(k, PERSONAL_MODEL): v.detach().cpu().clone()
                         for k, v in model.state_dict().items()})
        return p_stats.seconds

    def view(self, held: Weights) -> Weights:
        """Its personal blocks, overridden by its own whole model where it keeps one (v_k)."""
        model, state = split_state(held)
        return {**model, **state.get(PERSONAL_MODEL, {})}


class DittoParams(AlgorithmParams):
    """[algorithm.ditto]"""

    lam: float = Field(0.1, ge=0, description=(
        "lambda: the weight of the personal model's proximal term lambda/2 ||v - w||^2."))
    epochs: int = Field(5, ge=1, description=(
        "Epochs of the personal model a round (FedReG's \"personal local step\": 5)."))


class Ditto(FedAvg):
    """Ditto: FedAvg's global model and each client's proximally regularized own model."""

    name = "ditto"
    client_class = DittoClient
    params_model = DittoParams

    def client_params(self) -> dict[str, Any]:
        p = self.cfg.algorithm.table(self.name, DittoParams)
        return {"epochs": p.epochs, "lambda": p.lam}
