"""Generic datasets, built in as entry points (`npz`, `csv`, `imagefolder`): a lab's own files
in three common layouts, with no code of its own.

Each reads `options.path`, relative to the data root unless absolute: either one file or folder
(all of its rows pooled), or a folder holding a training part and a test part (`train.npz` and
`test.npz`, `train.csv` and `test.csv`, or `train/` and `test/` class folders), training rows
first. The rows are then split over the clients by `data.partition`, as a catalog dataset's are.
Each describes itself from its options alone (classes, input shape), so a coordinator checks a
config without the files. `classes` is a fixed list, so that devices lacking a class still agree
on the label ids. A bad file is one DatasetError line naming the file and what is wrong.

Decoded image folders are cached as arrays (`FEDSEQ_CACHE`, else ~/.cache/fedseq), keyed by
the files' names, sizes and modification times and by the options: decoded once.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedseq.common.data.datasets import Dataset
from fedseq.common.data.readers import RawDataset
from fedseq.common.errors import ConfigError, DatasetError, validation_problem
from fedseq.common.files import atomic_write

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
#: an image with more pixels is refused before it is decoded (a 50-megapixel camera's frame
#: passes; Pillow's own DecompressionBomb limits are 89 and 179 million): a 388 KB PNG can
#: declare 20000 x 20000 pixels, 1.2 GB decoded
MAX_IMAGE_PIXELS = 50_000_000
#: an .npz member that inflates past INFLATION_FLOOR bytes to more than MAX_INFLATION x its
#: compressed size is refused before it is read (a zip bomb); np.savez stores members as they
#: are, and np.savez_compressed shrinks real rows 2-10x
MAX_INFLATION, INFLATION_FLOOR = 100, 64 << 20
#: characters of one CSV line at most, per column (a float's text is at most ~25)
CSV_CHARS_PER_COLUMN = 64


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(".", description=(
        "The file or folder, relative to the data root unless absolute (data.placement = "
        "\"device\" reads each client's train and test parts instead)."))
    classes: Union[int, List[str]] = Field(description=(
        "The classes: their names in label order (image folder names, CSV label values), or "
        "for npz their number (labels 0..n-1)."))

    @field_validator("classes")
    @classmethod
    def _some(cls, v: Union[int, List[str]]) -> Union[int, List[str]]:
        n = v if isinstance(v, int) else len(v)
        if n < 2 or (isinstance(v, list) and len(set(v)) != len(v)):
            raise ValueError("give at least two distinct classes")
        return v

    @property
    def num_classes(self) -> int:
        return self.classes if isinstance(self.classes, int) else len(self.classes)

    def where(self, root: Path) -> Path:
        p = Path(self.path).expanduser()
        return p if p.is_absolute() else Path(root) / p


def as_chw(shape: Tuple[int, ...]) -> Tuple[int, int, int]:
    """One row's shape as fedseq holds it, (channels, height, width): a tabular row (F,) is
    (1, 1, F), a sensor series (C, L) is (C, 1, L), an image (C, H, W) is itself."""
    return (1, 1, shape[0]) if len(shape) == 1 else (
        (shape[0], 1, shape[1]) if len(shape) == 2 else tuple(shape))  # type: ignore[return-value]


class NpzOptions(_Options):
    shape: Tuple[int, ...] = Field(description=(
        "The shape of one row of `x`: (features,) for tabular rows, (channels, length) for a "
        "sensor series, (channels, height, width) for an image. A model gets (N, 1, 1, F), "
        "(N, C, 1, L) or (N, C, H, W): `x.flatten(2)` gives a series' (N, C, L)."))

    @field_validator("shape")
    @classmethod
    def _one_to_three_sizes(cls, v: Tuple[int, ...]) -> Tuple[int, ...]:
        if not 1 <= len(v) <= 3 or any(d < 1 for d in v):
            raise ValueError(f"{list(v)}: give [features], [channels, length] or [channels, "
                             "height, width], each >= 1")
        return v
    x: str = Field("x", description="The array of inputs.")
    y: str = Field("y", description="The array of integer labels.")


class CsvOptions(_Options):
    features: int = Field(ge=1, description="How many feature columns (every column but the label).")
    label: str = Field("label", description="The label column's name (the header's).")


class ImageFolderOptions(_Options):
    classes: List[str] = Field(description="The class folders' names, in label order.")
    size: Union[int, Tuple[int, int]] = Field(description="(height, width) every image is resized to.")
    channels: int = Field(3, description="1 (grayscale) or 3 (RGB).")

    @field_validator("channels")
    @classmethod
    def _gray_or_rgb(cls, v: int) -> int:
        if v not in (1, 3):
            raise ValueError(f"{v}: give 1 (grayscale) or 3 (RGB)")
        return v

    @property
    def hw(self) -> Tuple[int, int]:
        """The size images are resized to, as (height, width)."""
        return (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)  # type: ignore[return-value]


def _options(model: Any, name: str, options: Dict[str, Any]) -> Any:
    try:
        return model.model_validate(options)
    except ValidationError as exc:
        p = validation_problem(exc)
        raise ConfigError(f"data.options{'.' + p.where if p.where else ''} ({name}): {p.msg}{p.more}"
                          ) from None


def _parts(where: Path, suffix: str) -> List[Path]:
    """[train, test] where the folder holds both; else the one file or folder (pooled)."""
    if where.is_dir() and (where / f"train{suffix}").exists():
        test = where / f"test{suffix}"
        return [where / f"train{suffix}"] + ([test] if test.exists() else [])
    if not where.exists():
        raise DatasetError(f"{where}: no such file or folder (data.options.path, under the data "
                           "root unless absolute)")
    return [where]


def _raw(parts: List[Tuple[np.ndarray, np.ndarray]], classes: int, rows: Optional[np.ndarray]
         ) -> RawDataset:
    images = np.concatenate([x for x, _ in parts])
    labels = np.concatenate([y for _, y in parts]).astype(np.int64)
    return RawDataset(images if rows is None else images[rows], labels, classes, len(parts[0][1]))


class NpzDataset(Dataset):
    """`x` (rows of `shape`, any numeric dtype) and `y` (integer labels < classes) in .npz files."""

    options_model = NpzOptions

    def describe(self, options: Dict[str, Any]) -> Tuple[Tuple[int, int, int], int]:
        o = _options(NpzOptions, "npz", options)
        return as_chw(o.shape), o.num_classes

    def load(self, root: Path, options: Dict[str, Any], rows: Optional[np.ndarray] = None
             ) -> RawDataset:
        o = _options(NpzOptions, "npz", options)
        return _raw([self._read(f, o) for f in _parts(o.where(root), ".npz")], o.num_classes, rows)

    def load_part(self, path: Path, options: Dict[str, Any]) -> RawDataset:
        o = _options(NpzOptions, "npz", options)
        return _raw([self._read(path, o)], o.num_classes, None)

    @staticmethod
    def _read(path: Path, o: NpzOptions) -> Tuple[np.ndarray, np.ndarray]:
        npz_members(path)
        try:
            with np.load(path, allow_pickle=False) as f:
                missing = [a for a in (o.x, o.y) if a not in f.files]
                if missing:
                    raise DatasetError(f"{path}: no array {missing[0]!r} in it (it has "
                                       f"{', '.join(map(repr, f.files[:10])) or 'none'}; "
                                       "data.options.x / .y name them)")
                x, y = f[o.x], f[o.y]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise DatasetError(f"{path}: not a readable .npz file ({exc})") from None
        if x.dtype.kind not in "biuf" or y.dtype.kind not in "iu":
            raise DatasetError(f"{path}: {o.x} has dtype {x.dtype} and {o.y} {y.dtype}; give numbers "
                               "and integer labels")
        if x.shape[1:] != tuple(o.shape) or y.shape != (len(x),):
            raise DatasetError(f"{path}: {o.x} is {x.shape} and {o.y} {y.shape}; want (N, "
                               f"{', '.join(map(str, o.shape))}) and (N,)")
        _labels_in_range(path, y, o.num_classes)
        x = x.reshape(len(x), *as_chw(o.shape))
        return (x if x.dtype == np.uint8 else x.astype(np.float32)), y


class CsvDataset(Dataset):
    """A header row, a label column (its value one of `classes`) and `features` numeric columns."""

    options_model = CsvOptions

    def describe(self, options: Dict[str, Any]) -> Tuple[Tuple[int, int, int], int]:
        o = _options(CsvOptions, "csv", options)
        return (1, 1, o.features), o.num_classes

    def load(self, root: Path, options: Dict[str, Any], rows: Optional[np.ndarray] = None
             ) -> RawDataset:
        o = _options(CsvOptions, "csv", options)
        return _raw([self._read(f, o) for f in _parts(o.where(root), ".csv")], o.num_classes, rows)

    def load_part(self, path: Path, options: Dict[str, Any]) -> RawDataset:
        o = _options(CsvOptions, "csv", options)
        return _raw([self._read(path, o)], o.num_classes, None)

    @staticmethod
    def _read(path: Path, o: CsvOptions) -> Tuple[np.ndarray, np.ndarray]:
        ids = {str(c): i for i, c in enumerate(o.classes if isinstance(o.classes, list)
                                                else range(o.classes))}
        xs: List[List[float]] = []
        ys: List[int] = []
        try:
            with open(path, newline="") as f:
                reader = csv.reader(csv_lines(f, path, o.features + 1))
                header = next(reader, None)
                if header is None or o.label not in header:
                    raise DatasetError(f"{path}: no header with a {o.label!r} column "
                                       "(data.options.label names it)")
                at = header.index(o.label)
                if len(header) - 1 != o.features:
                    raise DatasetError(f"{path}: {len(header) - 1} feature columns, "
                                       f"data.options.features = {o.features}")
                for line, row in enumerate(reader, start=2):
                    if not row:
                        continue
                    if len(row) != len(header):
                        raise DatasetError(f"{path}, line {line}: {len(row)} values, the header "
                                           f"has {len(header)} (a ragged row)")
                    label = row[at].strip()
                    if label not in ids:
                        raise DatasetError(f"{path}, line {line}: label {label[:40]!r} is not in "
                                           "data.options.classes")
                    try:
                        xs.append([float(v) for i, v in enumerate(row) if i != at])
                    except ValueError:
                        raise DatasetError(f"{path}, line {line}: a feature is not a number") from None
                    ys.append(ids[label])
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise DatasetError(f"{path}: not a readable CSV file ({exc})") from None
        x = np.asarray(xs, dtype=np.float32).reshape(len(xs), 1, 1, o.features)
        return x, np.asarray(ys, dtype=np.int64)


class ImageFolderDataset(Dataset):
    """One sub-folder of images per class (torchvision's ImageFolder layout), under `path`, or
    under `path/train` and `path/test`; each image converted to `channels` and resized to `size`."""

    options_model = ImageFolderOptions

    def describe(self, options: Dict[str, Any]) -> Tuple[Tuple[int, int, int], int]:
        o = _options(ImageFolderOptions, "imagefolder", options)
        return (o.channels, *o.hw), o.num_classes  # type: ignore[return-value]

    def load(self, root: Path, options: Dict[str, Any], rows: Optional[np.ndarray] = None
             ) -> RawDataset:
        o = _options(ImageFolderOptions, "imagefolder", options)
        return _raw([decoded_folder(f, o) for f in _parts(o.where(root), "")], o.num_classes, rows)

    def load_part(self, path: Path, options: Dict[str, Any]) -> RawDataset:
        o = _options(ImageFolderOptions, "imagefolder", options)
        return _raw([decoded_folder(path, o)], o.num_classes, None)


def _labels_in_range(path: Path, y: np.ndarray, classes: int) -> None:
    if len(y) and not 0 <= int(y.min()) <= int(y.max()) < classes:
        raise DatasetError(f"{path}: labels from {int(y.min())} to {int(y.max())}, but "
                           f"data.options.classes gives {classes} classes")


def _listing(folder: Path, o: ImageFolderOptions) -> List[Tuple[Path, int]]:
    if not folder.is_dir():
        raise DatasetError(f"{folder}: not a folder of class folders")
    known = {c: i for i, c in enumerate(o.classes)}
    out: List[Tuple[Path, int]] = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if sub.name not in known:
            raise DatasetError(f"{sub}: class folder {sub.name[:40]!r} is not in data.options.classes")
        out += [(f, known[sub.name]) for f in sorted(sub.iterdir())
                if f.suffix.lower() in IMAGE_SUFFIXES]
    return out


def cache_dir() -> Path:
    """Where decoded image folders are kept: $FEDSEQ_CACHE, else ~/.cache/fedseq."""
    return Path(os.environ.get("FEDSEQ_CACHE") or Path.home() / ".cache" / "fedseq")


def decoded_folder(folder: Path, o: ImageFolderOptions) -> Tuple[np.ndarray, np.ndarray]:
    """The folder's images as uint8 (N, C, H, W) with their labels, decoded once and then read
    from the cache (keyed by every file's name, size and modification time, and the options)."""
    files = _listing(folder, o)
    key = hashlib.sha256(json.dumps(
        [str(folder.resolve()), o.channels, o.hw, list(o.classes)]
        + [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p, _ in files]
    ).encode()).hexdigest()[:32]
    cached = cache_dir() / f"imagefolder-{key}.npz"
    if cached.is_file():
        try:
            with np.load(cached, allow_pickle=False) as f:
                return f["x"], f["y"]
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry: decode again
    try:
        from PIL import Image
    except ImportError as exc:
        raise DatasetError("the imagefolder dataset decodes images with Pillow: pip install pillow"
                           ) from exc
    h, w = o.hw
    x = np.empty((len(files), o.channels, h, w), dtype=np.uint8)
    for i, (path, _) in enumerate(files):
        try:
            with Image.open(path) as im:
                _within_pixels(path, im.size)
                im = im.convert("L" if o.channels == 1 else "RGB")
                if im.size != (w, h):
                    im = im.resize((w, h), getattr(Image, "Resampling", Image).BILINEAR)
                a = np.asarray(im, dtype=np.uint8)
        except DatasetError:
            raise
        except Exception as exc:  # a decoder meets any file: every failure is this file's
            raise _unreadable_image(path, exc) from None
        x[i] = a[None] if o.channels == 1 else a.transpose(2, 0, 1)
    y = np.asarray([label for _, label in files], dtype=np.int64)
    try:
        import io

        buf = io.BytesIO()
        np.savez(buf, x=x, y=y)
        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cached, buf.getvalue(), durable=False)
    except OSError:
        pass  # no cache where it cannot be written: decoded again next time
    return x, y


def _unreadable_image(path: Path, exc: Exception) -> DatasetError:
    return DatasetError(f"{path}: not a readable image ({type(exc).__name__}: {str(exc)[:200]}); "
                        "remove or replace it")


def _within_pixels(path: Path, size: Tuple[int, int]) -> None:
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise DatasetError(f"{path}: {size[0]} x {size[1]} pixels, more than the "
                           f"{MAX_IMAGE_PIXELS:,} an image may have; shrink or remove it")


def npz_members(path: Path) -> Dict[str, int]:
    """The arrays an .npz file holds -> their rows, read from each member's header alone; a
    DatasetError where it is no zip of .npy arrays or a member would inflate like a zip bomb."""
    out: Dict[str, int] = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if (info.file_size > INFLATION_FLOOR
                        and info.file_size > MAX_INFLATION * max(1, info.compress_size)):
                    raise DatasetError(
                        f"{path}: {info.filename[:60]!r} inflates {info.compress_size:,} bytes "
                        f"to {info.file_size:,} (a zip bomb?); save the arrays with np.savez")
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    shape = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                             else np.lib.format.read_array_header_2_0(f))[0]
                out[info.filename[:-4] if info.filename.endswith(".npy") else info.filename] = (
                    shape[0] if shape else 1)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise DatasetError(f"{path}: not a readable .npz file ({exc})") from None
    return out


