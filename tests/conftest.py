"""Shared fixtures: the real datasets live in ../shared/data (or $FEDSEQ_DATA); never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fedseq.common.config import ExperimentConfig, load_config
from fedseq.common.data.federated import ClientShard, FederatedData

ROOT = Path(__file__).resolve().parent.parent


def shared_data_root() -> Path:
    root = Path(os.environ.get("FEDSEQ_DATA", ROOT.parent / "shared" / "data"))
    if not (root / "FashionMNIST" / "raw").is_dir():
        pytest.fail(f"real datasets not found under {root}; set FEDSEQ_DATA to the shared/data folder")
    return root


@pytest.fixture(scope="session")
def data_root() -> Path:
    return shared_data_root()


def quick_config(data_root: Path, *overrides: str) -> ExperimentConfig:
    """A small real-data experiment: 5% of FMNIST over 5 clients, all of them every round."""
    base = [
        f"data.root={str(data_root)!r}", "data.dataset=fmnist", "data.fraction=0.05",
        "data.num_clients=5", "data.alpha=0.5", "data.min_samples=40", "rounds=3",
        "train.join_ratio=1.0", "train.local_epochs=1", "train.batch_size=20",
        "algorithm.finetune_epochs=2",
    ]
    return load_config(None, base + list(overrides))


def synthetic_data(num_clients: int = 3, per_client: int = 40, classes: int = 4, seed: int = 0):
    """Random 28x28 images with a label-dependent offset: tiny, fast, learnable."""
    g = torch.Generator().manual_seed(seed)
    n = num_clients * per_client
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, 1, 28, 28, generator=g) * 0.5 + (y.float() / classes)[:, None, None, None]
    shards = []
    for c in range(num_clients):
        idx = torch.arange(c * per_client, (c + 1) * per_client)
        cut = per_client * 3 // 4
        shards.append(ClientShard(c, idx[:cut], idx[cut:]))
    return FederatedData(x, y, classes, tuple(shards))
