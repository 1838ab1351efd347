"""`fedseq report RUN_DIR...`: figures and a summary table from run directories.

Reads each run's metrics.jsonl, clients.csv, config.toml and status.json; writes PNG figures
(matplotlib, the `report` extra) and summary.md / summary.csv, optionally beside a paper's table,
and paired.csv (every other run or sweep against the first, seed by seed, also in summary.md).
Figures: accuracy.png (global, personalized and the testbed's local-model accuracy per round, all
runs on one axis each), clients.png (per-client accuracy distribution), cost.png (cumulative bytes
and training FLOPs against global accuracy), edge.png (global accuracy against cumulative wall
time and against the energy the devices measured, and energy per round), seconds.png (seconds per
round). The table adds the devices' energy (kJ in total, J per round) where it was measured.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedseq.common.config import SEED_STREAMS
from fedseq.common.errors import ConfigError
from fedseq.common.text import csv_cell, markdown_cell, plot_label, printable
from fedseq.server.records import RoundRecord
from fedseq.server.seeds import defining

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Published numbers (%), keyed by our algorithm names, and the metric of ours each column
# compares with. FedReG Table 6: its Jetson testbed (FMNIST, 30 clients, Dir(0.1), join 0.2,
# ConvNet; best global / best average client accuracy over 100 rounds, mean of five runs). Its
# "P" scores each client's locally trained model (section 5), which is our L (every client's
# latest local model, stale for clients not selected lately) or Lr (only the round's trainers'
# fresh local models): section 5 admits both readings, so both sit beside it. FedSeq Table 2 of
# the arXiv version, Table 4 of the Appl. Sci. 2024 version (same numbers), MNIST column:
# accuracy at T = 100/200/300, FedBABU and FedSeq after fine-tuning: our P final.
PAPERS: dict[str, dict[str, Any]] = {
    "fedreg-table6": {
        "title": "FedReG Table 6 (testbed, FMNIST; mean of 5 runs)",
        "columns": ("G", "P"),
        "compare": {"G": ("G best",), "P": ("L best", "Lr best")},
        "rows": {"fedavg": (82.13, 98.05), "fedprox": (81.18, 98.05), "fedper": (72.27, 98.29),
                 "fedrep": (59.75, 97.88), "fedbabu": (78.73, 97.76), "fedrod": (83.96, 98.01),
                 "fedreg": (86.12, 98.25)},
    },
    "fedseq-table2-mnist": {
        "title": "FedSeq Table 2 (arXiv) = Table 4 (Appl. Sci. 2024), MNIST",
        "columns": ("T=100", "T=200", "T=300"),
        "compare": {"T=100": ("P final",), "T=200": ("P final",), "T=300": ("P final",)},
        "rows": {"fedavg": (91.48, 96.32, 97.48), "fedper": (98.30, 98.63, 98.69),
                 "lg-fedavg": (97.95, 98.17, 98.13), "fedrep": (98.56, 98.69, 98.75),
                 "fedrod": (98.61, 98.95, 99.06), "fedbabu": (98.19, 98.77, 98.84),
                 "fedseq-vanilla": (98.21, 98.84, 98.99), "fedseq-anti": (98.34, 98.81, 98.96)},
    },
}
#: the accuracies of a summary row, by their table names (RoundRecord.accuracies)
ACCURACIES = ("G", "P", "L", "Lr")
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

    @property
    def algorithm(self) -> str:
        return str(self.config.get("algorithm", {}).get("name", "?"))

    @property
    def init_global(self) -> bool:
        """The global model keeps an untrained head or base (FedBABU, FedSeq, FedPer, ...)."""
        return any(r.global_model for r in self.rows)

    @property
    def train_rows(self) -> list[RoundRecord]:
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
    return Run(path, label or path.name, config, rows, clients, status)


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


def _values(rows: list[RoundRecord], name: str) -> list[float]:
    """The accuracy `name` (G, P, L, Lr) of the rows that have it."""
    return [a for r in rows if (a := r.accuracies()[name]) is not None]


def _model_label(model: dict[str, Any]) -> str:
    """The model's name, and its normalization where it is not the default (model.norm):
    runs that differ only in it must not read as the same model."""
    norm = model.get("norm", "batch")
    return str(model.get("name", "?")) + ("" if norm == "batch" else f" ({norm})")


def summarize(run: Run) -> dict[str, Any]:
    """One table row: final, best and last-10-rounds G, P, L and Lr (%), the per-client spread
    of the final personalized accuracy, rounds, bytes, FLOPs, time, energy."""
    train = run.train_rows
    last = run.rows[-1] if run.rows else None
    out: dict[str, Any] = {"run": run.label, "algorithm": run.algorithm,
                           "dataset": run.config.get("data", {}).get("dataset", "?"),
                           "model": _model_label(run.config.get("model", {})),
                           "rounds": len(train),
                           "of": run.config.get("rounds", len(train)),
                           "finetuned": last is not None and last.phase == "finetune",
                           "state": run.status.get("state", "?"),
                           # where it trained: "cpu" or the GPU's name (runs made before 2026-11 say nothing)
                           "device": run.status.get("device")}
    for name in ACCURACIES:
        vals = _values(run.rows, name)
        tail = _values(train, name)[-LAST:]
        out[f"{name} final"] = round(100 * vals[-1], 2) if vals else None
        out[f"{name} best"] = round(100 * max(vals), 2) if vals else None
        out[f"{name} last{LAST}"] = round(100 * sum(tail) / len(tail), 2) if tail else None
    accs = sorted(100 * float(c["accuracy"]) for c in run.clients if c.get("accuracy"))
    worst = accs[: max(1, math.ceil(0.1 * len(accs)))]
    # FedBABU's form: the mean over clients (each client counts once, whatever its test size) ±
    # the sd over clients, beside P's pooled sum-correct / sum-total
    out["client mean"] = round(statistics.fmean(accs), 2) if accs else None
    out["client sd"] = round(statistics.pstdev(accs), 2) if accs else None
    out["worst 10%"] = round(sum(worst) / len(worst), 2) if accs else None
    out["global model"] = "init head/base" if run.init_global else "trained"
    out["MB moved"] = round(sum(r.bytes_down + r.bytes_up for r in train) / 1e6, 1)
    out["train TFLOP"] = round(sum(r.train_flops for r in run.rows) / 1e12, 2)
    out["wall s"] = round(sum(r.seconds or 0 for r in run.rows), 1)
    # measured on the devices (deployments with a sensor)
    joules = [r.energy_j for r in train if r.energy_j is not None]
    out["energy kJ"] = round(sum(joules) / 1e3, 3) if joules else None
    out["J/round"] = round(sum(joules) / len(joules), 1) if joules else None
    tuned = [r.energy_j for r in run.rows if r.phase == "finetune" and r.energy_j is not None]
    out["finetune kJ"] = round(sum(tuned) / 1e3, 3) if tuned else None
    return out


# -- seeds: runs of one config that differ only by seed ------------------------------------


def _seed_of(run: Run, stream: str) -> Any:
    pinned = run.config.get("seeds", {}).get(stream)
    return run.config.get("seed") if pinned is None else pinned


def _group_key(run: Run) -> str:
    """What a run is a function of, but its seeds (seeds.defining without `seed`, [seeds])."""
    cfg = {k: v for k, v in defining(run.config).items() if k not in ("seed", "seeds")}
    return json.dumps(cfg, sort_keys=True, default=str)


@dataclass
class Group:
    """The runs of one config under several seeds (a group of one is a single run)."""

    label: str
    runs: list[Run]

    @property
    def varied(self) -> list[str]:
        """The random streams whose seed differs between the runs."""
        return [s for s in SEED_STREAMS if len({_seed_of(r, s) for r in self.runs}) > 1]

    @property
    def seeds(self) -> list[Any]:
        return [r.config.get("seed") for r in self.runs]

    @property
    def legend(self) -> str:
        return self.label + (f" ({len(self.runs)} seeds)" if len(self.runs) > 1 else "")

    @property
    def init_global(self) -> bool:
        return any(r.init_global for r in self.runs)


def group_runs(runs: list[Run]) -> list[Group]:
    """Group runs whose configs differ only by seed, in order of first appearance. A group of
    several is labelled by its runs' common parent folder (a sweep's OUT) or the first run."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(_group_key(run), []).append(run)
    out = []
    for members in groups.values():
        label = members[0].label
        if len(members) > 1:
            parents = {r.path.resolve().parent for r in members}
            label = parents.pop().name if len(parents) == 1 else f"{label} (+{len(members) - 1})"
        out.append(Group(label, members))
    return out


