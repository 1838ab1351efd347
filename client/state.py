"""Each logical client's personal blocks on the device's disk, so a daemon restart loses nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fedseq.common.errors import ProtocolError
from fedseq.common.files import atomic_write
from fedseq.common.models import Weights
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors


class StateStore:
    """Each logical client's personal blocks on disk, per run and round (the two newest kept)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _dir(self, run_id: str) -> Path:
        # a run id comes from the wire: letters, digits, _ - . and never a leading dot (no "..")
        if not re.fullmatch(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,127}", run_id):
            raise ProtocolError(f"run id {run_id!r} is not a safe file name")
        return self.root / run_id

    def _rounds(self, run_id: str, client: int) -> dict[int, Path]:
        folder = self._dir(run_id)
        out = {}
        for path in folder.glob(f"client-{client:04d}-r*.safetensors") if folder.is_dir() else ():
            m = re.fullmatch(r"client-\d+-r(\d+)\.safetensors", path.name)
            if m:
                out[int(m.group(1))] = path
        return out

    def load(self, run_id: str, client: int, before: int | None = None) -> Weights | None:
        """The newest saved state, or the newest saved in a round < `before`: a round that is run
        again (a resumed coordinator, a restarted daemon) starts from the same state as the first
        time."""
        held = {r: p for r, p in self._rounds(run_id, client).items() if before is None or r < before}
        return decode_tensors(held[max(held)].read_bytes()) if held else None

    def answered(self, run_id: str) -> dict[int, int]:
        """An asynchronous run's dispatches this device has answered (client -> the dispatching
        step), as `answer` last saved them; none where nothing readable was saved."""
        path = self._dir(run_id) / "answered.json"
        try:
            raw = json.loads(path.read_text())
            return {int(c): int(d) for c, d in raw.items()}
        except (OSError, ValueError, AttributeError, TypeError):
            return {}

    def answer(self, run_id: str, answered: dict[int, int]) -> None:
        """Save the dispatches answered so far: a restarted daemon does not train them again."""
        folder = self._dir(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "answered.json",
                     json.dumps({str(c): d for c, d in sorted(answered.items())}).encode())

    def save(self, run_id: str, client: int, weights: Weights, round: int = 0) -> None:
        """Write to a temporary file and rename: a crash never leaves a half-written state. The
        two newest rounds are kept."""
        folder = self._dir(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"client-{client:04d}-r{round:06d}.safetensors"
        atomic_write(path, encode_tensors(weights))
        for r, old in sorted(self._rounds(run_id, client).items())[:-2]:
            if r != round:
                old.unlink(missing_ok=True)
