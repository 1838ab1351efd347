"""Tiny-ImageNet: a tiny archive in Stanford's exact layout (tiny-imagenet-200/ with wnids.txt,
words.txt, train/<wnid>/images/*.JPEG and <wnid>_boxes.txt, val/images/ with
val_annotations.txt, test/images/), downloaded from a local HTTP server, extracted, decoded once
and read through the same code as the real one."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
from test_store import Mirror

from conftest import server_only
from fedseq.common.data import catalog, store
from fedseq.common.data.readers import NUM_CLASSES, read_dataset
from fedseq.common.errors import DatasetError

WNIDS = ["n09999999", "n01443537", "n02085620"]  # wnids.txt is not sorted; classes are
COLORS = {0: (200, 30, 30), 1: (30, 200, 30), 2: (30, 30, 200)}  # per sorted class


def _jpeg(color: tuple[int, int, int], gray: bool = False) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (64, 64), color)
    buf = io.BytesIO()
    (img.convert("L") if gray else img).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _archive(tmp_path: Path, monkeypatch) -> Path:
    cls = {w: i for i, w in enumerate(sorted(WNIDS))}
    files = {"wnids.txt": "\n".join(WNIDS) + "\n",
             "words.txt": "".join(f"{w}\tthing {w}\n" for w in WNIDS)}
    for w in WNIDS:
        for i in range(2):
            files[f"train/{w}/images/{w}_{i}.JPEG"] = _jpeg(COLORS[cls[w]], gray=(i == 1 and cls[w] == 0))
        files[f"train/{w}/{w}_boxes.txt"] = "".join(f"{w}_{i}.JPEG\t0\t0\t63\t63\n" for i in range(2))
    val = [("val_0.JPEG", WNIDS[2]), ("val_1.JPEG", WNIDS[0]), ("val_2.JPEG", WNIDS[1])]
    for name, w in val:
        files[f"val/images/{name}"] = _jpeg(COLORS[cls[w]])
    files["val/val_annotations.txt"] = "".join(f"{n}\t{w}\t0\t0\t63\t63\n" for n, w in val)
    files["test/images/test_0.JPEG"] = _jpeg((0, 0, 0))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, blob in files.items():
            z.writestr(f"tiny-imagenet-200/{name}", blob)
    blob = buf.getvalue()
    (tmp_path / "stanford").mkdir()
    (tmp_path / "stanford" / "tiny-imagenet-200.zip").write_bytes(blob)
    fake = catalog.DatasetSpec("", (catalog.DataFile("tiny-imagenet-200.zip", hashlib.md5(blob).hexdigest(),
                                                 len(blob)),), (), extract="tiny-imagenet-200.zip")
    monkeypatch.setitem(catalog.DATASETS, "tiny-imagenet", fake)
    return tmp_path / "stanford"


@server_only  # decoding the JPEGs needs Pillow: the coordinator's side
def test_tiny_imagenet_downloads_decodes_and_reads(tmp_path, monkeypatch):
    mirror = Mirror(_archive(tmp_path, monkeypatch))
    try:
        root = tmp_path / "root"
        store.download("tiny-imagenet", root, (mirror.url + "/",))
    finally:
        mirror.close()
    assert store.verify(root, "tiny-imagenet") == []
    assert not (root / "tiny-imagenet-200.zip").exists()
    raw = read_dataset(root, "tiny-imagenet")
    assert raw.images.shape == (9, 3, 64, 64) and raw.images.dtype == np.uint8
    assert raw.num_train == 6 and raw.num_classes == NUM_CLASSES["tiny-imagenet"] == 200
    # classes by sorted wnid, training images class by class, validation in the annotations' order
    assert raw.labels.tolist() == [0, 0, 1, 1, 2, 2, 1, 2, 0]
    for img, c in zip(raw.images, raw.labels.tolist()):  # each image is its class's colour
        mean = img.reshape(3, -1).mean(1)
        want = np.array(COLORS[c], float)
        if c == 0 and np.allclose(mean, mean[0], atol=2):  # the grayscale one: R = G = B
            continue
        assert np.abs(mean - want).max() < 6, (c, mean)
    some = read_dataset(root, "tiny-imagenet", rows=np.array([1, 8]))
    assert some.images.shape == (2, 3, 64, 64) and np.array_equal(some.images[1], raw.images[8])


@server_only
def test_tiny_imagenet_offline_and_damaged(tmp_path, monkeypatch):
    source = _archive(tmp_path, monkeypatch)
    root = tmp_path / "root"
    store.import_from("tiny-imagenet", source, root)
    assert read_dataset(root, "tiny-imagenet").num_train == 6
    (root / "tiny-imagenet-200" / "fedseq" / "images.npy").unlink()
    assert store.verify(root, "tiny-imagenet")[0].endswith("images.npy is missing")
    with pytest.raises(DatasetError, match="missing or damaged .* `fedseq data download tiny-imagenet"):
        read_dataset(root, "tiny-imagenet")
    # extracted but not decoded: download decodes what is there, without the network
    store.download("tiny-imagenet", root, ("http://127.0.0.1:9/",))
    assert read_dataset(root, "tiny-imagenet").images.shape[0] == 9
    (root / "tiny-imagenet-200" / "val" / "images" / "val_1.JPEG").write_bytes(b"not a jpeg")
    (root / "tiny-imagenet-200" / "fedseq" / "images.npy").unlink()
    with pytest.raises(DatasetError, match="val_1.JPEG: not a readable JPEG"):
        store.download("tiny-imagenet", root, ("http://127.0.0.1:9/",))
