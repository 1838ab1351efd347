"""EMNIST: tiny files in NIST's exact format (one zip of gzip/emnist-<split>-<part>-ubyte.gz IDX
files), downloaded from a local HTTP server, imported offline, verified and read through the same
code as the real archive."""

from __future__ import annotations

import gzip
import hashlib
import io
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from test_store import Mirror

from fedseq.common.data import catalog, store
from fedseq.common.data.readers import NUM_CLASSES, read_dataset
from fedseq.common.errors import DatasetError


def _idx(array: np.ndarray) -> bytes:
    """An IDX file as NIST writes it: magic 0x0000 08 ndim, big-endian dims, uint8 data."""
    head = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return head + array.astype(np.uint8).tobytes()


def _split_files(split: str, labels: dict[str, np.ndarray]) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    out = {}
    for part, y in labels.items():
        x = rng.integers(0, 256, (len(y), 28, 28))
        out[f"emnist-{split}-{part}-images-idx3-ubyte.gz"] = gzip.compress(_idx(x))
        out[f"emnist-{split}-{part}-labels-idx1-ubyte.gz"] = gzip.compress(_idx(y))
    return out


def _archive(tmp_path: Path, monkeypatch) -> Path:
    """NIST's gzip.zip in small: letters (labels 1-26 as in the real files) and digits; the
    fake archive's md5 and size stand in for the real one's."""
    files = {**_split_files("letters", {"train": np.arange(1, 27).repeat(2),
                                        "test": np.arange(1, 27)}),
             **_split_files("digits", {"train": np.arange(10).repeat(3), "test": np.arange(10)})}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, blob in files.items():
            z.writestr(f"gzip/{name}", blob)
        z.writestr("../evil.gz", b"a member outside the folder is flattened, never written there")
    folder = tmp_path / "nist" / "EMNIST" / "raw"
    folder.mkdir(parents=True)
    (folder / "gzip.zip").write_bytes(buf.getvalue())
    blob = buf.getvalue()
    spec = catalog.DATASETS["emnist"]
    fake = catalog.DatasetSpec(spec.folder, (catalog.DataFile("gzip.zip", hashlib.md5(blob).hexdigest(),
                                                          len(blob)),), (), extract="gzip.zip")
    monkeypatch.setitem(catalog.DATASETS, "emnist", fake)
    return folder / "gzip.zip"


def test_emnist_downloads_extracts_and_reads(tmp_path, monkeypatch):
    _archive(tmp_path, monkeypatch)
    mirror = Mirror(tmp_path / "nist")
    try:
        root = tmp_path / "root"
        assert store.verify(root, "emnist-letters") == [f"{root / 'EMNIST/raw'} is missing"]
        store.download("emnist-letters", root, (mirror.base("emnist"),))
    finally:
        mirror.close()
    raw = root / "EMNIST" / "raw"
    assert not (raw / "gzip.zip").exists() and not (tmp_path / "root" / "evil.gz").exists()
    assert store.verify(root, "emnist-letters") == [] and store.verify(root, "emnist-digits") == []
    assert store.verify(root, "emnist-balanced")[0].endswith(
        "emnist-balanced-train-images-idx3-ubyte.gz is missing")
    letters = read_dataset(root, "emnist-letters")
    assert letters.images.shape == (78, 1, 28, 28) and letters.num_train == 52
    assert letters.num_classes == NUM_CLASSES["emnist-letters"] == 26
    assert sorted(set(letters.labels.tolist())) == list(range(26))  # 1-26 on disk
    digits = read_dataset(root, "emnist-digits", rows=np.array([0, 31, 39]))
    assert digits.images.shape == (3, 1, 28, 28) and digits.labels.tolist()[:3] == [0, 0, 0]


def test_emnist_imports_offline_and_says_what_is_missing(tmp_path, monkeypatch):
    archive = _archive(tmp_path, monkeypatch)
    root = tmp_path / "root"
    store.import_from("emnist-digits", archive.parent, root)
    assert read_dataset(root, "emnist-digits").labels.max() == 9
    (root / "EMNIST/raw/emnist-digits-test-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError, match="missing dataset file .*emnist-digits-test-labels"
                                           ".*fedseq data download emnist-digits"):
        read_dataset(root, "emnist-digits")
    with pytest.raises(DatasetError, match="unknown dataset 'nist'.*emnist-letters"):
        catalog.spec_of("nist")
    assert catalog.spec_of("emnist-letters") is catalog.DATASETS["emnist"]


def test_labels_outside_the_splits_classes_are_refused(tmp_path):
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    files = _split_files("digits", {"train": np.array([0, 12]), "test": np.array([1])})
    for name, blob in files.items():
        (raw / name).write_bytes(blob)
    with pytest.raises(DatasetError, match="labels 0..12 are not the 10 classes of emnist-digits"):
        read_dataset(tmp_path, "emnist-digits")
