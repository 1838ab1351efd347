import gzip
import shutil

import numpy as np
import pytest

from conftest import Planted
from fedseq.common.data.readers import parse_idx, read_dataset
from fedseq.common.errors import DatasetError

# Class counts of the original files, as published (shared/data/README.md).
MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_mnist_counts(data_root):
    d = read_dataset(data_root, "mnist")
    assert d.images.shape == (70000, 1, 28, 28) and d.images.dtype == np.uint8
    assert d.num_train == 60000 and d.num_classes == 10
    assert np.bincount(d.labels[:60000]).tolist() == MNIST_TRAIN
    assert np.bincount(d.labels[60000:]).tolist() == MNIST_TEST


def test_fmnist_counts(data_root):
    d = read_dataset(data_root, "fmnist")
    assert np.bincount(d.labels[:60000]).tolist() == [6000] * 10
    assert np.bincount(d.labels[60000:]).tolist() == [1000] * 10
    assert d.images.max() == 255 and d.images.min() == 0


def test_parse_idx_roundtrip_and_errors():
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    buf = bytes([0, 0, 8, 3]) + np.array([2, 3, 4], ">u4").tobytes() + arr.tobytes()
    assert (parse_idx(buf) == arr).all()
    with pytest.raises(DatasetError, match="bad magic"):
        parse_idx(b"\x01\x00\x08\x01" + buf[4:])
    with pytest.raises(DatasetError, match="truncated"):
        parse_idx(buf[:-1])
    with pytest.raises(DatasetError, match="unsupported"):
        parse_idx(bytes([0, 0, 0x0D, 3]) + buf[4:])


def test_missing_file_names_file_and_fix(data_root, tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for f in (data_root / "FashionMNIST" / "raw").glob("*labels*"):
        shutil.copy(f, raw / f.name)
    with pytest.raises(DatasetError) as info:
        read_dataset(tmp_path, "fmnist")
    msg = str(info.value)
    assert "train-images-idx3-ubyte.gz" in msg and "data.root" in msg and "\n" not in msg


def test_corrupt_gzip_is_reported(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x03")[:-3])
    with pytest.raises(DatasetError, match="decompress|truncated|IDX"):
        read_dataset(tmp_path, "mnist")


def test_cifar_missing_is_clear(tmp_path):
    with pytest.raises(DatasetError, match="cifar-10-batches-py"):
        read_dataset(tmp_path, "cifar10")


def _cifar_batch(path, protocol=2, payload=None):
    import pickle

    path.parent.mkdir(parents=True, exist_ok=True)
    batch = payload if payload is not None else {
        b"data": (np.arange(4 * 3072) % 251).astype(np.uint8).reshape(4, 3072), b"labels": [0, 1, 2, 3]}
    path.write_bytes(pickle.dumps(batch, protocol=protocol))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_batches_read_through_the_arrays_only_reader(tmp_path, protocol):
    folder = tmp_path / "cifar-10-batches-py"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        _cifar_batch(folder / name, protocol)
    raw = read_dataset(tmp_path, "cifar10")
    assert raw.images.shape == (24, 3, 32, 32) and raw.num_train == 20
    assert raw.images.reshape(24, -1)[0].tolist() == (np.arange(3072) % 251).tolist()
    assert raw.labels.tolist() == [0, 1, 2, 3] * 6


def test_a_planted_cifar_batch_runs_no_code(tmp_path):
    """A batch file that would call a function when unpickled (here: copy a file) is refused in
    one line, and the function never runs."""
    folder = tmp_path / "cifar-10-batches-py"
    marker = tmp_path / "ran"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        _cifar_batch(folder / name)
    _cifar_batch(folder / "data_batch_1", payload={b"data": Planted(marker), b"labels": [0]})
    with pytest.raises(DatasetError, match="not a CIFAR batch file") as err:
        read_dataset(tmp_path, "cifar10")
    assert not marker.exists() and "\n" not in str(err.value)
    _cifar_batch(folder / "data_batch_1", payload=[1, 2])  # no code, but not a batch
    with pytest.raises(DatasetError, match="not a dict"):
        read_dataset(tmp_path, "cifar10")
    _cifar_batch(folder / "data_batch_1", payload={b"data": np.zeros(3, np.float64), b"labels": []})
    with pytest.raises(DatasetError, match="uint8"):
        read_dataset(tmp_path, "cifar10")
