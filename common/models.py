"""Model zoo. Every model declares its ordered base blocks and its heads; a block is the group of
state_dict keys under one module name (block 'conv1' = conv1.weight, conv1.bias, and under
model.norm "running" or "fedbn" its BatchNorm layers' running_mean and running_var)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F
from torch import nn

from fedseq.common.errors import ConfigError
from fedseq.common.seeding import derive_seed

Weights = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """A model's block layout: ordered base blocks (input to output), the global head and, for
    two-head algorithms, the personal head; for GPFL, its two modules between base and head."""

    base: tuple[str, ...]  # input to output
    head: str  # the global (generic) head
    personal_head: str | None  # second head for FedRoD / FedReG
    valve: tuple[str, ...] = ()  # GPFL's CoV and GCE (`VALVE`, `add_valve`); () = none

    @property
    def heads(self) -> tuple[str, ...]:
        """The head blocks, global first."""
        return (self.head,) if self.personal_head is None else (self.head, self.personal_head)

    @property
    def blocks(self) -> tuple[str, ...]:
        """Every block: base, GPFL's modules, heads."""
        return self.base + self.valve + self.heads


class BlockModel(nn.Module):
    """A base (feature extractor) and one or two linear heads whose logits are summed."""

    spec: ModelSpec
    BASE: tuple[str, ...]  # the base blocks' module names, input to output
    HEAD: str  # the global head's module name; a personal head is HEAD + "_p"
    #: the model has normalization layers (model.norm chooses what they keep; module docstring)
    HAS_NORM = False
    #: model.norm: "batch" (batch statistics only), "running" or "fedbn" (running statistics)
    norm = "batch"

    @property
    def batch_stats(self) -> bool:
        """A row's features depend on the other rows of its batch (BatchNorm on batch statistics,
        in evaluation too)."""
        return self.HAS_NORM and self.norm == "batch"

    def norm_layers(self) -> list[str]:
        """The module paths of the normalization layers, in state_dict order."""
        return [n for n, m in self.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def personal_keys(self) -> frozenset[str]:
        """The tensors that stay with each client whatever the plan says: every normalization
        layer's scale, shift and running statistics under model.norm = "fedbn" (FedBN), else none."""
        if self.norm != "fedbn":
            return frozenset()
        if "_personal_keys" not in self.__dict__:  # the layout never changes: computed once
            layers = tuple(n + "." for n in self.norm_layers())
            self.__dict__["_personal_keys"] = frozenset(
                k for k in self.state_dict() if k.startswith(layers))
        return self.__dict__["_personal_keys"]

    @classmethod
    def block_spec(cls, two_heads: bool, valve: bool = False) -> ModelSpec:
        """The block layout, known without building the model (the module names above)."""
        return ModelSpec(cls.BASE, cls.HEAD, cls.HEAD + "_p" if two_heads else None,
                         VALVE if valve else ())

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The base blocks' output for a batch `x`: the features every head reads (`logits`). A
        model of your own implements this and names its blocks (BASE, HEAD)."""
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
        """conv1, conv2 (each pooled) and fc1: the 512 features the heads read."""
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
        """conv1, conv2 (each pooled), fc1 and fc2: the 192 features the heads read."""
        x = F.relu(_pool(self.conv1(x)))
        x = F.relu(_pool(self.conv2(x)))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))


NORMS = ("batch", "running", "fedbn")


def _bn(channels: int, norm: str) -> nn.BatchNorm2d:
    """BatchNorm as model.norm says (docs/models.md, "Normalization in FL"):

    - "batch": FedBABU's (its code, models/Nets.py), batch statistics only
      (track_running_stats=False), in training and evaluation. No running state: scale and shift
      are parameters of their block like any other.
    - "running" and "fedbn": running mean and variance as buffers of the layer, in its block's
      state_dict, so they travel, aggregate, stay personal and are checkpointed with their block
      (fedbn: with the client, model.personal_keys). No batch counter: momentum is fixed (0.1),
      so the counter would be an int64 that averages to nothing. A block in training mode updates
      them; a frozen block is in evaluation mode (common/training.set_trainable) and normalizes by
      them, unchanged."""
    if norm == "batch":
        return nn.BatchNorm2d(channels, track_running_stats=False)
    layer = nn.BatchNorm2d(channels)
    layer.register_buffer("num_batches_tracked", None)
    return layer


class _BlockStack(BlockModel):
    """Base blocks applied in turn, average pooling over POOL x POOL (1: none), a linear head."""

    HEAD = "fc"
    POOL = 1
    HAS_NORM = True

    def _add_heads(self, channels: int, h: int, w: int, num_classes: int, two_heads: bool) -> None:
        dim = channels * (h // self.POOL) * (w // self.POOL)
        self.fc = nn.Linear(dim, num_classes)
        if two_heads:
            self.fc_p = nn.Linear(dim, num_classes)
        self.spec = self.block_spec(two_heads)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.BASE:
            x = getattr(self, name)(x)
        return (F.avg_pool2d(x, self.POOL) if self.POOL > 1 else x).flatten(1)


def _strided(h: int, w: int) -> tuple[int, int]:
    """The map size after a stride-2 conv3x3 with padding 1."""
    return (h - 1) // 2 + 1, (w - 1) // 2 + 1


class FourConvNet(_BlockStack):
    """FedBABU's 4convNet (its appendix A; CNNCifar in its code): four blocks of conv3x3(64,
    padding 1), BatchNorm, ReLU, max-pool 2, and a linear head on the flattened features (64 x 2
    x 2 on 32x32 input, 64 on 28x28). 115,658 parameters on CIFAR-10; FedSeq's K = 4."""

    BASE = ("conv1", "conv2", "conv3", "conv4")

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool,
                 norm: str = "batch"):
        super().__init__()
        self.norm = norm
        c, h, w = in_shape
        for i, name in enumerate(self.BASE):
            setattr(self, name, nn.Sequential(nn.Conv2d(c if i == 0 else 64, 64, 3, padding=1),
                                              _bn(64, norm), nn.ReLU(), nn.MaxPool2d(2)))
            h, w = h // 2, w // 2
        self._add_heads(64, h, w, num_classes, two_heads)


