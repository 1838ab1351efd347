import numpy as np
import pytest
import torch

from fedseq.common.config import DataConfig
from fedseq.common.data.federated import load_federated
from fedseq.common.data.partition import (
    classes_partition,
    dirichlet_partition,
    iid_partition,
    shard_partition,
    train_test_split,
)
from fedseq.common.data.rebalance import effective_count, per_class_target, rebalance
from fedseq.common.errors import ConfigError

LABELS = np.repeat(np.arange(10), 300)


def _is_partition(parts, n):
    flat = np.concatenate(parts)
    return len(flat) == n and len(np.unique(flat)) == n


def test_dirichlet_deterministic_and_complete():
    a = dirichlet_partition(LABELS, 20, 0.1, 20, seed=3)
    b = dirichlet_partition(LABELS, 20, 0.1, 20, seed=3)
    c = dirichlet_partition(LABELS, 20, 0.1, 20, seed=4)
    assert len(a) == len(b) == len(c) == 20
    assert all((x == y).all() for x, y in zip(a, b))
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a, c))
    assert _is_partition(a, len(LABELS))


def test_dirichlet_min_samples_rule():
    parts = dirichlet_partition(LABELS, 20, 0.1, 60, seed=0)
    assert min(len(p) for p in parts) >= 60


def test_dirichlet_skews_labels():
    parts = dirichlet_partition(LABELS, 10, 0.1, 10, seed=0)
    classes = [len(np.unique(LABELS[p])) for p in parts]
    assert np.mean(classes) < 6  # Dir(0.1): most clients hold a few classes


def test_dirichlet_impossible_min_is_config_error():
    with pytest.raises(ConfigError, match="min_samples"):
        dirichlet_partition(LABELS, 20, 0.1, 1000, seed=0)


def test_shards_each_client_gets_s_shards_of_few_labels():
    parts = shard_partition(LABELS, 10, 2, seed=0)
    assert _is_partition(parts, len(LABELS))
    assert all(len(p) == 300 for p in parts)
    assert all(len(np.unique(LABELS[p])) <= 2 for p in parts)


def test_iid_even():
    parts = iid_partition(3000, 7, seed=0)
    assert _is_partition(parts, 3000) and max(map(len, parts)) - min(map(len, parts)) <= 1


def test_train_test_split_is_per_client_and_stable():
    idx = np.arange(100, 200)
    tr, te = train_test_split(idx, 0.75, seed=0, client=5)
    assert len(tr) == 75 and len(te) == 25 and not set(tr) & set(te)
    tr2, _ = train_test_split(idx, 0.75, seed=0, client=5)
    tr3, _ = train_test_split(idx, 0.75, seed=0, client=6)
    assert (tr == tr2).all() and (tr != tr3).any()


def test_real_partition_is_function_of_seed_and_config(data_root):
    cfg = DataConfig(root=data_root, dataset="fmnist", num_clients=30)
    a = load_federated(cfg, seed=0)
    b = load_federated(cfg, seed=0)
    assert len(a.clients) == len(b.clients)
    assert all(torch.equal(x.train, y.train) for x, y in zip(a.clients, b.clients))
    total = sum(len(c.train) + len(c.test) for c in a.clients)
    assert total == 70000  # train and test files merged, then split per client
    assert min(len(c.train) + len(c.test) for c in a.clients) >= cfg.min_samples


def test_rebalance_counts_by_hand():
    labels = torch.tensor([0] * 10 + [1] * 2 + [2] * 6)
    idx = torch.arange(18)
    # threshold 18 over 3 held classes -> Q = 6; effective = min(10,6)+min(2,6)+min(6,6) = 14
    assert per_class_target(18, 3) == 6
    assert effective_count(torch.bincount(labels), 6) == 14
    rb = rebalance(idx, labels, 18.0, torch.Generator().manual_seed(0))
    assert rb.per_class == 6 and rb.effective == 14
    assert torch.bincount(labels[rb.indices]).tolist() == [6, 6, 6]
    # generated rows: 4 for class 1 only; originals of class 1 all present
    assert rb.augment.sum() == 4 and set(labels[rb.indices[rb.augment]].tolist()) == {1}
    assert set(rb.indices[~rb.augment & (labels[rb.indices] == 1)].tolist()) == {10, 11}


@pytest.mark.parametrize("clients,k", [(10, 4), (10, 8), (10, 10), (7, 3), (30, 2)])
def test_classes_partition_is_fedpers_split(clients, k):
    """At most k classes a client; a class's rows dealt equally to its holders; every row once;
    equal client volumes (to a row a class) where clients x k is a multiple of the classes
    (FedPer's 10 x 4/8/10)."""
    parts = classes_partition(LABELS, clients, k, seed=3)
    _is_partition(parts, len(LABELS))
    holders = {c: [i for i, p in enumerate(parts) if (LABELS[p] == c).any()] for c in range(10)}
    for p in parts:
        assert len(set(LABELS[p].tolist())) == min(k, 10)
    for c, hs in holders.items():
        sizes = [int((LABELS[parts[i]] == c).sum()) for i in hs]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 300
    if clients * k % 10 == 0:  # equal up to a row per class where a class does not divide
        assert max(map(len, parts)) - min(map(len, parts)) <= k
    again = classes_partition(LABELS, clients, k, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert any(not np.array_equal(a, b)
               for a, b in zip(parts, classes_partition(LABELS, clients, k, seed=4)))


def test_classes_partition_refuses_classes_nobody_holds():
    with pytest.raises(ConfigError, match="leaves 4 of the 10 classes with no client"):
        classes_partition(LABELS, 3, 2, seed=0)