def summarize_group(group: Group) -> dict[str, Any]:
    """One table row for a group: for every number of `summarize`, the mean over the seeds (in
    the metric's own column) and its sd, min and max (sample sd; none for a single run)."""
    rows = [summarize(r) for r in group.runs]
    first = rows[0]
    out: dict[str, Any] = {"run": group.label, "algorithm": first["algorithm"],
                           "dataset": first["dataset"], "model": first["model"],
                           "seeds": len(rows),
                           "varied": ",".join(group.varied) or "-",
                           "rounds": min(r["rounds"] for r in rows), "of": first["of"],
                           "finetuned": all(r["finetuned"] for r in rows),
                           "state": first["state"] if len({r["state"] for r in rows}) == 1 else "mixed",
                           "device": " + ".join(sorted({r["device"] for r in rows if r["device"]})) or None,
                           "global model": first["global model"]}
    spread: dict[str, Any] = {}
    for key, value in first.items():
        if key in out or key == "run" or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        vals = [r[key] for r in rows if r.get(key) is not None]
        if len(vals) < len(rows):  # not measured in every run: no mean
            out[key] = None
            continue
        if len(vals) == 1:
            out[key] = vals[0]
            continue
        out[key] = round(statistics.fmean(vals), 3)
        spread[f"{key} sd"] = round(statistics.stdev(vals), 3)
        spread[f"{key} min"] = min(vals)
        spread[f"{key} max"] = max(vals)
    return {**out, **spread}


