"""Reading run directories: a run's rows, config, status and clients (`load_run`), a sweep's
folder as its seeds' runs (`expand_sweeps`), and the notes a run's files call for."""

from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedseq.common.errors import ConfigError
from fedseq.common.text import markdown_cell, printable
from fedseq.server.rounds.records import RoundRecord

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: the accuracies of a summary row, by their table names (RoundRecord.accuracies)
ACCURACIES = ("G", "F", "P", "L", "Lr")
#: how many evaluated rounds "last10" averages
LAST = 10


@dataclass
class Run:
    path: Path
    label: str
    config: dict[str, Any]
    rows: list[RoundRecord]
    clients: list[dict[str, str]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    #: the label is the user's (--label): the run is reported under it, apart from other labels
    labelled: bool = False

    @property
    def algorithm(self) -> str:
        """The run's algorithm, as its config names it."""
        return str(self.config.get("algorithm", {}).get("name", "?"))

    @property
    def init_global(self) -> bool:
        """The global model keeps an untrained head or base (FedBABU, FedSeq, FedPer, ...)."""
        return any(r.global_model for r in self.rows)

    @property
    def train_rows(self) -> list[RoundRecord]:
        """The run's training rows (no fine-tuning row)."""
        return [r for r in self.rows if r.phase == "train"]


def divergence_note(run: Run) -> str | None:
    """What diverged in a run (a NaN or Inf loss; recorded since protocol v4): training updates
    refused as diverged, and clients whose fine-tuning diverged (their P is their diverged
    model's score); None when nothing did."""
    trained = sum(1 for r in run.train_rows for code in r.refusal_codes().values()
                  if code == "diverged")
    tuned = sorted(c for r in run.rows if r.phase == "finetune" for c in r.diverged)
    if not trained and not tuned:
        return None
    parts = [f"{trained} training updates refused as diverged"] if trained else []
    if tuned:
        parts.append(f"fine-tuning diverged for client{'s' if len(tuned) > 1 else ''} "
                     f"{', '.join(map(str, tuned))} (counted in P with their diverged models' "
                     "scores)")
    return f"{markdown_cell(run.path, 300)}: NaN or Inf loss: " + "; ".join(parts) + "."


def splice_note(run: Run) -> str | None:
    """Where a resumed run's parts computed with something else (status.json `segments`,
    recorded since 2026-11-25: threads, torch, device, CPU kernels): such a run is a valid run
    of its config, not bitwise what one uninterrupted run gives. None when its parts agree."""
    parts = run.status.get("segments", [])
    changes = []
    for before, after in zip(parts, parts[1:], strict=False):
        diff = [f"{k} {before[k]} -> {after[k]}" for k in after
                if k != "from_round" and k in before and before[k] != after[k]]
        if diff:
            changes.append(f"from round {after['from_round']}: {', '.join(diff)}")
    if not changes:
        return None
    return (f"{markdown_cell(run.path, 300)}: resumed on other compute "
            f"({markdown_cell('; '.join(changes), 600)}): not bitwise one run.")


def load_run(path: Path, label: str | None = None) -> Run:
    """A run directory read: its rows, config, status and clients; a folder without metrics.jsonl is
    a ConfigError in one line."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        raise ConfigError(f"{path} is not a run directory (no metrics.jsonl); pass the folder a "
                          f"fedseq-sim or fedseq-server run wrote with --out")
    rows = []
    for n, line in enumerate(metrics.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(RoundRecord.from_json(json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{metrics}:{n}: not JSON ({exc}); the file is damaged") from exc
            except ConfigError as exc:
                raise ConfigError(f"{metrics}:{n}: {exc}; the file is damaged") from exc
    config = _read_config(path / "config.toml") if (path / "config.toml").exists() else {}
    clients = _read_clients(path / "clients.csv") if (path / "clients.csv").exists() else []
    status = _read_status(path / "status.json") if (path / "status.json").exists() else {}
    if (path / "devices.json").exists():  # a deployment: where it trained is its devices
        status["device"] = trained_on(_read_object(path / "devices.json"))
    return Run(path, label or path.name, config, rows, clients, status, labelled=bool(label))


#: the config's sections a report reads, each a table
_SECTIONS = ("data", "model", "algorithm", "train", "seeds", "aggregation", "deploy")


def _damaged(file: Path, what: str) -> ConfigError:
    return ConfigError(f"{printable(file, 300)}: {what}; the file is damaged or not fedseq's")


def _read_text(file: Path) -> str:
    try:
        return file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _damaged(file, f"cannot be read as text ({type(exc).__name__})") from exc


def _read_object(file: Path) -> dict[str, Any]:
    """A JSON file whose top level must be an object (status.json, devices.json)."""
    try:
        value = json.loads(_read_text(file))
    except json.JSONDecodeError as exc:
        raise _damaged(file, f"not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise _damaged(file, f"a JSON {type(value).__name__}, not an object")
    return value


def _read_config(file: Path) -> dict[str, Any]:
    try:
        config = tomllib.loads(_read_text(file))
    except tomllib.TOMLDecodeError as exc:
        raise _damaged(file, f"not TOML ({printable(exc, 200)})") from exc
    for key in _SECTIONS:
        if key in config and not isinstance(config[key], dict):
            raise _damaged(file, f"[{key}] is a {type(config[key]).__name__}, not a table")
    return config


def _read_status(file: Path) -> dict[str, Any]:
    """status.json, keeping what a report reads only in the shapes fedseq writes it: a state
    string, resumed segments as objects with their first round (others left out)."""
    status = _read_object(file)
    if "state" in status and not isinstance(status["state"], str):
        raise _damaged(file, f"its state is a {type(status['state']).__name__}, not a string")
    segments = status.get("segments", [])
    status["segments"] = [g for g in segments if isinstance(g, dict) and "from_round" in g] \
        if isinstance(segments, list) else []
    return status


def _read_clients(file: Path) -> list[dict[str, str]]:
    """clients.csv's rows; an accuracy that is not a number in [0, 1] is a one-line error."""
    try:
        rows = list(csv.DictReader(io.StringIO(_read_text(file))))
    except csv.Error as exc:
        raise _damaged(file, f"not CSV ({exc})") from exc
    for n, row in enumerate(rows, 2):
        acc = row.get("accuracy")
        if acc:
            try:
                ok = 0.0 <= float(acc) <= 1.0
            except ValueError:
                ok = False
            if not ok:
                raise _damaged(file, f"line {n}: accuracy {printable(acc, 40)!r} is not a "
                                     "number in [0, 1]")
    return rows


def trained_on(stacks: dict[str, Any]) -> str:
    """A deployment's devices.json in a few words: how many devices of each kind (the GPU or
    else the CPU/board, with torch's device and version, as each device last described itself),
    and how many never described themselves: "10 x NVIDIA Jetson Nano Developer Kit (cuda:0,
    torch 1.12.1)"."""
    kinds: dict[str, int] = {}
    silent = 0
    for rows in stacks.values():
        if not isinstance(rows, list) or not rows or not isinstance(rows[-1], dict):
            silent += 1
            continue
        last = rows[-1]
        kind = (f"{last.get('gpu') or last.get('cpu') or '?'} "
                f"({last.get('torch_device', '?')}, torch {last.get('torch', '?')})")
        kinds[kind] = kinds.get(kind, 0) + 1
    parts = [f"{n} x {k}" for k, n in sorted(kinds.items())]
    if silent:
        parts.append(f"{silent} undescribed")
    return "; ".join(parts) or "no devices"


def expand_sweeps(paths: list[Path], labels: list[str] | None) -> list[Path]:
    """A sweep's folder (fedseq-sim --seeds: seed-*/ run directories, no metrics.jsonl of its
    own) stands for its seeds' runs, a campaign's (campaign.json) for the runs it has made."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "campaign.json").is_file() and not (p / "metrics.jsonl").exists():
            if labels:
                raise ConfigError(f"{p} is a campaign: --label names single runs; drop --label")
            out += [r for r in campaign_runs(p) if (r / "metrics.jsonl").exists()]
            continue
        seeds = sorted(p.glob("seed-*/metrics.jsonl"), key=lambda m: _seed_number(m.parent))
        if not (p / "metrics.jsonl").exists() and seeds:
            if labels:
                raise ConfigError(f"{p} is a sweep of {len(seeds)} seeds: --label names single "
                                  "runs; drop --label (the sweep is labelled by its folder)")
            out += [m.parent for m in seeds]
        else:
            out.append(p)
    return out


def campaign_runs(folder: Path) -> list[Path]:
    """The run folders campaign.json lists, each inside the campaign's folder: a folder that is
    absolute or climbs out of it (`..`), or a campaign.json of another shape, is refused in one
    line (a campaign folder may come from someone else)."""
    state = folder / "campaign.json"
    runs = _read_object(state).get("runs", [])
    if not isinstance(runs, list):
        raise _damaged(state, f"its runs are a JSON {type(runs).__name__}, not a list")
    inside = folder.resolve()
    out = []
    for r in runs:
        name = r.get("folder") if isinstance(r, dict) else None
        if not isinstance(name, str) or not name:
            raise _damaged(state, "a run without a folder name")
        path = (folder / name)
        if Path(name).is_absolute() or not path.resolve().is_relative_to(inside):
            raise _damaged(state, f"run folder {printable(name, 80)!r} is outside the campaign's "
                                  "folder")
        out.append(path)
    return out


def _seed_number(path: Path) -> int:
    tail = path.name.removeprefix("seed-")
    return int(tail) if tail.isdigit() else -1
