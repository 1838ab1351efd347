"""The algorithm interface: plans, aggregation weights and the server's update; no I/O, no clocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from fedseq.common.algorithms.aggregate import ClientUpdate, ServerStep
from fedseq.common.algorithms.hooks import ClientSide
from fedseq.common.algorithms.plan import ClientPlan, Objective, Phase, ordered_union
from fedseq.common.config import AlgorithmParams, ExperimentConfig
from fedseq.common.errors import ConfigError
from fedseq.common.models import ModelSpec, Weights, block_of

if TYPE_CHECKING:
    import torch

    from fedseq.common.algorithms.robust import Aggregator


class Algorithm:
    """An algorithm is a plan maker: what every selected client trains in a round (`plan`), what
    it keeps (`personal_blocks`), how its deltas are weighted (`aggregation_weights`) and what
    happens after the last round (`finetune_plan`). Pure: no I/O, no clocks, no randomness of its
    own, so the same object drives the simulation and a deployment.

    Lifecycle: built from the config and the model's block layout, `prepare`d once by the round
    loop with the partition's training-set sizes, then asked for a plan every round; after each
    round's updates are folded in, `server_update` makes the new global model. An algorithm may
    keep server state across rounds (`server_state`, checkpointed with the run and given back
    by `load_server_state` on resume): the server optimizers do (serveropt.py). It may send the
    selected clients more than the model (`broadcast`) and have them upload more than deltas
    (blocks of their own in the plan's `upload`, bounded by `upload_bound`): SCAFFOLD does
    (scaffold.py).

    Its client half is `client_class` (common/algorithms/hooks.py: extra loss terms, gradient
    corrections, state a client keeps, what it uploads beside the deltas), built on the client
    from the plan's `params` (`client_params`).

    Default behaviour is FedAvg: train every block, upload every block, nothing personal."""

    name = "fedavg"
    two_heads = False  # needs a personal second head (FedRoD, FedReG)
    valve = False  # needs GPFL's CoV and GCE between base and head (models.add_valve)
    #: the algorithm ends with every client fine-tuning locally (FedBABU, FedSeq)
    fine_tunes = False
    #: what the global model is when evaluated, where it is not a trained whole model
    global_model_note: str | None = None
    #: why the algorithm cannot run asynchronously (train.mode = "async"); None: it can
    async_problem: str | None = None
    #: why it cannot take several site rounds per global round ([hierarchy] edge_rounds > 1,
    #: server/rounds/sites.py: a site's update is then k site rounds' model change); None: it can
    site_rounds_problem: str | None = None
    #: its `server_update` steps the model itself (server optimizers, FedDyn, SCAFFOLD, FedNova:
    #: they read algorithm.server_lr where they have one); False: FedAvg's step, which the
    #: buffered-asynchronous loop scales by algorithm.server_lr
    own_server_step = False
    #: what its clients do beyond the plan's phases (hooks.ClientSide: FedAvg's, nothing)
    client_class: type[ClientSide] = ClientSide
    #: its own parameters, the table [algorithm.<name>] (config.AlgorithmParams, declared in its
    #: module and validated with the config); None: it has none
    params_model: type[AlgorithmParams] | None = None

    def __init__(self, cfg: ExperimentConfig, spec: ModelSpec):
        self.cfg = cfg
        self.spec = spec
        if self.finetunes(cfg):
            finetune_trained(cfg, spec)  # a block name the model lacks fails now, not at the end

    def prepare(self, train_sizes: list[int]) -> None:
        """Called once before the first plan with every client's training-set size (client
        order). Default: nothing; FedReG derives its rebalancing threshold from them."""

    # -- what clients do -------------------------------------------------------------------
    def personal_blocks(self) -> tuple[str, ...]:
        """Blocks each client keeps for itself: never uploaded, never aggregated."""
        return ()

    def shared_blocks(self) -> tuple[str, ...]:
        """Blocks the server aggregates (every block that is not personal)."""
        return tuple(b for b in self.spec.blocks if b not in self.personal_blocks())

    def eval_heads(self) -> tuple[str, ...]:
        """Heads summed for a client's personalized prediction."""
        return (self.spec.head,)

    def phases(self, round: int) -> tuple[Phase, ...]:
        """The local training phases of `round` (the plan's core; subclasses override this)."""
        epochs = self.cfg.train.local_epochs
        return (Phase(epochs, (Objective((self.spec.head,), self.spec.blocks),)),)

    def plan(self, round: int) -> ClientPlan:
        """What every selected client does in `round`: phases, uploads, personal blocks, optimizer
        and loss settings."""
        phases = self.phases(round)
        trained = ordered_union(p.trainable for p in phases)
        personal = self.personal_blocks()
        t = self.cfg.train
        return ClientPlan(
            phases=phases,
            upload=tuple(b for b in trained if b not in personal),
            personal=personal,
            lr=self.cfg.lr_at(round),
            momentum=t.momentum,
            batch_size=t.batch_size,
            class_counts_needed=any(o.loss != "ce" for p in phases for o in p.objectives),
            score_heads=self.eval_heads(),
            augment=tuple(t.augment),
            crop_padding=t.crop_padding,
            clip=self.cfg.privacy.clip_norm if self.cfg.privacy.client_level else None,
            record_dp=((self.cfg.privacy.clip_norm, self.cfg.privacy.noise_multiplier)
                       if self.cfg.privacy.record_level else None),
            algorithm=self.name,
            params=self.client_params(),
        )

    def client_params(self) -> dict[str, Any]:
        """The parameters its client side reads (plain JSON data, in every plan); default:
        none."""
        return {}

    @classmethod
    def client_side(cls, params: Mapping[str, Any] | None = None) -> ClientSide:
        """Its client half for a plan's `params` (hooks.client_side)."""
        return cls.client_class(params)

    def finetune_plan(self) -> ClientPlan | None:
        """After the last round: every client fine-tunes locally (`local_finetune_plan`) where
        `finetunes` says so; None = no fine-tuning."""
        return local_finetune_plan(self.cfg, self.spec) if self.finetunes(self.cfg) else None

    @classmethod
    def finetunes(cls, cfg: ExperimentConfig) -> bool:
        """Whether a run of `cfg` ends with fine-tuning: algorithm.final_finetune if set, else
        whether the algorithm declares it (`fine_tunes`: FedBABU, FedSeq, local); never with
        algorithm.finetune_epochs = 0. Known before any model is built (the CLI's progress
        line). A two-head or GPFL algorithm cannot be made to fine-tune: ConfigError."""
        chosen = cfg.algorithm.final_finetune
        if chosen and (cls.two_heads or cls.valve):
            how = "two heads" if cls.two_heads else "its head on GPFL's conditional valve"
            raise ConfigError(f"algorithm.final_finetune = true: {cls.name} predicts with {how}, "
                              "which the final fine-tuning (one head on the base) does not train; "
                              "unset it")
        wanted = cls.fine_tunes if chosen is None else chosen
        return wanted and cfg.algorithm.finetune_epochs > 0

    # -- aggregation and the server's update ------------------------------------------------
    def aggregation_weights(self, update: ClientUpdate) -> dict[str, float]:
        """Per-block weight of one client's deltas; default: its sample count."""
        return {block_of(k): float(update.num_samples) for k in update.deltas}

    def effective_samples(self, counts: torch.Tensor) -> int | None:
        """What a client's update must say as its effective_samples, from its training rows
        per class (FedReG: the original rows of its rebalanced set); default: None, no such
        count (the round contract then wants none)."""
        return None

    def server_update(self, global_weights: Weights, aggregate: Aggregator) -> ServerStep:
        """The new global tensors from the round's aggregate (every valid update folded in by
        the configured aggregation rule) and the names of those that changed (their blocks get
        a new version); default: FedAvg's, the global model plus the mean delta. Raises
        AggregationError (the round is refused) and then must leave the algorithm's state as it
        was."""
        new = aggregate.apply(global_weights)
        return ServerStep(new, frozenset(aggregate.moved()))

    def broadcast(self, shared: Weights) -> Weights:
        """Tensors besides the model that every selected client receives with its round's
        blocks (`shared`: the global model's shared tensors), in blocks of their own; default:
        none. SCAFFOLD's server control variate (scaffold.py)."""
        return {}

    def upload_bound(self, key: str, bound: float) -> float:
        """The largest |element| a valid update may carry in tensor `key`, given the round's
        bound on the model's deltas (aggregation.max_abs_delta); default: that bound."""
        return bound

    def server_state(self) -> Weights:
        """Tensors the algorithm keeps on the server across rounds (saved in every checkpoint);
        default: none."""
        return {}

    def load_server_state(self, state: Weights) -> None:
        """Continue from a checkpoint's `server_state` (a resumed run)."""