#: the accuracies the paired table compares
PAIRED = ("G best", "G final", "P final", "L best", "Lr best")


def _seed_key(run: Run) -> tuple[Any, ...]:
    return tuple(_seed_of(run, s) for s in SEED_STREAMS)


def paired_rows(groups: list[Group]) -> list[dict[str, Any]]:
    """Every other group against the first, seed by seed. Runs of the same seeds share the
    data partition, the client selection and the initial weights, so the per-seed difference
    is free of what the seeds change in both, which a difference of means over seeds is not.
    Per metric: the mean and sd of the differences (points) and in how many seeds the
    difference has the mean's sign. Finished runs only; a group needs two seeds in common."""
    ref, *others = groups
    done = {_seed_key(r): summarize(r) for r in ref.runs if r.status.get("state") == "finished"}
    out = []
    for group in others:
        pairs = [(done[_seed_key(r)], summarize(r)) for r in group.runs
                 if _seed_key(r) in done and r.status.get("state") == "finished"]
        if len(pairs) < 2:
            continue
        row: dict[str, Any] = {"run": group.label, "against": ref.label, "seeds": len(pairs)}
        for key in PAIRED:
            diffs = [b[key] - a[key] for a, b in pairs if a[key] is not None and b[key] is not None]
            if len(diffs) < len(pairs):
                continue
            mean = statistics.fmean(diffs)
            row[f"{key} diff"] = round(mean, 3)
            row[f"{key} diff sd"] = round(statistics.stdev(diffs), 3)
            row[f"{key} same sign"] = sum(1 for d in diffs if d * mean > 0)
        out.append(row)
    return out


