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


#: a secret's least length where it guards a role an attacker may guess at online or offline
#: (the cluster secret, the flood guard's admin password): `openssl rand -hex 32` gives 64
MIN_SECRET_CHARS = 32
HOW_TO_MAKE_A_SECRET = "make one with `openssl rand -hex 32`"


def strong_secret(secret: str, where: str, risk: str = "it can be guessed") -> str:
    """`secret` when it is long and varied enough to resist guessing (MIN_SECRET_CHARS, 8
    distinct characters); else ConfigError in one line, with `risk`, saying how to make one."""
    if len(secret) < MIN_SECRET_CHARS or len(set(secret)) < 8:
        raise ConfigError(f"{where} is too weak ({len(secret)} characters, {len(set(secret))} "
                          f"distinct; at least {MIN_SECRET_CHARS} and 8): {risk}; "
                          f"{HOW_TO_MAKE_A_SECRET}")
    return secret


def read_private_secret(path: Path | str, named: str, risk: str = "it can be guessed") -> str:
    """The first line of a secret file that must be readable by its owner alone and strong
    (strong_secret); ConfigError in one line otherwise, the file `named` as its setting gives it
    ("deploy.guard_password_file /etc/fedseq/guard.pw", "FEDSEQ_SECRET_FILE=/run/s")."""
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{named}: cannot read it ({exc.strerror or exc}); fix the path or its "
                          "permissions") from exc
    if mode & 0o077:
        raise ConfigError(f"{named} is readable by others (mode {mode & 0o777:o}); "
                          f"`chmod 600 {path}`, and make a new secret if anyone may have read it")
    if not text:
        raise ConfigError(f"{named} is empty; {HOW_TO_MAKE_A_SECRET} > {path}")
    return strong_secret(text.splitlines()[0], f"the secret in {named}", risk)


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
