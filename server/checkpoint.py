"""A run's checkpoint: everything needed to continue after the last complete round, written
atomically after every round (`checkpoint.safetensors` in the run directory).

Tensors: the global weights (`global/<key>`) and the in-process pool's personal blocks
(`personal/<client>/<key>`). JSON metadata: the next round, block versions, the simulated byte
accounting, the last evaluation, and the MQTT pool's state (run id, step sequence, published block
versions, assignment). Randomness needs no state: every stream derives from (seed, purpose, round,
client), so a resumed run is bitwise the uninterrupted one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load as st_load

from fedseq.common.errors import ConfigError
from fedseq.common.files import atomic_write
from fedseq.common.models import Weights
from fedseq.common.protocol.tensors import encode_tensors

FILE = "checkpoint.safetensors"


@dataclass
class Checkpoint:
    """A run after its last complete round: the next round, the global weights, the round loop's and
    the pool's JSON state, and the personal blocks an in-process pool holds."""

    next_round: int
    global_weights: Weights
    state: dict[str, Any] = field(default_factory=dict)  # JSON-able coordinator + pool state
    personal: dict[int, Weights] = field(default_factory=dict)


def save_checkpoint(run_dir: Path, ckpt: Checkpoint) -> None:
    """Write the checkpoint atomically (a crash leaves the previous one)."""
    tensors = {f"global/{k}": v for k, v in ckpt.global_weights.items()}
    for c, weights in ckpt.personal.items():
        tensors.update({f"personal/{c}/{k}": v for k, v in weights.items()})
    meta = {"fedseq": json.dumps({"next_round": ckpt.next_round, **ckpt.state})}
    atomic_write(Path(run_dir) / FILE, encode_tensors(tensors, meta))


def load_checkpoint(run_dir: Path) -> Checkpoint:
    """Read a run directory's checkpoint; a missing or unreadable one is a one-line ConfigError."""
    path = Path(run_dir) / FILE
    if not path.exists():
        raise ConfigError(f"--resume {run_dir}: no {FILE} there (the run stopped before its first "
                          "round completed); start it again with --overwrite")
    raw = path.read_bytes()
    try:
        tensors = st_load(raw)
        n = int.from_bytes(raw[:8], "little")
        meta = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["fedseq"])
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"--resume {run_dir}: {FILE} is unreadable ({exc})") from exc
    glob = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("global/")}
    personal: dict[int, Weights] = {}
    for k, v in tensors.items():
        if k.startswith("personal/"):
            _, c, name = k.split("/", 2)
            personal.setdefault(int(c), {})[name] = v
    next_round = int(meta.pop("next_round"))
    return Checkpoint(next_round, glob, meta, personal)
