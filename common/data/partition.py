"""Partitioners: which sample indices each client holds. Deterministic from (seed, config)."""

from __future__ import annotations

import numpy as np

from fedseq.common.errors import ConfigError
from fedseq.common.seeding import numpy_rng


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, min_samples: int, seed: int,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-Dirichlet split as PFLlib does it: per class, Dir(alpha) proportions over the clients,
    clients already above the mean size get no more; redraw until every client has min_samples."""
    n = len(labels)
    if min_samples * num_clients > n:
        raise ConfigError(
            f"data.min_samples={min_samples} x data.num_clients={num_clients} exceeds the "
            f"{n} samples; lower data.min_samples or data.num_clients"
        )
    rng = numpy_rng(seed, "partition")
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for k in classes:
            idx = np.flatnonzero(labels == k)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = p * np.array([len(c) < n / num_clients for c in parts])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for c, chunk in zip(parts, np.split(idx, cuts)):
                c.extend(chunk.tolist())
        if min(len(c) for c in parts) >= min_samples:
            return [np.array(sorted(c), dtype=np.int64) for c in parts]
    raise ConfigError(
        f"no Dirichlet(alpha={alpha}) split gave every client {min_samples} samples in "
        f"{max_tries} draws; raise data.alpha or lower data.min_samples"
    )


def shard_partition(
    labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int
) -> list[np.ndarray]:
    """Pathological non-IID split (FedAvg/FedBABU's s): sort by label, deal out equal shards."""
    rng = numpy_rng(seed, "partition")
    order = np.argsort(labels, kind="stable")
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise ConfigError(
            f"{num_shards} shards for {len(labels)} samples; lower data.shards_per_client"
        )
    shards = np.array_split(order, num_shards)
    perm = rng.permutation(num_shards)
    return [
        np.sort(np.concatenate([shards[s] for s in perm[i::num_clients]]))
        for i in range(num_clients)
    ]


def classes_partition(labels: np.ndarray, num_clients: int, k: int, seed: int
                      ) -> list[np.ndarray]:
    """FedPer's split (its section 4.1): each client holds at most k classes, and a class's rows
    are dealt equally to the clients that hold it. The classes, in a seed-drawn order, are laid
    around the clients cyclically (client i gets positions i*k .. i*k+k-1 mod C), so every class
    has num_clients*k/C holders when that divides, and client volumes are equal when the classes
    are; a class's rows are shuffled, then cut into equal parts."""
    rng = numpy_rng(seed, "partition")
    classes = np.unique(labels)
    k = min(k, len(classes))
    order = rng.permutation(classes)
    held = [[order[(i * k + j) % len(classes)] for j in range(k)] for i in range(num_clients)]
    holders = {c: [i for i in range(num_clients) if c in held[i]] for c in classes.tolist()}
    empty = [c for c, h in holders.items() if not h]
    if empty:
        raise ConfigError(f"data.num_clients={num_clients} x data.classes_per_client={k} leaves "
                          f"{len(empty)} of the {len(classes)} classes with no client; raise "
                          "either so that their product reaches the classes")
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in classes.tolist():
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        for i, chunk in zip(holders[c], np.array_split(idx, len(holders[c]))):
            parts[i].extend(chunk.tolist())
    return [np.array(sorted(p), dtype=np.int64) for p in parts]


def iid_partition(num_samples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """IID: the rows shuffled by the seed's partition stream and cut into `num_clients` nearly equal
    parts, each sorted."""
    rng = numpy_rng(seed, "partition")
    perm = rng.permutation(num_samples)
    return [np.sort(p) for p in np.array_split(perm, num_clients)]


def train_test_split(indices: np.ndarray, train_fraction: float, seed: int, client: int):
    """Per-client shuffle, the first train_fraction to train (PFLlib's 75/25)."""
    rng = numpy_rng(seed, "split", client)
    perm = rng.permutation(indices)
    cut = int(round(len(perm) * train_fraction))
    return np.sort(perm[:cut]), np.sort(perm[cut:])
