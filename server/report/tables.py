"""Tables: summary.md and summary.csv (every run or group of seeds, beside a paper's table where
asked) and paired.csv."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from fedseq.common.text import csv_cell, markdown_cell
from fedseq.server.report.load import ACCURACIES, LAST, Run, divergence_note, splice_note
from fedseq.server.report.summarize import PAIRED, group_runs, paired_rows, summarize_group

# Published numbers (%), keyed by our algorithm names, and the metric of ours each column
# compares with. FedReG Table 6: its Jetson testbed (FMNIST, 30 clients, Dir(0.1), join 0.2,
# ConvNet; best global / best average client accuracy over 100 rounds, mean of five runs). Its
# "P" scores each client's locally trained model (section 5), which is our L (every client's
# latest local model, stale for clients not selected lately) or Lr (only the round's trainers'
# fresh local models): section 5 admits both readings, so both sit beside it. FedReG Table 2's
# FMNIST column (best G and best P over 100 rounds). FedSeq Table 2 of
# the arXiv version, Table 4 of the Appl. Sci. 2024 version (same numbers), MNIST column:
# accuracy at T = 100/200/300, FedBABU and FedSeq after fine-tuning: our P final.
PAPERS: dict[str, dict[str, Any]] = {
    "fedreg-table6": {
        "title": "FedReG Table 6 (testbed, FMNIST; mean of 5 runs)",
        # what the paper states of the setting its numbers come from (examples/papers/stated.toml)
        "setting": {"rounds": 100, "data.dataset": "fmnist", "data.partition": "dirichlet",
                    "data.alpha": 0.1, "data.fraction": 1.0, "data.num_clients": 30,
                    "model.name": "convnet", "train.join_ratio": 0.2,
                    "train.local_epochs": 5, "train.batch_size": 20, "train.lr": 0.01},
        "columns": ("G", "P"),
        "compare": {"G": ("G best",), "P": ("L best", "Lr best")},
        "rows": {"fedavg": (82.13, 98.05), "fedprox": (81.18, 98.05), "feddyn": (83.68, 97.75),
                 "ditto": (81.41, 97.65), "fedper": (72.27, 98.29),
                 "fedrep": (59.75, 97.88), "fedbabu": (78.73, 97.76), "gpfl": (48.30, 97.46),
                 "fedrod": (83.96, 98.01),
                 "fedreg": (86.12, 98.25)},
    },
    "fedreg-table2-fmnist": {
        "title": "FedReG Table 2, FMNIST (50 clients, Dir(0.1), join 0.2; mean of 5 runs)",
        "setting": {"rounds": 100, "data.dataset": "fmnist", "data.partition": "dirichlet",
                    "data.alpha": 0.1, "data.fraction": 1.0, "data.num_clients": 50,
                    "model.name": "convnet", "train.join_ratio": 0.2,
                    "train.local_epochs": 5, "train.batch_size": 20, "train.lr": 0.01},
        "columns": ("G", "P"),
        "compare": {"G": ("G best",), "P": ("P best",)},
        "rows": {"fedavg": (84.27, 84.27), "fedprox": (84.54, 84.54), "feddyn": (83.43, 83.43),
                 "ditto": (84.35, 96.53), "fedper": (74.55, 97.32), "fedrep": (61.41, 97.20),
                 "fedbabu": (80.49, 80.49), "gpfl": (53.97, 94.38), "fedrod": (85.49, 97.27),
                 "fedreg": (88.35, 97.52)},
    },
    "fedseq-table2-mnist": {
        "title": "FedSeq Table 2 (arXiv) = Table 4 (Appl. Sci. 2024), MNIST",
        "setting": {"data.dataset": "mnist", "data.partition": "dirichlet",
                    "data.alpha": 0.1, "data.fraction": 1.0, "data.num_clients": 100,
                    "model.name": "cnn", "train.join_ratio": 0.1,
                    "train.batch_size": 10, "train.lr": 0.005},
        "columns": ("T=100", "T=200", "T=300"),
        "compare": {"T=100": ("P final",), "T=200": ("P final",), "T=300": ("P final",)},
        "rows": {"fedavg": (91.48, 96.32, 97.48), "fedper": (98.30, 98.63, 98.69),
                 "lg-fedavg": (97.95, 98.17, 98.13), "fedrep": (98.56, 98.69, 98.75),
                 "fedrod": (98.61, 98.95, 99.06), "fedbabu": (98.19, 98.77, 98.84),
                 "fedseq-vanilla": (98.21, 98.84, 98.99), "fedseq-anti": (98.34, 98.81, 98.96)},
    },
}


_ACC_KEYS = {f"{n} {w}" for n in ACCURACIES for w in ("final", "best", f"last{LAST}")} \
    | {"client mean", "client sd", "worst 10%"}


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
MD_COLUMNS = ("run", "algorithm", "dataset", "model", "wire", "seeds", "varied", "rounds", "finetuned",
              "device", "G best", f"G last{LAST}", "G final", "F best", f"F last{LAST}", "F final",
              "P best", "P final", "L best", "L final", "Lr best", "client mean", "client sd",
              "worst 10%", "global model", "MB moved", "train TFLOP", "wall s", "energy kJ",
              "J/round", "finetune kJ")


#: what the terminal shows of summary.md (the rest, and the notes, are in the files)
TERMINAL_COLUMNS = ("run", "algorithm", "seeds", "rounds", "G best", "G final", "F best",
                    "P best", "P final")


def terminal_table(rows: list[dict[str, Any]]) -> str:
    """The report's rows as plain text that fits a terminal: the run, its algorithm, seeds and
    rounds, the best and final global and personalized accuracies (and a paper's columns where
    they were asked for), aligned in columns."""
    keys = [k for k in TERMINAL_COLUMNS if any(r.get(k) is not None for r in rows)]
    keys += [k for k in rows[0] if k.startswith("paper ")] if rows else []

    def text(row: dict[str, Any], key: str) -> str:
        if key == "rounds" and row["state"] != "finished":
            return f"{row['rounds']}/{row['of']} {row['state']}"
        sd = row.get(f"{key} sd")
        return _fmt(row.get(key)) + (f"±{sd:.2f}" if sd is not None and key in _ACC_KEYS else "")

    table = [keys] + [[text(r, k) for k in keys] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(keys))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in table) + "\n"


def setting_differences(runs: list[Run], ref: dict[str, Any]) -> list[str]:
    """Where the runs' configs differ from the setting the paper's numbers come from: "rounds
    2 (the paper: 100)", one entry per key, every value the runs used; FedSeq's T columns take
    the rounds of the column that matches."""
    out = []
    for key, stated in ref.get("setting", {}).items():
        used = []
        for run in runs:
            value: Any = run.config
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None and value != stated and value not in used:  # None: no such key
                used.append(value)
        if used:
            out.append(f"{key} {', '.join(map(str, used))} (the paper: {stated})")
    return out


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


def _md_cell(row: dict[str, Any], key: str) -> str:
    """One cell of summary.md."""
    if key == "rounds" and row["state"] != "finished":  # never a partial run read as whole
        return f"{row['rounds']} of {row['of']}, {row['state']}"
    sd = row.get(f"{key} sd")
    text = _fmt(row.get(key)) + (f" ± {sd:.2f}" if sd is not None and key in _ACC_KEYS else "")
    return markdown_cell(text, 400)  # run folders and device names are anyone's words


def _notes(rows: list[dict[str, Any]], shown: list[str], groups: list[Any], runs: list[Run],
           ref: dict[str, Any] | None, beside: dict[str, str]) -> list[str]:
    """summary.md's notes under its table: what the columns mean, and what to mind."""
    placed = [r.config.get("data", {}).get("placement") == "device" for r in runs]
    on = ("the coordinator's data.validation (data.placement = \"device\"; none without it)"
          if all(placed) else "all clients' test rows" + (
              " (data.placement = \"device\": on the coordinator's data.validation)"
              if any(placed) else ""))
    notes = [
        "",
        f"G: global model on {on}; P: each client's personalized model after "
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
    if "F best" in shown:
        notes.append("F (data.placement = \"device\"): the global model on each client's own "
                     "test rows, scored on the devices and pooled.")
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
        differs = setting_differences(runs, ref)
        if differs:
            notes.append("The paper's numbers come from its own setting, which these runs do not "
                         "share: " + "; ".join(differs) + ". Compare them as a reference, not "
                         "as a reproduction.")
    return notes


def write_tables(runs: list[Run], out: Path, paper: str | None = None) -> list[dict[str, Any]]:
    """summary.md, summary.csv and paired.csv in `out`, one row per run or group of seeds (beside
    `paper`'s table where named); the rows."""
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

    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_md_cell(r, k) for k in shown) + " |" for r in rows]
    notes = _notes(rows, shown, groups, runs, ref, beside)
    paired = paired_rows(groups)
    if paired:
        with (out / "paired.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in paired for k in r)))
            w.writeheader()
            w.writerows({k: csv_cell(v) for k, v in r.items()} for r in paired)
        notes += _paired_table(paired)
    (out / "summary.md").write_text("\n".join(lines + notes) + "\n")
    return rows
