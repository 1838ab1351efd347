"""Small file helpers both sides use: crash-safe writes and secrets read from files."""

from __future__ import annotations

import os
from pathlib import Path

from fedseq.common.errors import ConfigError


def atomic_write(path: Path, data: bytes, durable: bool = True) -> None:
    """Write `data` to a temporary file beside `path`, then rename it over `path`: a reader (or a
    resume after a crash) sees the old file or the new one, never half of one. `durable` also
    fsyncs before the rename, so a power cut cannot leave an empty file either (checkpoints, a
    device's personal state); a status file that is rewritten every round need not pay for it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    tmp.replace(path)


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