class _Separable(nn.Module):
    """MobileNet-v1's basic block: a depthwise conv3x3 and a pointwise conv1x1, each with
    BatchNorm and ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
        self.bn1 = _bn(cin, norm)
        self.conv2 = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = _bn(cout, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class MobileNet(_BlockStack):
    """MobileNet-v1 for CIFAR-sized input (Howard et al. 2017), as FedBABU's code builds it
    (MobileNetCifar): a conv3x3(32) stem with BatchNorm and ReLU, 13 depthwise-separable basic
    blocks (64, 128/2, 128, 256/2, 256, 512/2, 5 x 512, 1024/2, 1024; /2 = stride 2), average
    pooling over 2x2 and a linear head (1024 features on 32x32 and 28x28 input). Blocks: the stem
    and each basic block, so FedSeq's K = 14 and FedPer's K_P counts basic blocks. 3,309,476
    parameters on CIFAR-100 (~13 MB as float32)."""

    WIDTHS = (64, (128, 2), 128, (256, 2), 256, (512, 2), 512, 512, 512, 512, 512, (1024, 2), 1024)
    BASE = ("stem", *(f"block{i + 1}" for i in range(len(WIDTHS))))
    POOL = 2

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool,
                 norm: str = "batch"):
        super().__init__()
        self.norm = norm
        c, h, w = in_shape
        self.stem = nn.Sequential(nn.Conv2d(c, 32, 3, 1, 1, bias=False), _bn(32, norm), nn.ReLU())
        cin = 32
        for name, width in zip(self.BASE[1:], self.WIDTHS):
            cout, stride = width if isinstance(width, tuple) else (width, 1)
            setattr(self, name, _Separable(cin, cout, stride, norm))
            cin = cout
            if stride == 2:
                h, w = _strided(h, w)
        self._add_heads(cin, h, w, num_classes, two_heads)


class _Residual(nn.Module):
    """ResNet's basic block: two conv3x3 with BatchNorm, a shortcut (conv1x1 + BatchNorm where
    the shape changes), ReLU after the sum."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = _bn(cout, norm)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = _bn(cout, norm)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          _bn(cout, norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class _ResNet(_BlockStack):
    """ResNet for 32x32 input (He et al. 2016, the CIFAR form FedPer and FedBABU's appendix
    use): a conv3x3(64) stem with BatchNorm and ReLU, basic blocks in four stages (64, 128, 256,
    512 channels; stages 2-4 start with stride 2), average pooling over 4x4 and a linear head
    (512 features on 32x32 and 28x28 input). Blocks: the stem and each basic block, FedPer's
    unit for K_P."""

    STAGES: tuple[int, ...] = ()
    POOL = 4

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool,
                 norm: str = "batch"):
        super().__init__()
        self.norm = norm
        c, h, w = in_shape
        self.stem = nn.Sequential(nn.Conv2d(c, 64, 3, 1, 1, bias=False), _bn(64, norm), nn.ReLU())
        cin, names = 64, iter(self.BASE[1:])
        for stage, count in enumerate(self.STAGES):
            cout = 64 * 2 ** stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                setattr(self, next(names), _Residual(cin, cout, stride, norm))
                cin = cout
                if stride == 2:
                    h, w = _strided(h, w)
        self._add_heads(cin, h, w, num_classes, two_heads)