def _paired_table(rows: list[dict[str, Any]]) -> list[str]:
    shown = [k for k in PAIRED if any(f"{k} diff" in r for r in rows)]
    lines = ["", f"Paired by seed against {markdown_cell(rows[0]['against'])} (runs of one seed share the "
             "partition, the client selection and the initial weights): mean ± sd over seeds of "
             "this row minus the reference, in points, and (k/n) the seeds whose difference has "
             "that sign.", "",
             "| run | seeds | " + " | ".join(f"{k} diff" for k in shown) + " |",
             "|" + "---|" * (len(shown) + 2)]
    for r in rows:
        cells = [f"{r[k + ' diff']:+.2f} ± {r[k + ' diff sd']:.2f} ({r[k + ' same sign']}/"
                 f"{r['seeds']})" if f"{k} diff" in r else "-" for k in shown]
        lines.append(f"| {markdown_cell(r['run'])} | {r['seeds']} | " + " | ".join(cells) + " |")
    return lines


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


# The Markdown table's columns (summary.csv has every number, spreads included); an accuracy
# shows mean ± sd where a group has several seeds.
MD_COLUMNS = ("run", "algorithm", "dataset", "model", "seeds", "varied", "rounds", "finetuned",
              "device", "G best", f"G last{LAST}", "G final", "P best", "P final", "L best", "L final",
              "Lr best", "client mean", "client sd", "worst 10%", "global model", "MB moved", "train TFLOP",
              "wall s", "energy kJ", "J/round", "finetune kJ")


def _paper_columns(rows: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, str]:
    """Add the paper's numbers to the rows; returns {paper column: the last of our columns it
    is compared with}, where it goes in the Markdown table. FedSeq's T columns: only the one
    equal to the runs' rounds, where there is one."""
    rounds = {r["of"] for r in rows}
    columns = [c for c in ref["columns"] if c.startswith("T=") and int(c[2:]) in rounds] \
        or list(ref["columns"])
    for row in rows:
        published = ref["rows"].get(row["algorithm"])
        for col in columns:
            row[f"paper {col}"] = published[ref["columns"].index(col)] if published else None
    return {f"paper {c}": ref["compare"][c][-1] for c in columns}


