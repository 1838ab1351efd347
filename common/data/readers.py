"""Readers for the standard dataset files (no download, no torchvision)."""

from __future__ import annotations

import codecs
import gzip
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedseq.common.data.catalog import (
    CIFAR_DIRS,
    EXTRACTED,
    IDX_LAYOUT,
    NUM_CLASSES,
    idx_stems,
)
from fedseq.common.errors import DatasetError

TINY = EXTRACTED["tiny-imagenet"]


@dataclass(frozen=True)
class RawDataset:
    """Images as uint8 (N, C, H, W) and labels as int64 (N,), train and test concatenated."""

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    num_train: int  # the first num_train rows are the original training split


def parse_idx(buf: bytes, source: str = "IDX data") -> np.ndarray:
    """Decode one IDX file (big-endian header: 0, 0, type, ndim, dims...)."""
    if len(buf) < 4 or buf[0] != 0 or buf[1] != 0:
        raise DatasetError(f"{source}: not an IDX file (bad magic); re-copy the original file")
    if buf[2] != 0x08:
        raise DatasetError(f"{source}: IDX type 0x{buf[2]:02x} unsupported (only uint8 0x08)")
    nd = buf[3]
    dims = tuple(int(d) for d in np.frombuffer(buf, ">u4", nd, 4))
    offset = 4 + 4 * nd
    expected = int(np.prod(dims)) if dims else 0
    if len(buf) - offset != expected:
        raise DatasetError(
            f"{source}: header says {expected} bytes of data, file has {len(buf) - offset}; "
            "the file is truncated or corrupt, re-copy it"
        )
    return np.frombuffer(buf, np.uint8, offset=offset).reshape(dims)


def _idx_path(folder: Path, stem: str, dataset: str) -> Path:
    for path in (folder / f"{stem}.gz", folder / stem):
        if path.exists():
            return path
    raise DatasetError(
        f"missing dataset file {folder / (stem + '.gz')}: run `fedseq data download {dataset} "
        f"--root {folder.parent.parent}` (or --from DIR offline), or point data.root at the "
        f"folder that holds {IDX_LAYOUT[dataset]}"
    )


def _read_idx_file(folder: Path, stem: str, dataset: str) -> np.ndarray:
    path = _idx_path(folder, stem, dataset)
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{path}: cannot decompress ({exc}); re-copy the file") from exc
    return parse_idx(data, str(path))


def _read_idx_rows(folder: Path, stem: str, dataset: str, rows: np.ndarray, count: int
                   ) -> np.ndarray:
    """Only `rows` (sorted) of an IDX file of `count` images, streamed: the file is never held
    decompressed, so a device reading its clients' few thousand images needs a few MB."""
    path = _idx_path(folder, stem, dataset)
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as f:
            head = f.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] != 0x08:
                raise DatasetError(f"{path}: not a uint8 IDX file; re-copy the original file")
            dims = tuple(int(d) for d in np.frombuffer(f.read(4 * head[3]), ">u4"))
            record = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            if len(dims) != 3 or dims[0] != count:
                raise DatasetError(f"{path}: images {dims} do not match the {count} labels; "
                                   f"re-copy the original files")
            out = np.empty((len(rows), *dims[1:]), np.uint8)
            start = 4 + 4 * head[3]
            for i, r in enumerate(rows.tolist()):
                f.seek(start + r * record)
                chunk = f.read(record)
                if len(chunk) != record:
                    raise DatasetError(f"{path}: truncated at row {r}; re-copy the file")
                out[i] = np.frombuffer(chunk, np.uint8).reshape(dims[1:])
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{path}: cannot decompress ({exc}); re-copy the file") from exc
    return out


