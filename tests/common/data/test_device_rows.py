"""A device's and the coordinator's copies of the dataset: only the rows they need, uint8 as in
the files, and the same images, labels and batches as the full copy."""

import pytest
import torch

from fedseq.common.config import load_config
from fedseq.common.data.federated import load_federated
from fedseq.common.errors import DatasetError


@pytest.mark.parametrize("fraction", [1.0, 0.3])
def test_device_holds_its_clients_rows_only(data_root, fraction):
    cfg = load_config(None, [f"data.root={str(data_root)!r}", f"data.fraction={fraction}"]).data
    full = load_federated(cfg, seed=3)
    lean = load_federated(cfg, seed=3, only=[4, 17, 2])
    assert full.x.dtype == lean.x.dtype == torch.uint8  # 1 byte a pixel, scaled per batch
    assert full.x.stride()[1:] == lean.x.stride()[1:]  # oneDNN picks kernels by strides
    mine = [2, 4, 17]
    assert len(lean.x) == sum(len(full.clients[c].train) + len(full.clients[c].test) for c in mine)
    assert torch.equal(full.y, lean.y)  # every label: the partition needs them
    for c in mine:
        for split in ("train", "test"):
            rows = getattr(full.clients[c], split)
            assert torch.equal(rows, getattr(lean.clients[c], split))
            assert torch.equal(full.images(rows), lean.images(rows))  # bit for bit
    with pytest.raises(DatasetError, match="does not hold"):
        lean.images(full.clients[0].train)
    # the per-batch scaling equals scaling the whole dataset at once
    rows = full.clients[5].train[:50]
    assert torch.equal(full.images(rows), full.x.float().div(127.5).sub(1.0)[rows])


def test_coordinator_holds_the_test_rows_only(data_root):
    cfg = load_config(None, [f"data.root={str(data_root)!r}"]).data
    full = load_federated(cfg, seed=0)
    coord = load_federated(cfg, seed=0, test_images_only=True)
    assert len(coord.x) == len(full.all_test()) < len(full.x) / 3
    assert torch.equal(coord.images(coord.all_test()), full.images(full.all_test()))
    with pytest.raises(DatasetError):
        coord.images(coord.clients[0].train)
