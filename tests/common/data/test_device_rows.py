"""A device's copy of the dataset: only its clients' rows, uint8 as in the files, and the same
images, labels and batches as the full copy."""

import pytest
import torch

from fedseq.common.config import load_config
from fedseq.common.data.federated import load_federated


@pytest.mark.parametrize("fraction", [1.0, 0.3])
def test_only_own_rows_and_the_same_images(data_root, fraction):
    cfg = load_config(None, [f"data.root={str(data_root)!r}", f"data.fraction={fraction}"]).data
    full = load_federated(cfg, seed=3)
    lean = load_federated(cfg, seed=3, only=[4, 17, 2])
    assert full.x.dtype == lean.x.dtype == torch.uint8  # 1 byte a pixel, scaled per batch
    assert full.x.stride()[1:] == lean.x.stride()[1:]  # oneDNN picks kernels by strides
    mine = [2, 4, 17]
    assert len(lean.x) == sum(len(full.clients[c].train) + len(full.clients[c].test) for c in mine)
    for c in range(len(full.clients)):
        if c not in mine:
            assert len(lean.clients[c].train) == len(lean.clients[c].test) == 0
            continue
        for split in ("train", "test"):
            a, b = getattr(full.clients[c], split), getattr(lean.clients[c], split)
            assert len(a) == len(b)
            assert torch.equal(full.images(a), lean.images(b))  # bit for bit
            assert torch.equal(full.y[a], lean.y[b])
    # the scaling matches scaling the whole dataset at once
    rows = full.clients[5].train[:50]
    assert torch.equal(full.images(rows), full.x.float().div(127.5).sub(1.0)[rows])