def read_idx_dataset(root: Path, dataset: str, rows: np.ndarray | None = None) -> RawDataset:
    """Both splits, train first. With `rows` (sorted indices into that order) only those images
    are kept, one file at a time, so a device never holds the whole dataset; the labels are
    always all of them (the partition needs them)."""
    folder = Path(root) / IDX_LAYOUT[dataset]
    parts = []
    offset = 0
    for split in ("train", "test"):
        stems = idx_stems(dataset, split)
        if rows is None:
            images = _read_idx_file(folder, stems[0], dataset)
            labels = _read_idx_file(folder, stems[1], dataset)
            if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
                raise DatasetError(
                    f"{folder}: {split} images {images.shape} and labels {labels.shape} do not match"
                )
        else:
            labels = _read_idx_file(folder, stems[1], dataset)
            local = rows[(rows >= offset) & (rows < offset + len(labels))] - offset
            images = _read_idx_rows(folder, stems[0], dataset, local, len(labels))
        offset += len(labels)
        parts.append((images, labels))
    images = np.concatenate([p[0] for p in parts])[:, None, :, :]
    labels = np.concatenate([p[1] for p in parts]).astype(np.int64)
    if dataset == "emnist-letters":
        labels -= 1
    if len(labels) and not 0 <= labels.min() <= labels.max() < NUM_CLASSES[dataset]:
        raise DatasetError(f"{folder}: labels {labels.min()}..{labels.max()} are not the "
                           f"{NUM_CLASSES[dataset]} classes of {dataset}; re-copy the files")
    return RawDataset(images, labels, NUM_CLASSES[dataset], len(parts[0][1]))


