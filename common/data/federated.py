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
    x: torch.Tensor  # float32 (N, C, H, W), normalized to [-1, 1]
    y: torch.Tensor  # int64 (N,)
    num_classes: int
    clients: tuple[ClientShard, ...]

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.x.shape[1:]
        return int(c), int(h), int(w)

    def all_test(self) -> torch.Tensor:
        return torch.cat([c.test for c in self.clients])


@functools.lru_cache(maxsize=2)
def _load_raw(root: str, dataset: str) -> RawDataset:
    return read_dataset(Path(root), dataset)


def client_indices(labels: np.ndarray, cfg: DataConfig, seed: int) -> list[np.ndarray]:
    """All clients' sample indices (train and test merged, as in PFLlib) for this config."""
    if cfg.partition == "dirichlet":
        return dirichlet_partition(labels, cfg.num_clients, cfg.alpha, cfg.min_samples, seed)
    if cfg.partition == "shards":
        return shard_partition(labels, cfg.num_clients, cfg.shards_per_client, seed)
    return iid_partition(len(labels), cfg.num_clients, seed)


def load_federated(cfg: DataConfig, seed: int) -> FederatedData:
    """Read the dataset files and split them over the clients; pure function of (cfg, seed)."""
    raw = _load_raw(str(cfg.root), cfg.dataset)
    images, labels = raw.images, raw.labels
    if cfg.fraction < 1.0:
        keep = np.sort(numpy_rng(seed, "subset").permutation(len(labels))[: int(len(labels) * cfg.fraction)])
        images, labels = images[keep], labels[keep]
    x = torch.from_numpy(images).float().div_(127.5).sub_(1.0)
    y = torch.from_numpy(labels)
    shards = []
    for cid, idx in enumerate(client_indices(labels, cfg, seed)):
        tr, te = train_test_split(idx, cfg.train_fraction, seed, cid)
        shards.append(ClientShard(cid, torch.from_numpy(tr), torch.from_numpy(te)))
    return FederatedData(x, y, raw.num_classes, tuple(shards))
