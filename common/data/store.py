"""Where datasets live and how they get there: the data root, the files each dataset needs with
their md5 sums (torchvision's), download from the official mirrors with fallbacks and resume, and
import from a folder a user already has. Standard library only, so a device can use it too.

The layout under the data root is torchvision's: MNIST/raw/*.gz, FashionMNIST/raw/*.gz,
cifar-10-batches-py/, cifar-100-python/ (the CIFAR archives are extracted after their check),
EMNIST/raw/*.gz (from NIST's zip, likewise), tiny-imagenet-200/ (Stanford's zip, its JPEGs
decoded once into tiny-imagenet-200/fedseq/*.npy, which needs numpy and Pillow: the coordinator's
side; a device reads the .npy files it is given).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable  # subscripted at run time below: typing works on Python 3.8

from fedseq.common.data.catalog import EXTRACTED, DataFile, DatasetSpec, archive_of, spec_of
from fedseq.common.errors import DatasetError

CHUNK = 1 << 16


def default_data_root() -> Path:
    """One default for every command: $FEDSEQ_DATA, else $XDG_DATA_HOME/fedseq/data, else
    ~/.local/share/fedseq/data. A config's data.root (a device's data_dir) overrides it."""
    env = os.environ.get("FEDSEQ_DATA")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "fedseq" / "data"


Progress = Callable[[str, int, int], None]  # (file name, bytes so far, bytes in all)


def _extracted_files(dataset: str) -> list[str]:
    """What an extracted archive must hold for `dataset` (relative to its folder)."""
    if dataset.startswith("emnist-"):
        split = dataset[len("emnist-"):]
        return [f"emnist-{split}-{part}-ubyte.gz" for part in
                ("train-images-idx3", "train-labels-idx1", "test-images-idx3", "test-labels-idx1")]
    if dataset == "tiny-imagenet":
        return ["fedseq/images.npy", "fedseq/labels.npy", "fedseq/meta.json"]
    return []


def md5_of(path: Path) -> str:
    """The file's MD5, hex (a checksum against the catalogue, not security)."""
    try:  # a checksum, not security: FIPS-mode systems refuse a plain md5()
        h = hashlib.md5(usedforsecurity=False)  # novermin (falls back below)
    except TypeError:  # Python 3.8 has no usedforsecurity
        h = hashlib.md5()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def check_file(path: Path, want: DataFile) -> str | None:
    """Why `path` is not the expected file, or None."""
    if not path.exists():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != want.size:
        return f"{path} has {size:,} bytes, the original has {want.size:,} (truncated or another file)"
    got = md5_of(path)
    if got != want.md5:
        return f"{path} has md5 {got}, the original {want.md5} (corrupt or another file)"
    return None


def verify(root: Path, dataset: str) -> list[str]:
    """Problems with a dataset under `root` (empty: every file is byte-identical to the original).
    CIFAR is checked by its extracted folder, whose archive is not kept."""
    spec = spec_of(dataset)
    if spec.extract is not None:
        folder = Path(root) / EXTRACTED[archive_of(dataset)]
        if not (folder.is_dir() and any(folder.iterdir())):
            return [f"{folder} is missing"]
        return [f"{folder / f} is missing" for f in _extracted_files(dataset)
                if not (folder / f).exists()]
    return [p for f in spec.files if (p := check_file(Path(root) / spec.folder / f.name, f))]


def _fetch(url: str, dest: Path, want: DataFile, progress: Progress | None, timeout: float) -> None:
    """Download `url` into dest + '.part', continuing a partial file with an HTTP Range request;
    the finished file replaces dest only after its size and md5 match."""
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > want.size:
        part.unlink()
        have = 0
    if have < want.size:
        req = urllib.request.Request(url, headers={"User-Agent": "fedseq"})
        if have:
            req.add_header("Range", f"bytes={have}-")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if have and resp.status != 206:  # the server ignored the range: start again
                have = 0
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and have + int(declared) > want.size:
                raise DatasetError(f"{url} announces {int(declared):,} bytes, more than the "
                                   f"{want.size - have:,} left of {want.name} (another file)")
            with part.open("ab" if have else "wb") as out:
                # never more than the file's size is read or written, whatever a mirror sends
                while block := resp.read(min(CHUNK, want.size - have + 1)):
                    if have + len(block) > want.size:
                        out.close()
                        part.unlink(missing_ok=True)
                        raise DatasetError(f"{url} sends more than the {want.size:,} bytes of "
                                           f"{want.name} (another file); nothing is kept")
                    out.write(block)
                    have += len(block)
                    if progress:
                        progress(want.name, have, want.size)
    if 0 < part.stat().st_size < want.size:  # broken off: kept, the next try continues it
        raise DatasetError(f"{url}: the transfer broke off after {part.stat().st_size:,} of "
                           f"{want.size:,} bytes")
    problem = check_file(part, want)
    if problem is not None:
        part.unlink(missing_ok=True)  # a bad whole file is never kept: the next try starts clean
        raise DatasetError(problem.replace(str(part), url))
    part.replace(dest)


