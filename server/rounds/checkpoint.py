"""A run's checkpoint: everything needed to continue after the last complete round, written
atomically after every round (`checkpoint.safetensors` in the run directory).

Tensors: the global weights (`global/<key>`), the in-process pool's personal blocks
(`personal/<client>/<key>`), the algorithm's server state (`server/<name>`: a server optimizer's
moments) and the aggregation rule's state (`rule/<name>`). JSON metadata: the next round, block
versions, the simulated byte accounting, the last evaluation, and the MQTT pool's state (run id,
step sequence, published block versions, assignment). Randomness needs no state: every stream
derives from (seed, purpose, round, client), so a resumed run is bitwise the uninterrupted one; the
one secret among the seeds, the coordinator's noise seed under [privacy], is kept here (the only
file that has it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load as st_load

from fedseq.common.errors import ConfigError
from fedseq.common.evaluation import EvalReport
from fedseq.common.files import atomic_write
from fedseq.common.models import Weights
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.server.rounds.pool_api import PoolState
from fedseq.server.rounds.records import RoundRecord

FILE = "checkpoint.safetensors"


@dataclass
class LoopState:
    """The round loop's bookkeeping between rounds: block versions (the global model's and what
    each client holds, for the byte accounting), each client's latest local score, the last
    evaluation, and the last round's row (written again on resume if it never reached
    metrics.jsonl)."""

    version: dict[str, int]
    client_version: dict[int, dict[str, int]]
    local_scores: dict[int, tuple[int, int]] = field(default_factory=dict)
    last_report: EvalReport | None = None
    last_row: RoundRecord | None = None
    #: simulated time ([fleet]): the virtual clock's seconds
    clock: float = 0.0
    #: the asynchronous driver's bookkeeping (server/rounds/buffered.py); None: a synchronous run
    driver: dict[str, Any] | None = None
    #: [privacy] with adaptive clipping: the clip norm of the next round; None: a fixed one
    clip: float | None = None
    #: [privacy] level = "record": each client's DP-SGD steps so far (its epsilon's count)
    record_steps: dict[int, int] = field(default_factory=dict)
    #: [privacy] level = "client": the seed of the coordinator's noise, a secret of this run
    #: (Ledger.noise_seed); None: no such noise
    noise_seed: int | None = None
    #: [secagg]: clients left out of the rest of the run, with why (Ledger.excluded)
    excluded: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The state as the checkpoint's JSON holds it."""
        rep = self.last_report
        return {
            "last_row": None if self.last_row is None else self.last_row.to_json(),
            "version": self.version,
            "client_version": {str(c): v for c, v in self.client_version.items()},
            "local_scores": {str(c): list(r) for c, r in self.local_scores.items()},
            "last_report": None if rep is None else [
                rep.global_correct, rep.global_total,
                {str(c): list(r) for c, r in rep.per_client.items()}],
            "clock": self.clock,
            **({"driver": self.driver} if self.driver is not None else {}),
            **({"clip": self.clip} if self.clip is not None else {}),
            **({"record_steps": {str(c): n for c, n in self.record_steps.items()}}
               if self.record_steps else {}),
            **({"noise_seed": self.noise_seed} if self.noise_seed is not None else {}),
            **({"excluded": {str(c): why for c, why in self.excluded.items()}}
               if self.excluded else {}),
        }

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> LoopState:
        """The state from `to_json`'s JSON."""
        rep, row = state.get("last_report"), state.get("last_row")
        return cls(
            {b: int(v) for b, v in state["version"].items()},
            {int(c): v for c, v in state["client_version"].items()},
            {int(c): (r[0], r[1]) for c, r in state.get("local_scores", {}).items()},
            None if rep is None else EvalReport(
                rep[0], rep[1], {int(c): (r[0], r[1]) for c, r in rep[2].items()}),
            None if row is None else RoundRecord.from_json(row),
            float(state.get("clock", 0.0)),
            state.get("driver"),
            None if state.get("clip") is None else float(state["clip"]),
            {int(c): int(n) for c, n in state.get("record_steps", {}).items()},
            None if state.get("noise_seed") is None else int(state["noise_seed"]),
            {int(c): str(why) for c, why in state.get("excluded", {}).items()},
        )


@dataclass
class Checkpoint:
    """A run after its last complete round: the next round, the global weights, the round loop's
    state, the pool's (its JSON bookkeeping and the personal blocks an in-process pool holds),
    the algorithm's server state and the aggregation rule's."""

    next_round: int
    global_weights: Weights
    loop: LoopState
    pool: PoolState = field(default_factory=PoolState)
    server: Weights = field(default_factory=dict)
    rule: Weights = field(default_factory=dict)


def save_checkpoint(run_dir: Path, ckpt: Checkpoint) -> None:
    """Write the checkpoint atomically (a crash leaves the previous one)."""
    tensors = {f"global/{k}": v for k, v in ckpt.global_weights.items()}
    for c, weights in ckpt.pool.personal.items():
        tensors.update({f"personal/{c}/{k}": v for k, v in weights.items()})
    tensors.update({f"server/{k}": v for k, v in ckpt.server.items()})
    tensors.update({f"rule/{k}": v for k, v in ckpt.rule.items()})
    state = ckpt.loop.to_json()
    if ckpt.pool.state is not None:
        state["pool"] = ckpt.pool.state
    meta = {"fedseq": json.dumps({"next_round": ckpt.next_round, **state})}
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
        next_round = int(meta.pop("next_round"))
        loop = LoopState.from_json(meta)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"--resume {run_dir}: {FILE} is unreadable ({exc})") from exc
    glob = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("global/")}
    personal: dict[int, Weights] = {}
    for k, v in tensors.items():
        if k.startswith("personal/"):
            _, c, name = k.split("/", 2)
            personal.setdefault(int(c), {})[name] = v
    server, rule = ({k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{part}/")}
                    for part in ("server", "rule"))
    return Checkpoint(next_round, glob, loop, PoolState(meta.get("pool"), personal), server, rule)