#: the dtypes a CIFAR batch may hold (its images are uint8, its labels lists of ints): plain
#: numbers only, never an object, structured or void dtype
_PLAIN_DTYPES = frozenset(["b1", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8"])


class _Dtype:
    """What a pickle's `numpy.dtype(spec, align, copy)` and its state build here: a fresh dtype of
    one of _PLAIN_DTYPES. numpy's own `dtype.__setstate__` trusts the file's flags and sizes (an
    object dtype with its flags cleared makes numpy dereference a pointer the file chose), so it
    is never called: the state is checked and only its byte order is taken."""

    def __init__(self, spec: Any = None, align: Any = False, copy: Any = False) -> None:
        if not isinstance(spec, str) or spec not in _PLAIN_DTYPES:
            raise pickle.UnpicklingError(f"a dtype {str(spec)[:40]!r}, which a CIFAR batch never holds")
        self.dtype = np.dtype(spec)

    def __setstate__(self, state: Any) -> None:
        # (version, byte order, subarray, names, fields, item size, alignment, flags[, metadata])
        if (not isinstance(state, tuple) or len(state) < 5 or state[1] not in ("|", "<", ">", "=")
                or any(part is not None for part in state[2:5])):
            raise pickle.UnpicklingError("a dtype with fields or a sub-array, which a CIFAR batch "
                                         "never holds")
        if state[1] in ("<", ">") and self.dtype.itemsize > 1:
            self.dtype = self.dtype.newbyteorder(state[1])


def _array(shape: Any, dtype: Any, raw: Any, fortran: bool = False) -> np.ndarray:
    """An array of a plain dtype built from its bytes (copied), its size checked against them."""
    if not isinstance(dtype, _Dtype):
        raise pickle.UnpicklingError("an array without a plain dtype")
    if isinstance(raw, str):  # a Python 2 pickle read with encoding="latin1"
        raw = raw.encode("latin1")
    if isinstance(raw, pickle.PickleBuffer):
        raw = bytes(raw.raw())
    if not isinstance(raw, (bytes, bytearray)):
        raise pickle.UnpicklingError("an array whose data is not bytes (an object array?)")
    if (not isinstance(shape, tuple)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise pickle.UnpicklingError(f"an array of shape {str(shape)[:40]}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * dtype.dtype.itemsize != len(raw):
        raise pickle.UnpicklingError(f"an array of shape {shape} with {len(raw)} bytes of data")
    return np.frombuffer(raw, dtype.dtype, count).reshape(shape, order="F" if fortran else "C").copy()


class _Array:
    """What `numpy.core.multiarray._reconstruct(ndarray, shape, typecode)` and its state build
    here (protocols 0-4): the array itself comes from `_array`, never from numpy's own
    `ndarray.__setstate__`; `_ArraysOnly.load` puts it in its place."""

    def __init__(self, cls: Any = None, shape: Any = None, typecode: Any = None) -> None:
        if cls is not _NDARRAY:
            raise pickle.UnpicklingError("a reconstructed object that is not an ndarray")
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            state = state[1:]  # (version, shape, dtype, is_fortran, data)
        if not isinstance(state, tuple) or len(state) != 4:
            raise pickle.UnpicklingError("an ndarray's state of an unknown form")
        shape, dtype, fortran, raw = state
        self.array = _array(shape, dtype, raw, bool(fortran))


def _from_buffer(buf: Any, dtype: Any, shape: Any, order: Any = "C") -> np.ndarray:
    """numpy's `_frombuffer` (protocol 5), through `_array`."""
    return _array(shape, dtype, buf, order == "F")


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()`, as protocol 2 writes an empty bytes object (an empty array's data); no size."""
    if args:
        raise pickle.UnpicklingError("bytes(...) with arguments, which a CIFAR batch never holds")
    return b""


#: stands for numpy.ndarray in a pickle: an argument to `_reconstruct`, never callable
_NDARRAY = type("ndarray", (), {"__init__": None})


def _placed(obj: Any) -> Any:
    """The loaded batch with each `_Array` replaced by its array and each `_Dtype` by its dtype."""
    if isinstance(obj, _Array):
        if obj.array is None:
            raise pickle.UnpicklingError("an ndarray without its data")
        return obj.array
    if isinstance(obj, _Dtype):
        return obj.dtype
    if isinstance(obj, dict):
        return {k: _placed(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_placed(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_placed(v) for v in obj)
    return obj


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that can build what CIFAR's batch files hold (dicts, lists, strings, numbers
    and numpy arrays of plain dtypes) and nothing else: no function of any module is reachable
    from a file, so a planted batch file (a shared run directory, a copied data folder) cannot run
    code, and numpy's own unpickling code (whose dtype state is trusted) never sees the file:
    arrays are built here from their bytes."""

    ALLOWED: dict[tuple[str, str], Any] = {
        ("numpy.core.multiarray", "_reconstruct"): _Array,
        ("numpy._core.multiarray", "_reconstruct"): _Array,
        ("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _Dtype,
        ("numpy.core.numeric", "_frombuffer"): _from_buffer,
        ("numpy._core.numeric", "_frombuffer"): _from_buffer,
        # bytes in a protocol-2 pickle written by Python 3
        ("_codecs", "encode"): codecs.encode,
        ("__builtin__", "bytes"): _empty_bytes, ("builtins", "bytes"): _empty_bytes}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refers to {module[:80]}.{name[:80]}, which a CIFAR batch "
                                         "never holds")
        return self.ALLOWED[module, name]

    def load(self) -> Any:
        return _placed(super().load())


def _unpickle(path: Path) -> dict:
    """One CIFAR batch file (a pickle of {data: uint8 array, labels: list}) through _ArraysOnly,
    checked for that shape."""
    if not path.exists():
        raise DatasetError(
            f"missing dataset file {path}: run `fedseq data download "
            f"{'cifar10' if 'cifar-10-' in path.parent.name else 'cifar100'} --root "
            f"{path.parent.parent}` (or --from DIR with the python archive)"
        )
    try:
        with path.open("rb") as f:
            batch = _ArraysOnly(f, encoding="latin1").load()
    except Exception as exc:  # any malformed pickle: one line, nothing built
        raise DatasetError(f"{path}: not a CIFAR batch file ({exc}); re-extract the original "
                           "archive (fedseq data download)") from exc
    if not isinstance(batch, dict):
        raise DatasetError(f"{path}: not a CIFAR batch file (a {type(batch).__name__}, not a dict); "
                           "re-extract the original archive")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    data = batch.get("data")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise DatasetError(f"{path}: its 'data' is not a uint8 array; re-extract the original "
                           "archive")
    return batch


def read_cifar(root: Path, dataset: str) -> RawDataset:
    """CIFAR-10 or CIFAR-100 from the python-version archive's folder under `root` (the pickled
    batches), as uint8 images and labels; a missing or damaged batch is a DatasetError naming it."""
    folder = Path(root) / CIFAR_DIRS[dataset]
    if dataset == "cifar10":
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        key = "labels"
    else:
        names = ["train", "test"]
        key = "fine_labels"
    batches = [_unpickle(folder / n) for n in names]
    for name, b in zip(names, batches):
        labels = b.get(key)
        try:
            ok = (isinstance(labels, (list, np.ndarray)) and b["data"].ndim == 2
                  and b["data"].shape == (len(labels), 3072)
                  and all(type(c) in (int, np.int64, np.int32, np.uint8) for c in labels)
                  and all(0 <= int(c) < NUM_CLASSES[dataset] for c in labels))
        except TypeError:
            ok = False
        if not ok:
            raise DatasetError(f"{folder / name}: not a CIFAR batch file (its '{key}' are not one "
                               f"class id in 0..{NUM_CLASSES[dataset] - 1} per 3,072-byte image); "
                               "re-extract the original archive (fedseq data download)")
    images = np.concatenate([np.asarray(b["data"], np.uint8) for b in batches]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([np.asarray(b[key], np.int64) for b in batches])
    num_train = sum(len(b[key]) for b in batches[:-1])
    return RawDataset(images, labels, NUM_CLASSES[dataset], num_train)


def decode_tiny_imagenet(folder: Path) -> None:
    """Tiny-ImageNet's JPEGs as two arrays under `folder`/fedseq: images.npy (uint8 N x 3 x 64 x
    64: the 100,000 training images, then the 10,000 validation images) and labels.npy (class =
    the wnid's place in sorted wnids.txt, as torchvision's ImageFolder numbers them). Training
    images in sorted file order per class; validation images in val_annotations.txt's order.
    Grayscale JPEGs become RGB. Written atomically: what readers read is complete or absent."""
    from PIL import Image  # the coordinator's side (the server extra)

    wnids = sorted((folder / "wnids.txt").read_text().split())
    index = {w: i for i, w in enumerate(wnids)}
    files: list[tuple[Path, int]] = []
    for w in wnids:
        files += [(p, index[w]) for p in sorted((folder / "train" / w / "images").glob("*.JPEG"))]
    num_train = len(files)
    for line in (folder / "val" / "val_annotations.txt").read_text().splitlines():
        if line.strip():
            name, wnid = line.split("\t")[:2]
            if wnid not in index:
                raise DatasetError(f"{folder}/val/val_annotations.txt: {wnid} is not in wnids.txt; "
                                   "re-extract the original archive")
            files.append((folder / "val" / "images" / name, index[wnid]))
    images = np.empty((len(files), 3, 64, 64), np.uint8)
    for i, (path, _) in enumerate(files):
        try:
            with Image.open(path) as img:
                pixels = np.asarray(img.convert("RGB"))
        except OSError as exc:
            raise DatasetError(f"{path}: not a readable JPEG ({exc}); re-extract the archive") from exc
        if pixels.shape != (64, 64, 3):
            raise DatasetError(f"{path}: {pixels.shape[1]}x{pixels.shape[0]}, not 64x64; "
                               "re-extract the original archive")
        images[i] = pixels.transpose(2, 0, 1)
    out = folder / "fedseq"
    out.mkdir(exist_ok=True)
    meta = {"num_train": num_train, "wnids": wnids}
    for name, array in (("labels.npy", np.array([c for _, c in files], np.int64)),
                        ("images.npy", images)):
        tmp = out / (name + ".part")
        with tmp.open("wb") as f:
            np.save(f, array)
        tmp.replace(out / name)
    (out / "meta.json.part").write_text(json.dumps(meta))
    (out / "meta.json.part").replace(out / "meta.json")


def read_tiny_imagenet(root: Path, rows: np.ndarray | None = None) -> RawDataset:
    """The decoded Tiny-ImageNet (decode_tiny_imagenet); with `rows`, only those images are read
    (memory-mapped), so a device holds its clients' images alone."""
    folder = Path(root) / TINY / "fedseq"
    try:
        labels = np.load(folder / "labels.npy")
        images = np.load(folder / "images.npy", mmap_mode="r")
        num_train = int(json.loads((folder / "meta.json").read_text())["num_train"])
    except (OSError, ValueError, KeyError) as exc:
        raise DatasetError(
            f"missing or damaged dataset file under {folder} ({exc}): run `fedseq data download "
            f"tiny-imagenet --root {root}` (it decodes an extracted {TINY}/ without downloading "
            "again), or --from DIR with the zip") from exc
    if images.shape[1:] != (3, 64, 64) or len(images) != len(labels):
        raise DatasetError(f"{folder}: images {images.shape} and labels {labels.shape} do not "
                           f"match; run `fedseq data download tiny-imagenet --root {root}`")
    picked = np.asarray(images if rows is None else images[rows])
    return RawDataset(picked, labels.astype(np.int64), NUM_CLASSES["tiny-imagenet"], num_train)


def read_dataset(root: Path, dataset: str, rows: np.ndarray | None = None) -> RawDataset:
    """Dispatch on the config's dataset name; `rows`: keep only these images (labels: all)."""
    if dataset in IDX_LAYOUT:
        return read_idx_dataset(root, dataset, rows)
    if dataset == "tiny-imagenet":
        return read_tiny_imagenet(root, rows)
    if dataset in CIFAR_DIRS:
        raw = read_cifar(root, dataset)
        if rows is None:
            return raw
        return RawDataset(raw.images[rows], raw.labels, raw.num_classes, raw.num_train)
    raise DatasetError(f"unknown dataset {dataset!r}; use one of {sorted(NUM_CLASSES)}")