def write_tables(runs: list[Run], out: Path, paper: str | None = None) -> list[dict[str, Any]]:
    groups = group_runs(runs)
    rows = [summarize_group(g) for g in groups]
    ref = PAPERS[paper] if paper else None
    beside = _paper_columns(rows, ref) if ref is not None else {}
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows({k: csv_cell(v) for k, v in r.items()} for r in rows)
    gpu = any(r["device"] not in (None, "cpu") for r in rows)  # CPU only, the usual case: no column
    shown = [k for k in MD_COLUMNS if any(r.get(k) is not None for r in rows) and (gpu or k != "device")]
    for col, after in beside.items():  # the paper's number right of the metric it matches
        shown.insert(shown.index(after) + 1 if after in shown else len(shown), col)

    def cell(row: dict[str, Any], key: str) -> str:
        if key == "rounds" and row["state"] != "finished":  # never a partial run read as whole
            return f"{row['rounds']} of {row['of']}, {row['state']}"
        sd = row.get(f"{key} sd")
        text = _fmt(row.get(key)) + (f" ± {sd:.2f}" if sd is not None and key in _ACC_KEYS else "")
        return markdown_cell(text, 400)  # run folders and device names are anyone's words

    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(r, k) for k in shown) + " |" for r in rows]
    notes = [
        "",
        "G: global model on all clients' test rows; P: each client's personalized model after "
        "aggregation (after fine-tuning for FedBABU/FedSeq/local); L: each client's most recent "
        "locally trained model (stale for clients not selected lately); Lr: the fresh local "
        "models of each round's trainers only (FedReG section 5 admits both readings of its "
        f"testbed's P). final = last evaluated row, best = best evaluated round (what FedReG "
        f"reports), last{LAST} = mean of the last {LAST} evaluated training rounds. client mean "
        "/ client sd / worst 10%: the final personalized accuracies over clients, each client "
        "once (FedBABU's mean ± sd over clients; P pools sum-correct / sum-total), and the mean "
        "of the worst tenth. "
        "Accuracies in %; with several seeds: mean ± sd over seeds (min/max in summary.csv), "
        "varied = the random streams the seeds changed. train TFLOP: measured training compute, "
        "fine-tuning included.",
    ]
    if any(r["state"] != "finished" for r in rows):
        notes.append("rounds: a row not finished says so (\"45 of 100, interrupted\"); its final "
                     "and last10 are those of its last row, and a \"mixed\" group averages runs "
                     "stopped at different rounds: finish the runs before comparing them.")
    notes += [n for g in groups for r in g.runs if (n := divergence_note(r)) is not None]
    notes += [n for g in groups for r in g.runs if (n := splice_note(r)) is not None]
    if ref is not None:
        compared = "; ".join(f"paper {c} beside {' and '.join(v)}" for c, v in ref["compare"].items()
                             if f"paper {c}" in beside)
        notes.append(f"paper columns: {ref['title']}: {compared}.")
    paired = paired_rows(groups)
    if paired:
        with (out / "paired.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in paired for k in r)))
            w.writeheader()
            w.writerows({k: csv_cell(v) for k, v in r.items()} for r in paired)
        notes += _paired_table(paired)
    (out / "summary.md").write_text("\n".join(lines + notes) + "\n")
    return rows


_ACC_KEYS = {f"{n} {w}" for n in ACCURACIES for w in ("final", "best", f"last{LAST}")} \
    | {"client mean", "client sd", "worst 10%"}


@dataclass
class _Palette:
    """What the figures share: the runs grouped by seed, each run's colour (its group's) and
    label (its group's folder name, shown as is), and the groups labelled in the current figure
    (each once)."""

    groups: list[Group]
    colors: dict[int, str]
    names: dict[int, str]
    labelled: set[Any] = field(default_factory=set)

    @classmethod
    def of(cls, runs: list[Run]) -> _Palette:
        groups = group_runs(runs)
        return cls(groups, {id(r): f"C{i % 10}" for i, g in enumerate(groups) for r in g.runs},
                   {id(r): plot_label(g.label) for g in groups for r in g.runs})

    def style(self, run: Run, points: int) -> dict[str, Any]:
        """A run's line against global accuracy in its group's colour, labelled once: dashed and
        starred where the global model keeps an untrained head or base, markers while there
        are few points."""
        color = self.colors[id(run)]
        first = color not in self.labelled
        self.labelled.add(color)
        label = self.names[id(run)] + ("*" if run.init_global else "")
        return {"label": label if first else None, "lw": 1.4, "color": color,
                "ls": "--" if run.init_global else "-", "marker": "o" if points <= 30 else None,
                "ms": 3}

    def label_once(self, run: Run, kind: str) -> str | None:
        """The run's label the first time its group appears in a `kind` of curve, else None."""
        key = (kind, self.colors[id(run)])
        if key in self.labelled:
            return None
        self.labelled.add(key)
        return self.names[id(run)]


def _seed_curve(runs: list[Run], name: str) -> tuple[list[int], list[float], list[float],
                                                     list[float], list[float]] | None:
    """Per evaluated round (those every run evaluated): the mean, sd, min and max of the
    accuracy `name` (G, P, L) over the runs, in %."""
    per_run = [{r.round: 100 * a for r in run.train_rows
                if (a := r.accuracies()[name]) is not None} for run in runs]
    xs = sorted(set.intersection(*(set(p) for p in per_run)))
    if not xs:
        return None
    vals = [[p[x] for p in per_run] for x in xs]
    sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]
    return (xs, [statistics.fmean(v) for v in vals], sd, [min(v) for v in vals],
            [max(v) for v in vals])


