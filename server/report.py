"""`fedseq report RUN_DIR...`: figures and a summary table from run directories.

Reads each run's metrics.jsonl, clients.csv, config.toml and status.json; writes PNG figures
(matplotlib, the `report` extra) and summary.md / summary.csv, optionally beside a paper's table.
Figures: accuracy.png (global, personalized and the testbed's local-model accuracy per round, all
runs on one axis each), clients.png (per-client accuracy distribution), cost.png (cumulative bytes
and training FLOPs against global accuracy), edge.png (global accuracy against cumulative wall
time and against the energy the devices measured, and energy per round), seconds.png (seconds per
round). The table adds the devices' energy (kJ in total, J per round) where it was measured.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedseq.common.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Published numbers (%), keyed by our algorithm names. FedReG Table 6: its Jetson testbed
# (FMNIST, 30 clients, Dir(0.1), join 0.2, ConvNet; best global / best average client accuracy
# over 100 rounds, mean of runs). FedSeq Table 2, MNIST column: accuracy at T = 100/200/300
# (FedBABU and FedSeq after fine-tuning).
PAPERS: dict[str, dict[str, Any]] = {
    "fedreg-table6": {
        "title": "FedReG Table 6 (testbed, FMNIST)",
        "columns": ("G", "P"),
        "rows": {"fedavg": (82.13, 98.05), "fedprox": (81.18, 98.05), "fedper": (72.27, 98.29),
                 "fedrep": (59.75, 97.88), "fedbabu": (78.73, 97.76), "fedrod": (83.96, 98.01),
                 "fedreg": (86.12, 98.25)},
    },
    "fedseq-table2-mnist": {
        "title": "FedSeq Table 2 (MNIST)",
        "columns": ("T=100", "T=200", "T=300"),
        "rows": {"fedavg": (91.48, 96.32, 97.48), "fedper": (98.30, 98.63, 98.69),
                 "lg-fedavg": (97.95, 98.17, 98.13), "fedrep": (98.56, 98.69, 98.75),
                 "fedrod": (98.61, 98.95, 99.06), "fedbabu": (98.19, 98.77, 98.84),
                 "fedseq-vanilla": (98.21, 98.84, 98.99), "fedseq-anti": (98.34, 98.81, 98.96)},
    },
}


@dataclass
class Run:
    path: Path
    label: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    clients: list[dict[str, str]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def algorithm(self) -> str:
        return str(self.config.get("algorithm", {}).get("name", "?"))

    @property
    def init_global(self) -> bool:
        """The global model keeps an untrained head or base (FedBABU, FedSeq, FedPer, ...)."""
        return any(r.get("global_model") for r in self.rows)

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("phase") == "train"]


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
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{metrics}:{n}: not JSON ({exc}); the file is damaged") from exc
    config = {}
    if (path / "config.toml").exists():
        config = tomllib.loads((path / "config.toml").read_text())
    clients = []
    if (path / "clients.csv").exists():
        with (path / "clients.csv").open() as f:
            clients = list(csv.DictReader(f))
    status = json.loads((path / "status.json").read_text()) if (path / "status.json").exists() else {}
    return Run(path, label or path.name, config, rows, clients, status)


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]


def summarize(run: Run) -> dict[str, Any]:
    """One table row: final and best G, P and local accuracy (%), rounds, bytes, FLOPs, time."""
    train = run.train_rows
    last = run.rows[-1] if run.rows else {}
    out: dict[str, Any] = {"run": run.label, "algorithm": run.algorithm,
                           "dataset": run.config.get("data", {}).get("dataset", "?"),
                           "model": run.config.get("model", {}).get("name", "?"),
                           "rounds": len(train),
                           "of": run.config.get("rounds", len(train)),
                           "finetuned": last.get("phase") == "finetune",
                           "state": run.status.get("state", "?")}
    for key, name in (("global_acc", "G"), ("personal_acc", "P"), ("local_acc", "L")):
        vals = _values(run.rows, key)
        out[f"{name} final"] = round(100 * vals[-1], 2) if vals else None
        out[f"{name} best"] = round(100 * max(vals), 2) if vals else None
    out["global model"] = "init head/base" if run.init_global else "trained"
    out["MB moved"] = round(sum(r.get("bytes_down", 0) + r.get("bytes_up", 0) for r in train) / 1e6, 1)
    out["train TFLOP"] = round(sum(r.get("train_flops", 0) for r in train) / 1e12, 2)
    out["wall s"] = round(sum(r.get("seconds", 0) for r in run.rows), 1)
    joules = _values(train, "energy_j")  # measured on the devices (deployments with a sensor)
    out["energy kJ"] = round(sum(joules) / 1e3, 3) if joules else None
    out["J/round"] = round(sum(joules) / len(joules), 1) if joules else None
    tuned = _values([r for r in run.rows if r.get("phase") == "finetune"], "energy_j")
    out["finetune kJ"] = round(sum(tuned) / 1e3, 3) if tuned else None
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def write_tables(runs: list[Run], out: Path, paper: str | None = None) -> list[dict[str, Any]]:
    rows = [summarize(r) for r in runs]
    ref = PAPERS[paper] if paper else None
    if ref is not None:
        for row in rows:
            published = ref["rows"].get(row["algorithm"])
            for i, col in enumerate(ref["columns"]):
                row[f"paper {col}"] = published[i] if published else None
    keys = list(rows[0])
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in keys) + " |" for r in rows]
    notes = [
        "",
        "G: global model on all clients' test rows; P: each client's personalized model after "
        "aggregation (after fine-tuning for FedBABU/FedSeq); L: each client's most recent locally "
        "trained model (FedReG's testbed definition). final = last evaluated row, best = best "
        "evaluated round (what FedReG reports). Accuracies in %.",
    ]
    if ref is not None:
        notes.append(f"paper columns: {ref['title']}.")
    (out / "summary.md").write_text("\n".join(lines + notes) + "\n")
    return rows


def _style(run: Run, points: int) -> dict[str, Any]:
    """A run's line against global accuracy: dashed and starred where the global model keeps an
    untrained head or base, markers while there are few points."""
    return {"label": run.label + ("*" if run.init_global else ""), "lw": 1.4,
            "ls": "--" if run.init_global else "-", "marker": "o" if points <= 30 else None,
            "ms": 3}


def write_figures(runs: list[Run], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("the figures need matplotlib: pip install 'fedseq[report]' "
                          "(or pass --no-figures for the tables alone)") from exc
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, key, title in zip(axes, ("global_acc", "personal_acc", "local_acc"),
                              ("global model", "personalized (after aggregation)",
                               "local model (FedReG testbed)"), strict=True):
        for run in runs:
            pts = [(r["round"], 100 * r[key]) for r in run.train_rows if r.get(key) is not None]
            if pts:
                star = key == "global_acc" and run.init_global
                line, = ax.plot(*zip(*pts, strict=True), label=run.label + ("*" if star else ""),
                                lw=1.4, ls="--" if star else "-",
                                marker="o" if len(pts) <= 30 else None, ms=3)
                final = run.rows[-1]
                if key != "global_acc" and final.get("phase") == "finetune" and final.get(key) is not None:
                    ax.plot([final["round"]], [100 * final[key]], marker="*", ms=11,
                            color=line.get_color())
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    for ax in axes:
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("accuracy per round (star marker: after fine-tuning; dashed, name*: global model "
                 "with its head or base at init)", fontsize=10)
    save(fig, "accuracy.png")

    with_clients = [r for r in runs if r.clients]
    if with_clients:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(with_clients) + 2), 4.2))
        data = [[100 * float(c["accuracy"]) for c in r.clients if c.get("accuracy")]
                for r in with_clients]
        ax.boxplot(data, showmeans=True)
        for i, ys in enumerate(data, 1):
            ax.scatter([i] * len(ys), ys, s=8, alpha=0.5)
        ax.set_xticks(range(1, len(data) + 1), [r.label for r in with_clients], rotation=30,
                      ha="right", fontsize=8)
        ax.set_ylabel("final accuracy per client (%)")
        ax.set_title("per-client accuracy (personalized model, own test rows)")
        ax.grid(alpha=0.3, axis="y")
        save(fig, "clients.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for run in runs:
        moved = flops = 0.0
        xb, xf, ys = [], [], []
        for r in run.train_rows:
            moved += r.get("bytes_down", 0) + r.get("bytes_up", 0)
            flops += r.get("train_flops", 0)
            if r.get("global_acc") is not None:
                xb.append(moved / 1e6)
                xf.append(flops / 1e12)
                ys.append(100 * r["global_acc"])
        style = _style(run, len(ys))
        axes[0].plot(xb, ys, **style)
        axes[1].plot(xf, ys, **style)
    axes[0].set_xlabel("cumulative MB moved (down + up)")
    axes[1].set_xlabel("cumulative training TFLOP (measured)")
    axes[0].set_ylabel("global accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    save(fig, "cost.png")

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    measured = False
    for run in runs:
        wall = energy = 0.0
        xt, xe, yt, ye, per_round = [], [], [], [], []
        for r in run.train_rows:
            wall += r.get("seconds", 0.0)
            if r.get("energy_j") is not None:
                energy += r["energy_j"]
                per_round.append((r["round"], r["energy_j"]))
            if r.get("global_acc") is not None:
                xt.append(wall)
                yt.append(100 * r["global_acc"])
                if per_round:
                    xe.append(energy / 1e3)
                    ye.append(100 * r["global_acc"])
        style = _style(run, len(yt))
        axes[0].plot(xt, yt, **style)
        if per_round:
            measured = True
            axes[1].plot(xe, ye, **style)
            axes[2].plot(*zip(*per_round, strict=True), label=run.label, lw=1.2)
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
    save(fig, "edge.png")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        pts = [(r["round"], r["seconds"]) for r in run.train_rows if "seconds" in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=run.label, lw=1.2)
    ax.set_xlabel("round")
    ax.set_ylabel("seconds per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "seconds.png")
    return written


def report(paths: list[Path], out: Path, paper: str | None = None, figures: bool = True,
           labels: list[str] | None = None) -> tuple[list[dict[str, Any]], list[Path]]:
    if not paths:
        raise ConfigError("give at least one run directory")
    if paper is not None and paper not in PAPERS:
        raise ConfigError(f"--paper {paper!r} is unknown; use one of {', '.join(PAPERS)}")
    if labels and len(labels) != len(paths):
        raise ConfigError(f"{len(labels)} --label for {len(paths)} run directories; give one each")
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
