"""Algorithms by name: each is an entry point of the group `fedseq.algorithms` (common/registry.py),
fedseq's own twenty included, found in the installed metadata; `make_algorithm` builds the
configured one. `ALGORITHMS` reads the registry as a mapping (name -> class, loaded on use)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, cast

from fedseq.common.algorithms.base import Algorithm
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.datasets import describe
from fedseq.common.models import BlockModel, ModelSpec, build_run_model, model_spec
from fedseq.common.registry import REGISTRY, RegistryError


class _Algorithms(Mapping):
    """The registered algorithms as a read-only mapping, each class imported when first read."""

    def __getitem__(self, name: str) -> type[Algorithm]:
        if not REGISTRY.has("algorithms", name):
            raise KeyError(name)
        return algorithm_class(name)

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY.names("algorithms"))

    def __len__(self) -> int:
        return len(REGISTRY.names("algorithms"))


ALGORITHMS: Mapping[str, type[Algorithm]] = _Algorithms()


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under a config name (algorithm.name); a RegistryError (a
    ConfigError) in one line where there is none, or where it is not an Algorithm."""
    loaded: Any = REGISTRY.load("algorithms", name)
    if isinstance(loaded, type) and issubclass(loaded, Algorithm):
        cls = cast("type[Algorithm]", loaded)
        if cls.name == name:
            return cls
        why = f"names itself {cls.name!r}: its class attribute `name` must be its entry point's name"
    else:
        why = "is not a fedseq Algorithm subclass"
    entry = REGISTRY.entry("algorithms", name)
    raise RegistryError(f"algorithm {name!r} of {entry.distribution} ({entry.value}) {why}")


def model_layout(name: str) -> dict[str, bool]:
    """What algorithm `name` adds to any model, as build_model's and model_spec's keywords:
    a personal second head (two_heads: FedRoD, FedReG), GPFL's CoV and GCE (valve)."""
    cls = algorithm_class(name)
    return {"two_heads": cls.two_heads, "valve": cls.valve}


def run_model(cfg: ExperimentConfig, in_shape: tuple[int, int, int] | None = None,
              num_classes: int | None = None) -> BlockModel:
    """The run's initial model (a pure function of its init seed) with the layout its algorithm
    needs; the input shape and classes are the dataset's own unless given."""
    if in_shape is None or num_classes is None:
        in_shape, num_classes = describe(cfg.data.dataset, cfg.data.options)
    return build_run_model(cfg.model.name, in_shape, num_classes, seed=cfg.seed_for("init"),
                           head_init=cfg.model.head_init, norm=cfg.model.norm,
                           options=cfg.model.options, **model_layout(cfg.algorithm.name))


def run_model_spec(cfg: ExperimentConfig) -> ModelSpec:
    """The block layout of the run's model, before any data is read."""
    in_shape, num_classes = describe(cfg.data.dataset, cfg.data.options)
    return model_spec(cfg.model.name, norm=cfg.model.norm, in_shape=in_shape,
                      num_classes=num_classes, options=cfg.model.options,
                      **model_layout(cfg.algorithm.name))


def make_algorithm(cfg: ExperimentConfig, spec: ModelSpec) -> Algorithm:
    """The configured algorithm for a model's block layout."""
    return algorithm_class(cfg.algorithm.name)(cfg, spec)


__all__ = ["ALGORITHMS", "Algorithm", "algorithm_class", "make_algorithm", "model_layout",
           "run_model", "run_model_spec"]
