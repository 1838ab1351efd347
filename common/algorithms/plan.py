"""What a selected client does in a round: phases of objectives over named blocks.

Plans are plain data: the trainer executes them, the wire can carry them, and tests can read them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

#: "ce", "balanced_ce" (the trainer's) or a loss of the algorithm's own (its `ClientSide.loss`)
Loss = str
#: "local": the client's own training rows; any other name is a data source of the plan's
#: algorithm, whose client side gives its rows (`hooks.ClientSide.phase_rows`: FedReG's
#: "rebalanced" set)
DataSource = str


def ordered_union(groups: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """Block names of all groups, each once, in first-seen order."""
    seen: dict[str, None] = {}
    for g in groups:
        seen.update(dict.fromkeys(g))
    return tuple(seen)


@dataclass(frozen=True)
class Objective:
    """One optimizer step per batch: logits = sum of `heads` on the base features, `loss` on them,
    gradients only for `trainable` blocks (everything else has requires_grad=False).

    reuse_features: take the features and frozen heads' logits of the previous objective on the
    same batch, detached (FedRoD trains its personal head on the generic pass's features).

    loss: cross-entropy ("ce"), balanced softmax ("balanced_ce": FedRoD's generic head) or a loss
    the plan's algorithm computes itself (`hooks.ClientSide.loss`: GPFL's "gpfl").
    """

    heads: tuple[str, ...]
    trainable: tuple[str, ...]
    loss: Loss = "ce"
    reuse_features: bool = False


@dataclass(frozen=True)
class Phase:
    """Some epochs of one data source (the client's own rows, or one its algorithm's client side
    makes: FedReG's rebalanced set) with its objectives."""

    epochs: int
    objectives: tuple[Objective, ...]
    data: DataSource = "local"

    @property
    def trainable(self) -> tuple[str, ...]:
        """The blocks any of the phase's objectives trains, in order, each once."""
        return ordered_union(o.trainable for o in self.objectives)


@dataclass(frozen=True)
class ClientPlan:
    """Everything a selected client does in a round: phases, what to upload and keep, optimizer and
    loss settings, and the algorithm whose client side runs it (`algorithm`, with its own
    `params`: common/algorithms/hooks.py). Plain data: it crosses the wire as JSON
    (plan_to_dict / plan_from_dict)."""

    phases: tuple[Phase, ...]
    upload: tuple[str, ...]  # shared blocks whose deltas go back to the server
    personal: tuple[str, ...] = ()  # blocks that live with the client, never uploaded
    lr: float = 0.01
    momentum: float = 0.0
    batch_size: int = 20
    class_counts_needed: bool = False  # balanced softmax and GPFL need the client's label counts
    # after training, score the local model on the client's test rows with these heads summed
    # (the testbed's "locally trained model" accuracy); () = no score
    score_heads: tuple[str, ...] = ()
    # the update's wire codec (common/codecs.py `Codec.spec`: "none", "fp16", "int8:channel",
    # "topk:0.01", ...), set by the round loop from wire.up
    codec: str = "none"
    # training augmentation of every batch (train.augment: "crop", "flip", "jitter"), drawn from
    # the client's own stream (common/augment.py); () = none
    augment: tuple[str, ...] = ()
    crop_padding: int = 4
    # [privacy]: the L2 norm the client scales its whole upload to at most before it is coded
    # (DP-FedAvg's C); None: no clipping
    clip: float | None = None
    # the algorithm whose client side (hooks.ClientSide) runs the plan, and its parameters
    # (FedProx's mu, SCAFFOLD's nothing, ...: the algorithm's `client_params`)
    algorithm: str = "fedavg"
    params: Dict[str, Any] = field(default_factory=dict)
    # [privacy] level = "record": DP-SGD's (per-example clip norm C, noise multiplier z) in every
    # local step (common/dpsgd.py); None: plain SGD. Left off the wire when None
    record_dp: Optional[Tuple[float, float]] = None

    @property
    def trainable(self) -> tuple[str, ...]:
        """The blocks any phase of the plan trains, in order, each once."""
        return ordered_union(p.trainable for p in self.phases)

    @property
    def uses(self) -> tuple[str, ...]:
        """Every block an objective trains or reads logits from. The forward pass also runs the
        model's whole base, frozen blocks included: what a client must hold is the base plus
        these (the round loop's `needed`)."""
        return ordered_union(
            (*o.heads, *o.trainable) for p in self.phases for o in p.objectives
        )


def plan_to_dict(plan: ClientPlan) -> dict:
    """Plain data for the wire (JSON)."""
    from dataclasses import asdict

    d = asdict(plan)
    if not d["augment"]:
        d.pop("crop_padding")  # read by the crop alone
    if d["record_dp"] is None:
        d.pop("record_dp")  # a plain plan reads as before DP-SGD existed
    return d


def plan_from_dict(d: dict) -> ClientPlan:
    """The inverse of plan_to_dict (a plan received in a Step)."""
    phases = tuple(
        Phase(
            epochs=p["epochs"],
            data=p["data"],
            objectives=tuple(
                Objective(tuple(o["heads"]), tuple(o["trainable"]), o["loss"], o["reuse_features"])
                for o in p["objectives"]
            ),
        )
        for p in d["phases"]
    )
    fields = {k: v for k, v in d.items() if k != "phases"}
    fields["upload"] = tuple(fields["upload"])
    fields["personal"] = tuple(fields["personal"])
    fields["score_heads"] = tuple(fields.get("score_heads", ()))
    fields["augment"] = tuple(fields.get("augment", ()))
    fields["params"] = dict(fields.get("params") or {})
    if "rebalance_threshold" in fields:  # a coordinator of fedseq before FedReG's own client side
        threshold, once = fields.pop("rebalance_threshold"), fields.pop("rebalance_once", True)
        if threshold is not None:
            fields["params"].update(threshold=threshold,
                                    rebalance="once" if once else "every-round")
    if fields.get("record_dp") is not None:
        clip, noise = fields["record_dp"]
        fields["record_dp"] = (float(clip), float(noise))
    return ClientPlan(phases=phases, **fields)
