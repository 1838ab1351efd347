"""`fedseq report RUN_DIR...`: figures and a summary table from run directories.

One module per job: load.py reads run directories, summarize.py makes the summaries, tables.py
writes the tables, figures.py draws the figures; `report` here runs them in turn.

Reads each run's metrics.jsonl, clients.csv, config.toml and status.json; writes PNG figures
(matplotlib, the `report` extra) and summary.md / summary.csv, optionally beside a paper's table,
and paired.csv (every other run or sweep against the first, seed by seed, also in summary.md).
Figures: accuracy.png (global, personalized and the testbed's local-model accuracy per round, all
runs on one axis each), clients.png (per-client accuracy distribution), cost.png (cumulative bytes
and training FLOPs against global accuracy), edge.png (global accuracy against cumulative wall
time and against the energy the devices measured, and energy per round), time.png (global
accuracy against the simulated fleet's time and modelled energy, [fleet]), seconds.png (seconds
per round). The table adds the devices' energy (kJ in total, J per round) where it was measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedseq.common.errors import ConfigError
from fedseq.server.report.figures import write_figures
from fedseq.server.report.load import Run, expand_sweeps, load_run
from fedseq.server.report.summarize import _model_label, summarize
from fedseq.server.report.tables import PAPERS, write_tables

__all__ = ["PAPERS", "Run", "_model_label", "expand_sweeps", "load_run", "report", "summarize",
           "write_figures", "write_tables"]


def report(paths: list[Path], out: Path, paper: str | None = None, figures: bool = True,
           labels: list[str] | None = None) -> tuple[list[dict[str, Any]], list[Path]]:
    """`fedseq report`: load the run directories (a sweep's folder expands to its runs), write
    summary.md, summary.csv and paired.csv to `out` (beside `paper`'s table if named) and, unless
    `figures` is False, the figures; the table's rows and the figures' paths."""
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