def _accuracy_figure(plt: Any, runs: list[Run], pal: _Palette) -> Any:
    """accuracy.png: G, P and L per round, a group's seeds as mean, ± sd and min-max."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, name, title in zip(axes, ("G", "P", "L"),
                               ("global model", "personalized (after aggregation)",
                                "local model (FedReG testbed)"), strict=True):
        for group in pal.groups:
            star = name == "G" and group.init_global
            label = plot_label(group.legend) + ("*" if star else "")
            curve = _seed_curve(group.runs, name)
            if not curve:
                continue
            xs, mean, sd, lo, hi = curve
            color = pal.colors[id(group.runs[0])]
            ax.plot(xs, mean, label=label, lw=1.4, ls="--" if star else "-", color=color,
                    marker="o" if len(xs) <= 30 else None, ms=3)
            if len(group.runs) > 1:
                ax.fill_between(xs, [m - d for m, d in zip(mean, sd, strict=True)],
                                [m + d for m, d in zip(mean, sd, strict=True)], color=color,
                                alpha=0.25, lw=0)
                ax.fill_between(xs, lo, hi, color=color, alpha=0.1, lw=0)
            ends = [r.rows[-1] for r in group.runs]
            tuned = [100 * a for e in ends
                     if e.phase == "finetune" and (a := e.accuracies()[name]) is not None]
            if name != "G" and len(tuned) == len(group.runs):
                ax.plot([ends[0].round], [statistics.fmean(tuned)], marker="*", ms=11,
                        color=color)
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    for ax in axes:
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("accuracy per round (several seeds: mean, ± sd dark, min-max light; star: after "
                 "fine-tuning; dashed, name*: global model with its head or base at init)",
                 fontsize=10)
    return fig


def _clients_figure(plt: Any, runs: list[Run], pal: _Palette) -> Any:
    """clients.png: the final per-client accuracy of each group (None if a run has no
    clients.csv)."""
    with_clients = [g for g in pal.groups if all(r.clients for r in g.runs)]
    if not with_clients:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(with_clients) + 2), 4.2))
    data = [[100 * float(c["accuracy"]) for r in g.runs for c in r.clients if c.get("accuracy")]
            for g in with_clients]
    ax.boxplot(data, showmeans=True)
    for i, ys in enumerate(data, 1):
        ax.scatter([i] * len(ys), ys, s=8, alpha=0.5)
    ax.set_xticks(range(1, len(data) + 1), [plot_label(g.legend) for g in with_clients],
                  rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("final accuracy per client (%)")
    ax.set_title("per-client accuracy (personalized model, own test rows; all seeds pooled)")
    ax.grid(alpha=0.3, axis="y")
    return fig


def _cost_figure(plt: Any, runs: list[Run], pal: _Palette) -> Any:
    """cost.png: global accuracy against cumulative bytes moved and training FLOPs."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for run in runs:
        moved = flops = 0.0
        xb, xf, ys = [], [], []
        for r in run.train_rows:
            moved += r.bytes_down + r.bytes_up
            flops += r.train_flops
            if r.global_acc is not None:
                xb.append(moved / 1e6)
                xf.append(flops / 1e12)
                ys.append(100 * r.global_acc)
        style = pal.style(run, len(ys))
        axes[0].plot(xb, ys, **style)
        axes[1].plot(xf, ys, **style)
    axes[0].set_xlabel("cumulative MB moved (down + up)")
    axes[1].set_xlabel("cumulative training TFLOP (measured)")
    axes[0].set_ylabel("global accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    return fig


def _edge_figure(plt: Any, runs: list[Run], pal: _Palette) -> Any:
    """edge.png: global accuracy against cumulative wall time and against the devices' measured
    energy, and energy per round."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    measured = False
    for run in runs:
        wall = energy = 0.0
        xt, xe, yt, ye, per_round = [], [], [], [], []
        for r in run.train_rows:
            wall += r.seconds or 0.0
            if r.energy_j is not None:
                energy += r.energy_j
                per_round.append((r.round, r.energy_j))
            if r.global_acc is not None:
                xt.append(wall)
                yt.append(100 * r.global_acc)
                if per_round:
                    xe.append(energy / 1e3)
                    ye.append(100 * r.global_acc)
        style = pal.style(run, len(yt))
        axes[0].plot(xt, yt, **style)
        if per_round:
            measured = True
            axes[1].plot(xe, ye, **style)
            axes[2].plot(*zip(*per_round, strict=True), lw=1.2, color=pal.colors[id(run)],
                         label=pal.label_once(run, "energy"))
    axes[0].set_xlabel("cumulative wall time (s)")
    axes[0].set_ylabel("global accuracy (%)")
    axes[1].set_xlabel("cumulative energy on the devices (kJ)")
    axes[1].set_ylabel("global accuracy (%)")
    axes[2].set_xlabel("round")
    axes[2].set_ylabel("energy per round, all devices (J)")
    if not measured:
        for ax in axes[1:]:
            ax.text(0.5, 0.5, "no energy measured\n(simulation, or devices without a power "
                    "sensor:\nfedseq-client doctor)", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig


def _seconds_figure(plt: Any, runs: list[Run], pal: _Palette) -> Any:
    """seconds.png: seconds per round."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        pts = [(r.round, r.seconds) for r in run.train_rows if r.seconds is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1.2, color=pal.colors[id(run)],
                    label=pal.label_once(run, "seconds"))
    ax.set_xlabel("round")
    ax.set_ylabel("seconds per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


FIGURES = {"accuracy.png": _accuracy_figure, "clients.png": _clients_figure,
           "cost.png": _cost_figure, "edge.png": _edge_figure, "seconds.png": _seconds_figure}


def write_figures(runs: list[Run], out: Path) -> list[Path]:
    """The figures (FIGURES) of the runs into `out`; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("the figures need matplotlib: pip install 'fedseq[report]' "
                          "(or pass --no-figures for the tables alone)") from exc
    written = []
    pal = _Palette.of(runs)
    for name, draw in FIGURES.items():
        pal.labelled.clear()
        fig = draw(plt, runs, pal)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written


def expand_sweeps(paths: list[Path], labels: list[str] | None) -> list[Path]:
    """A sweep's folder (fedseq-sim --seeds: seed-*/ run directories, no metrics.jsonl of its
    own) stands for its seeds' runs."""
    out: list[Path] = []
    for p in map(Path, paths):
        seeds = sorted(p.glob("seed-*/metrics.jsonl"), key=lambda m: _seed_number(m.parent))
        if not (p / "metrics.jsonl").exists() and seeds:
            if labels:
                raise ConfigError(f"{p} is a sweep of {len(seeds)} seeds: --label names single "
                                  "runs; drop --label (the sweep is labelled by its folder)")
            out += [m.parent for m in seeds]
        else:
            out.append(p)
    return out