def csv_lines(f: Any, path: Path, columns: int, first: int = 1):
    """The lines of an open CSV file from line `first`, each at most CSV_CHARS_PER_COLUMN x
    `columns` characters (a longer one is a DatasetError before it is split)."""
    limit = CSV_CHARS_PER_COLUMN * columns + 64
    for number, line in enumerate(iter(lambda: f.readline(limit + 1), ""), start=first):
        if len(line) > limit:
            raise DatasetError(f"{path}, line {number}: longer than {limit:,} characters "
                               f"({columns} columns); check the file")
        yield line


def probe_part(path: Path) -> int:
    """The rows of a part in a generic layout (an .npz's first array, a CSV's data lines, an
    image folder's images), opened without decoding its rows: every image's header within
    MAX_IMAGE_PIXELS, every .npz member's header; -1 for a layout of a plugin's own. A
    DatasetError names what cannot be read (fedseq-client doctor)."""
    if path.is_dir():
        try:
            from PIL import Image
        except ImportError:  # (the imagefolder dataset says so when a run reads it)
            return -1
        images = [p for sub in sorted(path.iterdir()) if sub.is_dir()
                  for p in sorted(sub.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
        for p in images:
            try:
                with Image.open(p) as im:
                    _within_pixels(p, im.size)
            except DatasetError:
                raise
            except Exception as exc:
                raise _unreadable_image(p, exc) from None
        return len(images)
    if path.suffix == ".npz":
        return next(iter(npz_members(path).values()), 0)
    if path.suffix == ".csv":
        try:
            with open(path, newline="") as text:
                first = text.readline(1 << 20)
                if len(first) >= 1 << 20:
                    raise DatasetError(f"{path}: its header line is longer than 1 MiB")
                columns = max(1, first.count(","))
                return sum(1 for line in csv_lines(text, path, columns + 1, 2) if line.strip())
        except (OSError, UnicodeDecodeError) as exc:
            raise DatasetError(f"{path}: not a readable CSV file ({exc})") from None
    return -1


NPZ = NpzDataset()
CSV = CsvDataset()
IMAGEFOLDER = ImageFolderDataset()

__all__ = ["CSV", "IMAGEFOLDER", "NPZ", "CsvDataset", "ImageFolderDataset", "NpzDataset",
           "cache_dir", "decoded_folder"]
