"""An algorithm's client side: what a client does while training, beyond the plan's phases.

The trainer (common/training.py), the executor, the evaluation and the FLOP counter call these
hooks and import no algorithm. Each algorithm's module defines its `ClientSide` next to its
server side and names it on its `Algorithm` class (`client_side`); a plan names its algorithm
and carries that algorithm's own parameters (`ClientPlan.algorithm`, `ClientPlan.params`), and
`client_side(plan)` builds the hooks a client runs it with. A device without the algorithm
refuses the plan in one line (`UnknownAlgorithm`). Runs on the device floor (Python 3.8,
torch 1.12).

When the hooks run, for one client's round (`training.run_client_round`):

    start(job)                      the round's weights are loaded: gradient corrections, or None
    for every pass over the data (`training.train_plan`; Ditto's own model is a second pass):
        phase_rows(phase, ...)            a phase of the algorithm's own data source: its rows
        begin(model, counts, anchor)      before the first batch
        loss(model, obj, feats, y)        the loss of an objective of the algorithm's own kind
        penalty(model, x, feats)          a term added to every step's loss
    finish(job, stats, deltas, kept)      after training and scoring: tensors uploaded beside
                                          the deltas (`deltas`), state kept (`kept`), both
                                          changed in place; returns extra compute seconds
and for evaluation: `view` (which tensors a client is evaluated with), `head_features` (what
its heads read) and `global_prediction`. Every default does nothing: FedAvg's client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

import torch

from fedseq.common.models import BlockModel, Weights, split_state

if TYPE_CHECKING:
    from fedseq.common.algorithms.plan import ClientPlan, Objective, Phase
    from fedseq.common.data.federated import ClientShard, FederatedData
    from fedseq.common.training import PhaseRows, TrainStats


class UnknownAlgorithm(ValueError):
    """A plan this client cannot run: it names an algorithm this fedseq does not have (an older
    device), or asks for what this machine's stack lacks (DP-SGD on torch < 2.0)."""


@dataclass
class Job:
    """One client's training round as its hooks see it: the model (loaded with the round's
    weights when `start` runs), those weights (`weights`: model tensors, the client's personal
    blocks included) and the client's state blocks by tag (`state`: SCAFFOLD's "c" and "ci",
    FedDyn's "dyn", ...; `models.split_state`), the parameters it trains and uploads
    (`trained`), and where its rows and random streams come from."""

    model: BlockModel
    weights: Weights
    state: Dict[str, Weights]
    trained: Dict[str, torch.nn.Parameter]
    plan: ClientPlan
    data: FederatedData
    shard: ClientShard
    seed: int
    round: int


class ClientSide:
    """The client's half of an algorithm; the defaults are FedAvg's (nothing beyond the plan).
    One object per client round (or per evaluation), built from the plan's `params`."""

    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        self.params: Dict[str, Any] = dict(params or {})

    # -- around the round -------------------------------------------------------------------
    def start(self, job: Job) -> Optional[Dict[str, torch.Tensor]]:
        """Before training: parameter name -> a tensor added to its gradient before every step
        (SCAFFOLD's c - c_i, FedDyn's -g_k), whose raw gradients the trainer then sums
        (`TrainStats.gradients`); None: no corrections."""
        return None

    def finish(self, job: Job, stats: TrainStats, deltas: Weights, kept: Weights) -> float:
        """After training and the local score: add what is uploaded beside the model's deltas
        to `deltas` and the state the client keeps to `kept` (both in place; a diverged round
        keeps nothing). Returns the seconds of any further training (Ditto's own model)."""
        return 0.0

    def extra_plans(self, plan: ClientPlan) -> Tuple[ClientPlan, ...]:
        """Further trainings `finish` runs after the round's plan, as plans (the FLOP counter
        counts them): Ditto's own model."""
        return ()

    # -- what a phase trains on -------------------------------------------------------------
    def phase_rows(self, phase: Phase, data: FederatedData, shard: ClientShard, seed: int,
                   round: int) -> Optional[PhaseRows]:
        """The rows of a phase whose data source is this algorithm's own (`Phase.data` other
        than "local": FedReG's "rebalanced" set), from the client's rows and its random
        streams (seed, round, client); None: this side makes no such source."""
        return None

    def phase_size(self, phase: Phase, counts: torch.Tensor) -> Optional[int]:
        """The rows such a phase iterates over per epoch, from the client's training rows per
        class (what the coordinator's FLOP and step counts read); None: this side makes no
        such source."""
        return None

    # -- every pass over the data -----------------------------------------------------------
    def begin(self, model: BlockModel, counts: Optional[torch.Tensor],
              anchor: Optional[Weights]) -> None:
        """Before a pass's first batch, the model as the pass starts; `counts`: the client's
        training rows per class where the plan needs them (on the model's device); `anchor`:
        what a proximal term pulls towards where it is not the starting model (Ditto)."""

    def loss(self, model: BlockModel, obj: Objective, feats: torch.Tensor,
             y: torch.Tensor) -> Optional[torch.Tensor]:
        """The loss of one objective from the batch's base features, where it is of this
        algorithm's own kind (`Objective.loss`, e.g. "gpfl"); None: the trainer's (heads summed,
        "ce" or "balanced_ce")."""
        return None

    def penalty(self, model: BlockModel, x: torch.Tensor,
                feats: torch.Tensor) -> Optional[torch.Tensor]:
        """A term added to every step's loss (FedProx's proximal term, MOON's contrastive
        term); None: none."""
        return None

    # -- evaluation -------------------------------------------------------------------------
    def view(self, held: Weights) -> Weights:
        """The model tensors a client is evaluated with, from everything it holds: its personal
        blocks, not its state (control variates)."""
        return split_state(held)[0]

    def head_features(self, model: BlockModel, feats: torch.Tensor,
                      counts: torch.Tensor) -> torch.Tensor:
        """What a client's heads read from base features (`counts`: its training rows per
        class); default: the features."""
        return feats

    def global_prediction(self, model: BlockModel,
                          feats: torch.Tensor) -> Optional[torch.Tensor]:
        """The global model's classes from base features, where it does not predict with the
        model's head; None: it does."""
        return None

    needs_counts = False  # head_features reads the client's class counts


def client_side(plan: ClientPlan) -> ClientSide:
    """The hooks `plan` runs under: its algorithm's client side with the plan's parameters;
    UnknownAlgorithm where this client cannot run the plan."""
    if plan.record_dp is not None:
        from fedseq.common.dpsgd import unavailable

        why = unavailable()
        if why is not None:
            raise UnknownAlgorithm(why)
    return client_side_of(plan.algorithm, plan.params)


def client_side_of(algorithm: str, params: Optional[Mapping[str, Any]] = None) -> ClientSide:
    """Algorithm `algorithm`'s client side; UnknownAlgorithm where this device cannot resolve it
    (not installed here, or a plugin its settings do not allow: the registry's message says
    which, and how to fix it)."""
    from fedseq.common.algorithms import algorithm_class
    from fedseq.common.registry import RegistryError

    try:
        cls = algorithm_class(algorithm)
    except RegistryError as exc:
        raise UnknownAlgorithm(str(exc)) from None
    return cls.client_side(params)