def download(dataset: str, root: Path, mirrors: tuple[str, ...] | None = None,
             progress: Progress | None = None, timeout: float = 60.0,
             log: Callable[[str], None] = lambda msg: None) -> Path:
    """Fetch every missing or bad file of `dataset` into `root`, trying each mirror in turn; a
    partial download is resumed. Returns the dataset's folder. Raises DatasetError (one line)."""
    spec = spec_of(dataset)
    folder = Path(root) / spec.folder
    if spec.extract is not None and not verify(root, dataset):
        log(f"{Path(root) / EXTRACTED[archive_of(dataset)]}: present")
        return folder
    tiny = Path(root) / EXTRACTED["tiny-imagenet"]
    if dataset == "tiny-imagenet" and (tiny / "wnids.txt").exists():
        _decode_tiny_imagenet(tiny, log)  # extracted, not decoded
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for f in spec.files:
        dest = folder / f.name
        if dest.exists() and check_file(dest, f) is None:
            log(f"{dest}: present, md5 ok")
            continue
        errors = []
        for base in mirrors or spec.mirrors:
            url = base.rstrip("/") + "/" + f.name
            try:
                _fetch(url, dest, f, progress, timeout)
                log(f"{dest}: downloaded from {base}, md5 ok")
                break
            except (urllib.error.URLError, OSError, http.client.HTTPException, DatasetError) as exc:
                reason = getattr(exc, "reason", None) or exc
                errors.append(f"{url}: {reason}")
                log(f"{url}: {reason}; trying the next mirror")
        else:
            raise DatasetError(f"could not download {f.name} ({'; '.join(errors)}); check the "
                               f"network or fetch the files elsewhere and use --from DIR")
    _extract(spec, root, log)
    return folder


def import_from(dataset: str, source: Path, root: Path, log: Callable[[str], None] = lambda m: None
                ) -> Path:
    """Copy a dataset's original files from `source` into `root`, each checked against its md5
    first. `source` may hold the files themselves, or be a data root with the standard layout, or
    anything in between (torchvision's `DIR/FashionMNIST`, whose files are under `raw/`)."""
    spec = spec_of(dataset)
    folder = Path(root) / spec.folder
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(source)
    for f in spec.files:
        levels = Path(spec.folder).parts  # e.g. FashionMNIST/raw: try raw/, FashionMNIST/raw/
        candidates = [source / f.name] + [source / Path(*levels[i:]) / f.name
                                          for i in range(len(levels) - 1, -1, -1)]
        found = next((p for p in candidates if p.exists()), None)
        if found is None:
            raise DatasetError(f"{f.name} is not in {source} (nor in {source / spec.folder}); "
                               f"point --from at the folder holding the original files")
        problem = check_file(found, f)
        if problem is not None:
            raise DatasetError(f"{problem}; not imported")
        dest = folder / f.name
        if dest.resolve() != found.resolve():
            tmp = dest.with_name(dest.name + ".part")
            shutil.copyfile(found, tmp)
            tmp.replace(dest)
        log(f"{dest}: imported from {found}, md5 ok")
    _extract(spec, root, log)
    return folder


def _decode_tiny_imagenet(folder: Path, log: Callable[[str], None]) -> None:
    from fedseq.common.data.readers import decode_tiny_imagenet  # numpy and Pillow

    log(f"{folder}: decoding the JPEGs once into {folder / 'fedseq'} (a minute or two)")
    decode_tiny_imagenet(folder)


def _extract(spec: DatasetSpec, root: Path, log: Callable[[str], None] = lambda m: None) -> None:
    if spec.extract is None:
        return
    archive = Path(root) / spec.folder / spec.extract
    if archive.name == "tiny-imagenet-200.zip":
        with zipfile.ZipFile(archive) as z:
            z.extractall(Path(root))  # zipfile drops absolute paths and '..' parts
        archive.unlink()
        _decode_tiny_imagenet(Path(root) / EXTRACTED["tiny-imagenet"], log)
        return
    if archive.suffix == ".zip":  # EMNIST: gzip/<name>.gz members, flattened into the folder
        with zipfile.ZipFile(archive) as z:
            for member in z.namelist():
                name = PurePosixPath(member).name  # the base name alone: nothing lands outside
                if name.endswith(".gz"):
                    tmp = archive.with_name(name + ".part")
                    with z.open(member) as src, tmp.open("wb") as out:
                        shutil.copyfileobj(src, out, CHUNK)
                    tmp.replace(archive.with_name(name))
        archive.unlink()
        return
    with tarfile.open(archive, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: no paths outside root
            tar.extractall(Path(root), filter="data")
        else:  # pragma: no cover - older Python on a device
            tar.extractall(Path(root))  # noqa: S202 - a checksum-verified original archive
    archive.unlink()
