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
    for labels in (["a", "b"], [0, 10], [0], None, [0.5, 1]):  # not one class id per image
        _cifar_batch(folder / "data_batch_1",
                     payload={b"data": np.zeros((2, 3072), np.uint8), b"labels": labels})
        with pytest.raises(DatasetError, match="class id in 0..9 per 3,072-byte image"):
            read_dataset(tmp_path, "cifar10")


class _Reduced:
    """Pickles as `func(*args)` with `state` set on it: hand-made numpy pickles of any form."""

    def __init__(self, func, args, state):
        self.reduced = (func, args, state)

    def __reduce__(self):
        return self.reduced


def _object_array_pickle(flags):
    """A batch whose labels are an object array: with these dtype flags (0: cleared, so numpy does
    not know it holds pointers) numpy's own reader takes the file's bytes as a pointer, and
    reading the labels dereferences 0x4141414141414141."""
    from numpy.core.multiarray import _reconstruct  # noqa: PLC0415 (numpy 2 shims it, warning)

    dtype = _Reduced(np.dtype, ("O8", False, True), (3, "|", None, None, None, -1, -1, flags))
    data = _Reduced(_reconstruct, (np.ndarray, (0,), b"b"), (1, (1,), dtype, False, b"A" * 8))
    return {b"data": np.zeros((1, 3072), np.uint8), b"labels": data}


@pytest.mark.parametrize("payload", ["object-cleared-flags", "object", "structured", "short-data"])
def test_a_crafted_numpy_pickle_is_refused_and_cannot_crash_the_reader(tmp_path, payload):
    """numpy's dtype state is never trusted: an object dtype (flags cleared or not), a structured
    dtype or data shorter than its shape are refused in one line; the reader runs in its own
    process here because, before, the first one crashed it (SIGSEGV)."""
    import subprocess
    import sys
    import warnings

    folder = tmp_path / "cifar-10-batches-py"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        _cifar_batch(folder / name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        bad = {"object-cleared-flags": lambda: _object_array_pickle(0),
               "object": lambda: _object_array_pickle(63),
               "structured": lambda: {b"data": np.zeros(2, [("a", np.uint8), ("b", object)])},
               "short-data": lambda: {b"data": _Reduced(
                   np.frombuffer, (b"\x01",), None)}}[payload]()
    if payload == "short-data":  # a uint8 dtype whose shape asks for more bytes than it has
        from numpy.core.multiarray import _reconstruct  # noqa: PLC0415
        dtype = _Reduced(np.dtype, ("u1", False, True), (3, "|", None, None, None, -1, -1, 0))
        bad = {b"data": _Reduced(_reconstruct, (np.ndarray, (0,), b"b"),
                                 (1, (1000, 3072), dtype, False, b"\x01" * 8)), b"labels": [0]}
    _cifar_batch(folder / "data_batch_1", payload=bad)
    code = ("import sys\nfrom fedseq.common.data.readers import read_dataset\n"
            "from fedseq.common.errors import DatasetError\n"
            f"try:\n    read_dataset({str(tmp_path)!r}, 'cifar10')\n"
            "except DatasetError as exc:\n    print(exc)\n    sys.exit(3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
    line = out.stdout.strip()
    assert "data_batch_1: not a CIFAR batch file" in line and "\n" not in line, line


def test_arrays_of_every_plain_dtype_and_order_read_as_numpy_wrote_them(tmp_path):
    """The reader builds arrays itself, so it is checked against numpy's own pickles: byte
    orders, Fortran order, empty arrays, nested in lists and dicts, protocols 2 to 5."""
    import pickle

    from fedseq.common.data.readers import _ArraysOnly

    arrays = [np.arange(12, dtype=d).reshape(3, 4) for d in ("<i8", ">i4", "u1", "<f4", ">f8", "i2")]
    arrays += [np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)), np.zeros((0, 5)),
               np.array([True, False])]
    for protocol in (2, 3, 4, 5):
        blob = pickle.dumps({"a": arrays, "b": (arrays[0], "x", b"y")}, protocol=protocol)
        import io
        got = _ArraysOnly(io.BytesIO(blob), encoding="latin1").load()
        for want, have in zip(arrays + [arrays[0]], got["a"] + [got["b"][0]]):
            assert have.dtype == want.dtype and have.shape == want.shape
            assert np.array_equal(have, want)
        assert got["b"][1:] == ("x", b"y")