class ResNet18(_ResNet):
    """ResNet-18: 2 basic blocks a stage, 8 in all (FedSeq's K = 9 with the stem). 11,173,962
    parameters on CIFAR-10 (~45 MB as float32)."""

    STAGES = (2, 2, 2, 2)
    BASE = ("stem", *(f"block{i + 1}" for i in range(8)))


class ResNet34(_ResNet):
    """ResNet-34 (FedPer's): 3, 4, 6, 3 basic blocks, 16 in all. 21,282,122 parameters on
    CIFAR-10."""

    STAGES = (3, 4, 6, 3)
    BASE = ("stem", *(f"block{i + 1}" for i in range(16)))


#: GPFL's modules (Zhang et al., ICCV 2023): its Conditional Valve and Global Category Embedding
VALVE = ("cov", "gce")


class ConditionalValve(nn.Module):
    """GPFL's CoV: the base features x, scaled and shifted by what a conditional input c (one
    vector) makes of them: relu(x * (gamma(c) + 1) + beta(c)), gamma and beta each
    Linear(d, d), ReLU, LayerNorm(d), as GPFL's code (PFLlib's servergpfl.py) builds them."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))
        self.beta = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return F.relu(x * (self.gamma(cond) + 1) + self.beta(cond))


def add_valve(model: BlockModel, num_classes: int) -> None:
    """Give `model` GPFL's modules, blocks of their own: `cov` (a ConditionalValve on the head's
    input features) and `gce` (the Global Category Embedding, one row of that width per class,
    nn.Embedding's N(0, 1) initialization)."""
    dim = getattr(model, model.HEAD).in_features
    model.cov = ConditionalValve(dim)
    model.gce = nn.Embedding(num_classes, dim)
    model.spec = replace(model.spec, valve=VALVE)


def _pool(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(x.contiguous(memory_format=torch.channels_last), 2)


class _Features(BaseException):
    """Raised at a plain module's head to hand its input (the base features) back."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value


class ModuleBlocks(BlockModel):
    """A plain `nn.Module` (a plugin model's factory may return one) as a BlockModel: its top-level
    children that hold parameters are its blocks in order, the last one the head, whose input is
    the base features and whose output the logits. The children are the module's own (shared,
    not copied), so state_dict keys are `<child>.<...>` as the blocks need; the module's forward
    runs up to the head (a pre-hook hands the head's input back), so any forward works.

    Parameters directly on the module, or normalization layers with running statistics, have no
    block: a model with those declares its blocks as a BlockModel subclass."""

    _net: nn.Module  # the wrapped module, not a submodule (its tensors are the blocks')

    def __init__(self, net: nn.Module, two_heads: bool, what: str = "the model"):
        super().__init__()
        blocks = [(n, m) for n, m in net.named_children() if next(m.parameters(), None) is not None]
        loose = [n for n, _ in net.named_parameters(recurse=False)]
        if loose:
            raise ConfigError(f"{what}: parameter(s) {', '.join(loose)} sit on the module itself, "
                              "outside any child: put them in a child module (a block), or declare "
                              "the blocks as a fedseq BlockModel subclass")
        if len(blocks) < 2:
            raise ConfigError(f"{what} has {len(blocks)} top-level child module(s) with parameters; "
                              "it needs at least two (base blocks, then the head)")
        running = [n for n, m in net.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                   and m.track_running_stats]
        if running:
            raise ConfigError(f"{what}: normalization layer(s) {', '.join(running[:3])} keep running "
                              "statistics, which a plain module gives no rule for: build them with "
                              "track_running_stats=False, or declare a fedseq BlockModel subclass")
        for name, module in blocks:
            self.add_module(name, module)
        object.__setattr__(self, "_net", net)  # not a submodule: its tensors are the blocks'
        self.HEAD = blocks[-1][0]
        self.BASE = tuple(n for n, _ in blocks[:-1])
        if two_heads:  # the personal head: the head's architecture, freshly initialized
            personal = copy.deepcopy(blocks[-1][1])
            for m in personal.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
            self.add_module(self.HEAD + "_p", personal)
        self.spec = ModelSpec(self.BASE, self.HEAD, self.HEAD + "_p" if two_heads else None)

    def train(self, mode: bool = True) -> ModuleBlocks:
        self._net.train(mode)  # a forward may read its own `training` flag
        return super().train(mode)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The wrapped module's input to its head: its forward run up to the head, where a pre-hook
        stops it."""
        def stop(module: nn.Module, args: tuple) -> None:
            raise _Features(args[0])

        hook = getattr(self, self.HEAD).register_forward_pre_hook(stop)
        try:
            self._net(x)
        except _Features as got:
            return got.value
        finally:
            hook.remove()
        raise ConfigError(f"the model's forward never called its head {self.HEAD!r} (its last "
                          "child with parameters): make the head the last module it calls")


def _model_factory(name: str, norm: str) -> Any:
    """The registered model `name` (common/registry.py), where model.norm suits it (a ConfigError
    says why not)."""
    from fedseq.common.registry import REGISTRY

    factory = REGISTRY.load("models", name)
    if norm not in NORMS:
        raise ConfigError(f"model.norm {norm!r} is unknown; use one of {', '.join(NORMS)}")
    if norm != "batch" and not (_is_block_class(factory) and factory.HAS_NORM):
        with_norm = ", ".join(n for n in REGISTRY.names("models")
                              if _is_block_class(m := REGISTRY.load("models", n)) and m.HAS_NORM)
        raise ConfigError(f"model.norm = {norm!r} needs normalization layers, and {name} has "
                          f"none; use one of {with_norm}, or model.norm = \"batch\"")
    return factory


def _is_block_class(factory: Any) -> bool:
    return isinstance(factory, type) and issubclass(factory, BlockModel)


def build_model(
    name: str, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool = False,
    generator_seed: int | None = None, head_init: str = "default", norm: str = "batch",
    valve: bool = False, options: dict[str, Any] | None = None,
) -> BlockModel:
    """Build a registered model; with generator_seed the initial weights are a pure function of
    that seed. head_init "orthogonal" then re-draws each head's weight orthogonally
    (model.head_init); norm is model.norm (what the normalization layers keep, `_bn`); valve adds
    GPFL's modules (`add_valve`), drawn last, so the rest is the model without them. A
    BlockModel subclass is called as (in_shape, num_classes, two_heads[, norm], **options); any
    other factory as (in_shape, num_classes, **options), a plain nn.Module it returns adapted by
    ModuleBlocks."""
    factory = _model_factory(name, norm)
    options = dict(options or {})
    with torch.random.fork_rng(devices=[]):
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
        model = _construct(name, factory, in_shape, num_classes, two_heads, norm, options)
        if head_init == "orthogonal":
            with torch.no_grad():
                for head in model.spec.heads:
                    nn.init.orthogonal_(getattr(model, head).weight)
        if valve:
            add_valve(model, num_classes)
    return model


def _construct(name: str, factory: Any, in_shape: tuple[int, int, int], num_classes: int,
               two_heads: bool, norm: str, options: dict[str, Any]) -> BlockModel:
    what = f"model {name!r}"
    if _is_block_class(factory):
        if factory.HAS_NORM:
            return factory(in_shape, num_classes, two_heads, norm, **options)
        return factory(in_shape, num_classes, two_heads, **options)
    try:
        net = factory(tuple(in_shape), num_classes, **options)
    except TypeError as exc:
        raise ConfigError(f"{what} cannot be built with [model.options] {options} ({exc}); "
                          "check the option names against its factory") from exc
    if isinstance(net, BlockModel):
        if two_heads and net.spec.personal_head is None:
            raise ConfigError(f"{what} is a BlockModel without a personal head, which this "
                              "algorithm needs (a two-head algorithm: FedRoD, FedReG)")
        return net
    if not isinstance(net, nn.Module):
        raise ConfigError(f"{what}'s factory returned {type(net).__name__}, not a torch.nn.Module")
    return ModuleBlocks(net, two_heads, what)


def model_spec(name: str, two_heads: bool, norm: str = "batch", valve: bool = False,
               in_shape: tuple[int, int, int] | None = None, num_classes: int | None = None,
               options: dict[str, Any] | None = None) -> ModelSpec:
    """The block layout of model `name` (config checks before any data): a BlockModel subclass
    declares it; another factory's model is built once (on the CPU) to read it."""
    factory = _model_factory(name, norm)
    if _is_block_class(factory) and not options:
        return factory.block_spec(two_heads, valve)
    if in_shape is None or num_classes is None:
        raise ConfigError(f"model {name!r}'s blocks are known only once it is built: give the "
                          "dataset's input shape and classes")
    return build_model(name, in_shape, num_classes, two_heads, norm=norm, valve=valve,
                       options=options).spec


def is_statistic(key: str) -> bool:
    """Whether `key` names a normalization layer's running statistic (not a parameter)."""
    return key.endswith((".running_mean", ".running_var"))


def block_of(key: str) -> str:
    """The block a state_dict key belongs to: `conv1.weight` -> `conv1`."""
    return key.split(".", 1)[0]


def state_block(block: str, tag: str) -> str:
    """The block of `block`'s state tagged `tag`: `conv1` + "ef" -> `conv1~ef`. Never a model
    block: state travels and is kept beside the model, never loaded into it."""
    return f"{block}~{tag}"


def is_state_block(block: str) -> bool:
    """Whether `block` holds state (`state_block`), not model tensors."""
    return "~" in block


def state_key(key: str, tag: str) -> str:
    """The name of a state tensor that belongs to model tensor `key` (or to another state
    tensor): `conv1.weight` + "ef" -> `conv1~ef.weight`, in block `state_block("conv1", "ef")`."""
    block, rest = key.split(".", 1)
    return f"{state_block(block, tag)}.{rest}"


def split_state(weights: Weights) -> tuple[Weights, dict[str, Weights]]:
    """(the model's tensors, the state tensors by tag, each keyed by what it belongs to):
    `conv1~c~ef.weight` is tag "ef" of `conv1~c.weight`."""
    model: Weights = {}
    state: dict[str, Weights] = {}
    for k, v in weights.items():
        block, rest = k.split(".", 1)
        if is_state_block(block):
            owner, tag = block.rsplit("~", 1)
            state.setdefault(tag, {})[f"{owner}.{rest}"] = v
        else:
            model[k] = v
    return model, state


def in_blocks(weights: Weights, blocks: str | tuple[str, ...] | list[str] | set[str]) -> Weights:
    """The tensors of `weights` that belong to the named block(s), in their order."""
    wanted = {blocks} if isinstance(blocks, str) else set(blocks)
    return {k: v for k, v in weights.items() if block_of(k) in wanted}


def build_run_model(name: str, in_shape: tuple[int, int, int], num_classes: int, two_heads: bool,
                    seed: int, head_init: str = "default", norm: str = "batch",
                    valve: bool = False, options: dict[str, Any] | None = None) -> BlockModel:
    """The run's initial model, a pure function of the run seed: the coordinator, the in-process
    clients and every device build the same weights, so version 0 of every block never travels."""
    return build_model(name, in_shape, num_classes, two_heads,
                       generator_seed=derive_seed(seed, "init"), head_init=head_init, norm=norm,
                       valve=valve, options=options)


def block_keys(model: BlockModel, block: str) -> list[str]:
    """The state_dict keys of one block."""
    return [k for k in model.state_dict() if block_of(k) == block]


def get_blocks(model: BlockModel, blocks: tuple[str, ...] | list[str]) -> Weights:
    """Detached contiguous host copies of the named blocks' tensors, keyed by state_dict name
    (whatever device the model is on: updates, personal state and frames live on the host)."""
    wanted = set(blocks)
    return _host_copies(model, lambda k: block_of(k) in wanted)


def _host_copies(model: BlockModel, keep: Callable[[str], bool]) -> Weights:
    """Detached contiguous host copies of the model's tensors whose key `keep` accepts."""
    return {
        k: v.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        for k, v in model.state_dict().items()
        if keep(k)
    }


def shared_tensors(model: BlockModel, blocks: tuple[str, ...] | list[str]) -> Weights:
    """The named blocks' tensors that a client uploads: `get_blocks` less the model's personal
    tensors (FedBN's normalization layers)."""
    personal = model.personal_keys()
    return {k: v for k, v in get_blocks(model, blocks).items() if k not in personal}


def personal_tensors(model: BlockModel, blocks: tuple[str, ...] | list[str]) -> Weights:
    """What a client keeps for itself: the named (personal) blocks' tensors and the model's
    personal tensors in every block (FedBN's normalization layers), in state_dict order."""
    wanted, personal = set(blocks), model.personal_keys()
    return _host_copies(model, lambda k: block_of(k) in wanted or k in personal)


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