def finetune_trained(cfg: ExperimentConfig, spec: ModelSpec) -> tuple[str, ...]:
    """The blocks the final fine-tuning trains (algorithm.finetune_blocks), in the model's
    order: every block for "all", the head for "head", else the listed blocks ("head" naming
    the model's head). A name the model lacks is a ConfigError naming the model's blocks."""
    chosen = cfg.algorithm.finetune_blocks
    if chosen == "all":
        return spec.blocks
    names = {spec.head if n == "head" else n for n in ([chosen] if isinstance(chosen, str) else chosen)}
    unknown = sorted(names - set(spec.blocks))
    if unknown:
        raise ConfigError(
            f"algorithm.finetune_blocks names {', '.join(unknown)}, which the {cfg.model.name} "
            f"model lacks; its blocks are {', '.join(spec.blocks)} (\"head\" = {spec.head}), "
            f"e.g. --set 'algorithm.finetune_blocks=[\"{spec.base[0]}\", \"head\"]'")
    return tuple(b for b in spec.blocks if b in names)


def local_finetune_plan(cfg: ExperimentConfig, spec: ModelSpec) -> ClientPlan:
    """Every client's final fine-tuning (FedBABU, FedSeq, local): algorithm.finetune_epochs on
    its own rows, every block kept (nothing is uploaded); the whole model, the head alone under
    the federated base, or the blocks listed (`finetune_trained`)."""
    trained = finetune_trained(cfg, spec)
    phase = Phase(cfg.algorithm.finetune_epochs, (Objective((spec.head,), trained),))
    t = cfg.train
    return ClientPlan((phase,), upload=(), personal=spec.blocks, lr=t.lr, momentum=t.momentum,
                      batch_size=t.batch_size, augment=tuple(t.augment),
                      crop_padding=t.crop_padding)


def base_only_phase(spec: ModelSpec, trainable_base: tuple[str, ...], epochs: int) -> Phase:
    """Train some base blocks under a frozen head (FedBABU, FedSeq)."""
    return Phase(epochs, (Objective((spec.head,), trainable_base),))
