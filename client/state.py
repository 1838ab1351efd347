"""Each logical client's personal blocks on the device's disk, so a daemon restart loses nothing."""

from __future__ import annotations

import os
import re
from pathlib import Path

from fedseq.common.errors import ProtocolError
from fedseq.common.models import Weights
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors


class StateStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, run_id: str, client: int) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", run_id):
            raise ProtocolError(f"run id {run_id!r} is not a safe file name")
        return self.root / run_id / f"client-{client:04d}.safetensors"

    def load(self, run_id: str, client: int) -> Weights | None:
        path = self._path(run_id, client)
        return decode_tensors(path.read_bytes()) if path.exists() else None

    def save(self, run_id: str, client: int, weights: Weights) -> None:
        """Write to a temporary file and rename: a crash never leaves a half-written state."""
        path = self._path(run_id, client)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(encode_tensors(weights))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
