"""Seeds as an axis: one config run under several seeds (`fedseq-sim --seeds 0,1,2`).

A sweep writes OUT/seed-<s>/, one normal run directory per seed. Its streams (SEED_STREAMS:
data, init, selection, training) either follow the sweep's seed (`--vary`, default all of them)
or stay pinned at the config's own value, so a researcher can ask "how much of the spread is the
initialisation?" by varying init alone. Calling the same command again continues it: a finished
seed is kept, an interrupted one resumes after its last complete round, a missing one starts.
`fedseq report` groups the runs of one sweep (docs/explanation/reproducibility.md, "Seeds").
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedseq.common.config import SEED_STREAMS, ExperimentConfig, load_config
from fedseq.common.errors import ConfigError


def parse_seeds(text: str) -> list[int]:
    """'0,1,2', '0-4' or a mix ('0-2,7'): distinct seeds >= 0 in the given order."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ConfigError(f"--seeds {text!r}: expected seeds >= 0 like 0,1,2 or 0-4") from None
        if last < first:
            raise ConfigError(f"--seeds {text!r}: {part.strip()} is an empty range")
        seeds += range(first, last + 1)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r} names a seed twice; give each once")
    return seeds


def parse_vary(text: str) -> tuple[str, ...]:
    """'all' or a comma list of SEED_STREAMS."""
    if text.strip() == "all":
        return SEED_STREAMS
    streams = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in streams if s not in SEED_STREAMS]
    if bad or not streams:
        raise ConfigError(f"--vary {text!r}: name 'all' or some of {', '.join(SEED_STREAMS)} "
                          "(comma-separated)")
    return streams


def seed_config(cfg: ExperimentConfig, seed: int, vary: tuple[str, ...]) -> ExperimentConfig:
    """The config of one seed of a sweep: the varied streams follow `seed`, the others keep the
    value they have in `cfg` (pinned in [seeds])."""
    pins = {s: (None if s in vary else cfg.seed_for(s)) for s in SEED_STREAMS}
    if cfg.privacy.client_level and "noise" not in vary:  # unpinned: each run's own secret
        pins["noise"] = cfg.seeds.noise  # (Ledger.noise_seed); without [privacy] none is drawn
    out = cfg.model_copy(deep=True)
    out.seed = seed
    for stream, value in pins.items():
        setattr(out.seeds, stream, value)
    return out


def seed_dir(out: Path, seed: int) -> Path:
    """The run directory of one seed of a sweep: OUT/seed-S."""
    return out / f"seed-{seed}"


def seed_state(path: Path, cfg: ExperimentConfig) -> str:
    """What a sweep does with one seed's folder: "finished" (keep), "resume", "new" (empty or
    absent), or "restart" (a run that died before its first checkpoint). Raises ConfigError where
    the folder holds a run of another config (a changed --config or --set)."""
    if not path.exists() or not any(path.iterdir()):
        return "new"
    stored = path / "config.toml"
    if not stored.is_file():
        raise ConfigError(f"{path} exists but is not a run directory; move it away or pass "
                          "another --out")
    changed = result_changes(load_config(stored), cfg)
    if changed:
        raise ConfigError(f"{path} holds a run of another config ({', '.join(changed)}: the "
                          "sweep's --config or --set changed); pass another --out, or --overwrite "
                          "to replace the sweep")
    status = path / "status.json"
    if status.is_file() and json.loads(status.read_text()).get("state") == "finished":
        return "finished"
    return "resume" if (path / "checkpoint.safetensors").exists() else "restart"


def defining(config: dict[str, Any]) -> dict[str, Any]:
    """What defines a run's results, from a config as a dict (a model dump or a run directory's
    config.toml): all of it but the deployment section, the data root (a resumed sweep may
    run from another folder or against another broker, and give the same numbers) and other
    algorithms' parameter tables ([algorithm.<name>] of an algorithm not run), with every
    default filled in, so a run directory written before a key existed (its default then being
    the only behaviour) compares equal to one that records the default."""
    with contextlib.suppress(ValidationError):  # a config this version cannot read: as written
        # (names as written: the report compares configs without loading torch's registries)
        config = ExperimentConfig.model_validate(config, context={"registries": False}
                                                 ).model_dump(mode="json")
    out = {k: v for k, v in config.items() if k != "deploy"}
    out["data"] = {k: v for k, v in out.get("data", {}).items() if k != "root"}
    alg = out.get("algorithm", {})
    if isinstance(alg, dict):  # other algorithms' tables do not define this run
        out["algorithm"] = {k: v for k, v in alg.items()
                            if not isinstance(v, dict) or k == alg.get("name")}
    return out


def result_changes(before: ExperimentConfig, after: ExperimentConfig) -> list[str]:
    """Where two configs differ in what defines a run's results (`defining`), as dotted keys
    with both values, e.g. ["train.lr (0.01 -> 0.02)"]; empty where they give the same run."""
    return changed_keys(defining(before.model_dump(mode="json")),
                         defining(after.model_dump(mode="json")))


def changed_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Where two nested dicts (configs' defining parts) differ, as dotted keys with both values."""
    out = []
    for key in sorted(set(a) | set(b), key=str):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += changed_keys(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key} ({x!r} -> {y!r})")
    return out