def _seed_number(path: Path) -> int:
    tail = path.name.removeprefix("seed-")
    return int(tail) if tail.isdigit() else -1


def report(paths: list[Path], out: Path, paper: str | None = None, figures: bool = True,
           labels: list[str] | None = None) -> tuple[list[dict[str, Any]], list[Path]]:
    if not paths:
        raise ConfigError("give at least one run directory")
    if paper is not None and paper not in PAPERS:
        raise ConfigError(f"--paper {paper!r} is unknown; use one of {', '.join(PAPERS)}")
    if labels and len(labels) != len(paths):
        raise ConfigError(f"{len(labels)} --label for {len(paths)} run directories; give one each")
    paths = expand_sweeps(paths, labels)
    runs = [load_run(p, labels[i] if labels else None) for i, p in enumerate(paths)]
    names = [r.label for r in runs]
    if not labels and len(set(names)) < len(names):  # same folder names: add their parents
        for r in runs:
            r.label = f"{r.path.resolve().parent.name}/{r.path.name}"
    empty = [r.label for r in runs if not r.rows]
    if empty:
        raise ConfigError(f"run {empty[0]} has no rounds yet; leave it out or wait for a round")
    out.mkdir(parents=True, exist_ok=True)
    rows = write_tables(runs, out, paper)
    return rows, (write_figures(runs, out) if figures else [])
