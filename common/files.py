"""Small file helpers both sides use: crash-safe writes and secrets read from files."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from fedseq.common.errors import ConfigError


def atomic_write(path: Path, data: bytes, durable: bool = True, mode: int = 0o644) -> None:
    """Write `data` to a new temporary file beside `path`, then rename it over `path`: a reader
    (or a resume after a crash) sees the old file or the new one, never half of one. The file has
    `mode` from its first byte (secrets and device facts are never readable by others, not even
    for a moment), and the temporary name is fresh and exclusive (no link planted in the folder
    is followed). `durable` also fsyncs the file before the rename and the folder after it, so
    a power cut cannot leave an empty or a vanished file (checkpoints, a device's personal
    state); a status file that is rewritten every round need not pay for it."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable: a power cut keeps them."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_secret(path: Path | None, setting: str = "password_file") -> str | None:
    """The first line of a secret file (a broker password), None without a file; an unreadable
    file is a one-line ConfigError naming the setting."""
    if path is None:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{setting} {path}: {exc.strerror or exc}; fix the path or its "
                          "permissions") from exc
