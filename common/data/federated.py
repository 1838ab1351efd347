"""The whole dataset as in-memory tensors plus each client's train/test indices."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedseq.common.config import DataConfig
from fedseq.common.data.partition import (
    dirichlet_partition,
    iid_partition,
    shard_partition,
    train_test_split,
)
from fedseq.common.data.readers import RawDataset, read_dataset
from fedseq.common.seeding import numpy_rng


@dataclass(frozen=True)
class ClientShard:
    """One logical client's share: indices into FederatedData.x / .y."""

    client: int
    train: torch.Tensor
    test: torch.Tensor

    def train_class_counts(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        return torch.bincount(labels[self.train], minlength=num_classes)


@dataclass(frozen=True)
class FederatedData:
    """Images as stored in the files (uint8, scaled to [-1, 1] per batch by `images`) or already
    float; labels; each client's row indices. A device's copy holds only its own clients' rows
    (the others' shards are empty)."""

    x: torch.Tensor  # uint8 (N, C, H, W) as in the files, or float32
    y: torch.Tensor  # int64 (N,)
    num_classes: int
    clients: tuple[ClientShard, ...]

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.x.shape[1:]
        return int(c), int(h), int(w)

    def images(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 images of `rows`, in [-1, 1]: the same values, bit for bit, as scaling the
        whole dataset once (the scaling is elementwise)."""
        x = self.x[rows]
        return x if x.is_floating_point() else x.float().div_(127.5).sub_(1.0)

    def all_test(self) -> torch.Tensor:
        return torch.cat([c.test for c in self.clients])


@functools.lru_cache(maxsize=2)
def _load_raw(root: str, dataset: str) -> RawDataset:
    return read_dataset(Path(root), dataset)


def _images_tensor(images: np.ndarray) -> torch.Tensor:
    """The images as a tensor with one stride layout whatever numpy left on a size-1 channel
    axis: that stride addresses nothing, but oneDNN picks its convolution kernel from it, and two
    copies of the same rows with different strides trained to different last bits."""
    x = torch.from_numpy(np.ascontiguousarray(images))
    n, c, h, w = x.shape
    return x.as_strided(x.shape, (c * h * w, 1, w, 1)) if c == 1 else x.contiguous()


def client_indices(labels: np.ndarray, cfg: DataConfig, seed: int) -> list[np.ndarray]:
    """All clients' sample indices (train and test merged, as in PFLlib) for this config."""
    if cfg.partition == "dirichlet":
        return dirichlet_partition(labels, cfg.num_clients, cfg.alpha, cfg.min_samples, seed)
    if cfg.partition == "shards":
        return shard_partition(labels, cfg.num_clients, cfg.shards_per_client, seed)
    return iid_partition(len(labels), cfg.num_clients, seed)


def load_federated(cfg: DataConfig, seed: int, only: list[int] | None = None) -> FederatedData:
    """Read the dataset files and split them over the clients; pure function of (cfg, seed).

    `only`: keep the images of these clients alone (a device): the partition still comes from
    every label, the other clients' shards are empty, and row indices are remapped to the kept
    rows, so every client's batches are the same images as in the full copy."""
    root = str(cfg.root)
    if only is None:
        raw = _load_raw(root, cfg.dataset)
        labels, num_classes = raw.labels, raw.num_classes
    else:  # labels alone first (small); images after the partition says which rows are ours
        raw = read_dataset(Path(root), cfg.dataset, rows=np.empty(0, np.int64))
        labels, num_classes = raw.labels, raw.num_classes
    keep = None
    if cfg.fraction < 1.0:
        keep = np.sort(numpy_rng(seed, "subset").permutation(len(labels))[: int(len(labels) * cfg.fraction)])
        labels = labels[keep]
    splits = [train_test_split(idx, cfg.train_fraction, seed, cid)
              for cid, idx in enumerate(client_indices(labels, cfg, seed))]
    if only is None:
        images = raw.images if keep is None else raw.images[keep]
        shards = [ClientShard(c, torch.from_numpy(tr), torch.from_numpy(te))
                  for c, (tr, te) in enumerate(splits)]
        return FederatedData(_images_tensor(images), torch.from_numpy(labels), num_classes,
                             tuple(shards))
    mine = sorted(set(only))
    rows = np.unique(np.concatenate([np.concatenate(splits[c]) for c in mine] or [np.empty(0, np.int64)]))
    file_rows = rows if keep is None else keep[rows]
    images = read_dataset(Path(root), cfg.dataset, rows=file_rows).images
    empty = torch.empty(0, dtype=torch.int64)
    shards = [ClientShard(c, torch.from_numpy(np.searchsorted(rows, tr)),
                          torch.from_numpy(np.searchsorted(rows, te)))
              if c in mine else ClientShard(c, empty, empty)
              for c, (tr, te) in enumerate(splits)]
    return FederatedData(_images_tensor(images), torch.from_numpy(labels[rows]), num_classes,
                         tuple(shards))
