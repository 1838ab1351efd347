"""Model zoo. Every model declares its ordered base blocks and its heads; a block is the group of
state_dict keys under one module name (block 'conv1' = conv1.weight, conv1.bias)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from fedseq.common.errors import ConfigError
from fedseq.common.seeding import derive_seed

Weights = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """A model's block layout: ordered base blocks (input to output), the global head and, for
    two-head algorithms, the personal head."""

    base: tuple[str, ...]  # input to output
    head: str  # the global (generic) head
    personal_head: str | None  # second head for FedRoD / FedReG

    @property
    def heads(self) -> tuple[str, ...]:
        """The head blocks, global first."""
        return (self.head,) if self.personal_head is None else (self.head, self.personal_head)

    @property
    def blocks(self) -> tuple[str, ...]:
        """Every block: base then heads."""
        return self.base + self.heads


class BlockModel(nn.Module):
    """A base (feature extractor) and one or two linear heads whose logits are summed."""

    spec: ModelSpec
    BASE: tuple[str, ...]  # the base blocks' module names, input to output
    HEAD: str  # the global head's module name; a personal head is HEAD + "_p"

    @classmethod
    def block_spec(cls, two_heads: bool) -> ModelSpec:
        """The block layout, known without building the model (the module names above)."""
        return ModelSpec(cls.BASE, cls.HEAD, cls.HEAD + "_p" if two_heads else None)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, feats: torch.Tensor, heads: tuple[str, ...]) -> torch.Tensor:
        """The sum of the named heads' logits on base features."""
        out = getattr(self, heads[0])(feats)
        for h in heads[1:]:
            out = out + getattr(self, h)(feats)
        return out

    def block_params(self, block: str) -> list[nn.Parameter]:
        """The parameters of one block."""
        return list(getattr(self, block).parameters())


class CNN(BlockModel):
    """FedAvg/PFLlib CNN: conv5x5(32) pool relu, conv5x5(64) pool relu, fc(512) relu, fc(classes).

    582,026 parameters on 28x28x1 with one head (FedSeq paper, Table 3). Pooling comes before the
    ReLU: the two commute exactly (forward and gradient). Convolutions run in the default NCHW
    layout, pooling in channels-last: on CPU, NCHW max-pooling was 4x slower and channels-last
    convolutions ~20% slower (bench/sim_round.py; notes in docs/design.md).
    """

    BASE = ("conv1", "conv2", "fc1")
    HEAD = "fc2"

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool):
        super().__init__()
        c, h, w = in_shape
        self.conv1 = nn.Conv2d(c, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        dim = 64 * ((h - 4) // 2 - 4) // 2 * (((w - 4) // 2 - 4) // 2)
        self.fc1 = nn.Linear(dim, 512)
        self.fc2 = nn.Linear(512, num_classes)
        if two_heads:
            self.fc2_p = nn.Linear(512, num_classes)
        self.spec = self.block_spec(two_heads)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(_pool(self.conv1(x)))
        x = F.relu(_pool(self.conv2(x)))
        return F.relu(self.fc1(x.flatten(1)))


class ConvNet(BlockModel):
    """The ConvNet of FedDyn and FedRoD that FedReG uses (FedReG section 4.1, its testbed in
    section 5): conv5x5(64) relu pool, conv5x5(64) relu pool, fc(384) relu, fc(192) relu,
    fc(classes). Source: FedDyn's `utils_models.py` (its CIFAR-10 'ConvNet'), on 28x28x1 the
    flattened features are 64x4x4. 573,578 parameters on Fashion-MNIST with one head; four base
    blocks (conv1, conv2, fc1, fc2), so FedSeq's K is 4 on it.
    """

    BASE = ("conv1", "conv2", "fc1", "fc2")
    HEAD = "fc3"

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool):
        super().__init__()
        c, h, w = in_shape
        self.conv1 = nn.Conv2d(c, 64, 5)
        self.conv2 = nn.Conv2d(64, 64, 5)
        dim = 64 * (((h - 4) // 2 - 4) // 2) * (((w - 4) // 2 - 4) // 2)
        self.fc1 = nn.Linear(dim, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)
        if two_heads:
            self.fc3_p = nn.Linear(192, num_classes)
        self.spec = self.block_spec(two_heads)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(_pool(self.conv1(x)))
        x = F.relu(_pool(self.conv2(x)))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))


MODELS: dict[str, type[BlockModel]] = {"cnn": CNN, "convnet": ConvNet}


def _pool(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(x.contiguous(memory_format=torch.channels_last), 2)


def build_model(
    name: str, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool = False,
    generator_seed: int | None = None, head_init: str = "default",
) -> BlockModel:
    """Build a model; with generator_seed the initial weights are a pure function of that seed.
    head_init "orthogonal" then re-draws each head's weight orthogonally (model.head_init)."""
    if name not in MODELS:
        raise ConfigError(f"model.name {name!r} is unknown; use one of {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
        model = MODELS[name](in_shape, num_classes, two_heads)  # type: ignore[call-arg]
        if head_init == "orthogonal":
            with torch.no_grad():
                for head in model.spec.heads:
                    nn.init.orthogonal_(getattr(model, head).weight)
    return model


def model_spec(name: str, two_heads: bool) -> ModelSpec:
    """The block layout of model `name`, without building it (config checks before any data)."""
    if name not in MODELS:
        raise ConfigError(f"model.name {name!r} is unknown; use one of {', '.join(MODELS)}")
    return MODELS[name].block_spec(two_heads)


def block_of(key: str) -> str:
    """The block a state_dict key belongs to: `conv1.weight` -> `conv1`."""
    return key.split(".", 1)[0]


def in_blocks(weights: Weights, blocks: str | tuple[str, ...] | list[str] | set[str]) -> Weights:
    """The tensors of `weights` that belong to the named block(s), in their order."""
    wanted = {blocks} if isinstance(blocks, str) else set(blocks)
    return {k: v for k, v in weights.items() if block_of(k) in wanted}


def build_run_model(name: str, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool,
                    seed: int, head_init: str = "default") -> BlockModel:
    """The run's initial model, a pure function of the run seed: the coordinator, the in-process
    clients and every device build the same weights, so version 0 of every block never travels."""
    return build_model(name, in_shape, num_classes, two_heads,
                       generator_seed=derive_seed(seed, "init"), head_init=head_init)


def block_keys(model: BlockModel, block: str) -> list[str]:
    """The state_dict keys of one block."""
    return [k for k in model.state_dict() if block_of(k) == block]


def get_blocks(model: BlockModel, blocks: tuple[str, ...] | list[str]) -> Weights:
    """Detached contiguous host copies of the named blocks' tensors, keyed by state_dict name
    (whatever device the model is on: updates, personal state and frames live on the host)."""
    wanted = set(blocks)
    return {
        k: v.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        for k, v in model.state_dict().items()
        if block_of(k) in wanted
    }


def set_weights(model: BlockModel, weights: Weights) -> None:
    """Copy named tensors into the model in place (keeps its memory layout)."""
    state = model.state_dict()
    with torch.no_grad():
        for k, v in weights.items():
            if k not in state:
                raise KeyError(f"model has no tensor {k!r}")
            if state[k].shape != v.shape:
                raise ValueError(f"{k}: shape {tuple(v.shape)} != model's {tuple(state[k].shape)}")
            state[k].copy_(v)


def count_params(model: BlockModel, blocks: tuple[str, ...] | list[str]) -> int:
    """Number of parameters in the named blocks."""
    return sum(p.numel() for b in blocks for p in model.block_params(b))
