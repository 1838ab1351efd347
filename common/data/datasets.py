"""What a dataset entry point (group `fedseq.datasets`, common/registry.py) is, and the catalog's
datasets written as such entries.

A dataset describes itself without files (its classes and input shape, so the coordinator can
check a config before any data exists) and loads its rows from a data root. The catalog's
datasets (common/data/catalog.py) are registered in fedseq's pyproject.toml exactly as a lab's
package registers its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from fedseq.common.data.catalog import CHANNEL_STATS, INPUT_SHAPES, NUM_CLASSES
from fedseq.common.data.readers import RawDataset, read_dataset
from fedseq.common.errors import ConfigError


class Dataset:
    """A dataset entry point: an instance (or a class with these methods) registered under a
    name. `options_model`, a pydantic model, validates `[data.options]`; None: no options."""

    options_model: Any = None

    def describe(self, options: Dict[str, Any]) -> Tuple[Tuple[int, int, int], int]:
        """(input shape (C, H, W), number of classes), known without reading a file."""
        raise NotImplementedError

    def channel_stats(self, options: Dict[str, Any]) -> Optional[tuple]:
        """Each channel's (mean, std) in [0, 1] units for data.normalize = "channel"; None: none."""
        return None

    def load(self, root: Path, options: Dict[str, Any], rows: Optional[np.ndarray] = None
             ) -> RawDataset:
        """The pooled rows (train then test, `num_train` marking the split) under data root
        `root`; with `rows`, only those images are materialized (labels: all)."""
        raise NotImplementedError

    def load_part(self, path: Path, options: Dict[str, Any]) -> RawDataset:
        """Every row of one part of a client's data on a device (data.placement = "device";
        common/data/placed.py): the file or folder `path`, e.g. `<client>/train`. By default
        the dataset's `load` with `path` as its root."""
        return self.load(path, options)


class CatalogDataset(Dataset):
    """One dataset of the catalog, read by common/data/readers.py."""

    def __init__(self, name: str):
        self.name = name

    def describe(self, options: Dict[str, Any]) -> Tuple[Tuple[int, int, int], int]:
        _no_options(self.name, options)
        return INPUT_SHAPES[self.name], NUM_CLASSES[self.name]

    def channel_stats(self, options: Dict[str, Any]) -> Optional[tuple]:
        return CHANNEL_STATS.get(self.name)

    def load(self, root: Path, options: Dict[str, Any], rows: Optional[np.ndarray] = None
             ) -> RawDataset:
        _no_options(self.name, options)
        return read_dataset(Path(root), self.name, rows)

    def __repr__(self) -> str:
        return f"CatalogDataset({self.name!r})"


def _no_options(name: str, options: Dict[str, Any]) -> None:
    if options:
        raise ConfigError(f"data.options {sorted(options)}: the catalog dataset {name} takes no "
                          "options; remove [data.options]")


MNIST = CatalogDataset("mnist")
FMNIST = CatalogDataset("fmnist")
CIFAR10 = CatalogDataset("cifar10")
CIFAR100 = CatalogDataset("cifar100")
EMNIST_BYCLASS = CatalogDataset("emnist-byclass")
EMNIST_BYMERGE = CatalogDataset("emnist-bymerge")
EMNIST_BALANCED = CatalogDataset("emnist-balanced")
EMNIST_LETTERS = CatalogDataset("emnist-letters")
EMNIST_DIGITS = CatalogDataset("emnist-digits")
EMNIST_MNIST = CatalogDataset("emnist-mnist")
TINY_IMAGENET = CatalogDataset("tiny-imagenet")


def dataset(name: str) -> Dataset:
    """The registered dataset `name` (common/registry.py)."""
    from fedseq.common.registry import REGISTRY

    return REGISTRY.load("datasets", name)


def describe(name: str, options: Optional[Dict[str, Any]] = None) -> Tuple[Tuple[int, int, int], int]:
    """(input shape, classes) of registered dataset `name` under its options."""
    return dataset(name).describe(dict(options or {}))


__all__ = ["CatalogDataset", "Dataset", "dataset", "describe"]
