"""Summaries of runs: one table row per run (`summarize`), per group of seeds
(`summarize_group`), and every run paired with the first seed by seed (`paired_rows`)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedseq.common.config import SEED_STREAMS
from fedseq.server.report.load import ACCURACIES, LAST, Run
from fedseq.server.rounds.records import RoundRecord
from fedseq.server.rounds.seeds import defining


def _values(rows: list[RoundRecord], name: str) -> list[float]:
    """The accuracy `name` (G, F, P, L, Lr) of the rows that have it."""
    return [a for r in rows if (a := r.accuracies()[name]) is not None]


def _model_label(model: dict[str, Any]) -> str:
    """The model's name, and its normalization where it is not the default (model.norm):
    runs that differ only in it must not read as the same model."""
    norm = model.get("norm", "batch")
    return str(model.get("name", "?")) + ("" if norm == "batch" else f" ({norm})")


def _wire_label(wire: dict[str, Any]) -> str | None:
    """The wire codecs, up/down ("int8/fp16", "topk 0.01/none"); None for float32 both ways."""
    up, down = wire.get("up", "none"), wire.get("down", "none")
    if up == "none" and down == "none":
        return None
    up_label = f"topk {wire.get('topk', 0.01):g}" if up == "topk" else up
    if up == "int8" and wire.get("int8_rounding") == "stochastic":
        up_label += " stochastic"
    return f"{up_label}/{down}"


#: what the global model is, where it is not a trained whole model and not an initial head or
#: base kept (the rows' global_model note says it in full)
GLOBAL_LABELS = {"gpfl": "GCE classifier"}


@dataclass(frozen=True)
class Accuracy:
    """One accuracy of a run (%): its final value, its best, and its mean over the last LAST
    training rounds (None where the run never measured it)."""

    final: float | None
    best: float | None
    last: float | None


@dataclass(frozen=True)
class RunSummary:
    """A run summarized, typed: what it is, its accuracies (G, F, P, L, Lr in %), the per-client
    spread of its final personalized accuracy, and its costs. `row()` is its table row."""

    run: str
    algorithm: str
    #: the aggregation rule with its options, "median" or "labmomentum(beta=0.9)" ("mean" for runs
    #: before it was recorded)
    rule: str
    dataset: str
    model: str
    wire: str | None  # the wire codecs, up/down (None: float32 both ways)
    rounds: int  # training rounds done
    of: int  # training rounds configured
    finetuned: bool
    state: str
    device: str | None  # "cpu" or the GPU's name (runs made before 2026-11 say nothing)
    accuracy: dict[str, Accuracy]  # by ACCURACIES' names
    client_mean: float | None  # FedBABU's form: each client counts once, whatever its test size
    client_sd: float | None
    worst10: float | None  # mean of the worst tenth of the clients
    init_global: bool  # the global model is not the algorithm's trained whole model
    mb_moved: float
    train_tflop: float
    wall_s: float
    energy_kj: float | None  # measured on the devices (deployments with a sensor)
    j_per_round: float | None
    finetune_kj: float | None
    #: every numeric field of the rows without a column of its own (RoundRecord.picked_up), by
    #: "<field> (<how>)": its sum, mean or max over the rows that set it (None: none did)
    metrics: dict[str, float | None]

    def row(self) -> dict[str, Any]:
        """The table row: summary.md's and summary.csv's columns by their display names."""
        # another rule is another method: its name beside the algorithm's (never a paper's row)
        shown = self.algorithm if self.rule == "mean" else f"{self.algorithm}+{self.rule}"
        out: dict[str, Any] = {"run": self.run, "algorithm": shown,
                               "dataset": self.dataset, "model": self.model, "wire": self.wire,
                               "rounds": self.rounds, "of": self.of, "finetuned": self.finetuned,
                               "state": self.state, "device": self.device}
        for name in ACCURACIES:
            a = self.accuracy[name]
            out.update({f"{name} final": a.final, f"{name} best": a.best,
                        f"{name} last{LAST}": a.last})
        out.update({"client mean": self.client_mean, "client sd": self.client_sd,
                    "worst 10%": self.worst10,
                    "global model": (GLOBAL_LABELS.get(self.algorithm, "init head/base")
                                     if self.init_global else "trained"),
                    "MB moved": self.mb_moved, "train TFLOP": self.train_tflop,
                    "wall s": self.wall_s, "energy kJ": self.energy_kj,
                    "J/round": self.j_per_round, "finetune kJ": self.finetune_kj})
        out.update(self.metrics)
        return out


def _rule_label(agg: dict[str, Any]) -> str:
    """aggregation.rule, with its [aggregation.options] where it has any."""
    options = agg.get("options") or {}
    said = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return str(agg.get("rule", "mean")) + (f"({said})" if said else "")


def summarize(run: Run) -> RunSummary:
    """A run's final, best and last-10-rounds G, F, P, L and Lr (%), the per-client spread of the
    final personalized accuracy, rounds, bytes, FLOPs, time, energy."""
    train = run.train_rows
    last = run.rows[-1] if run.rows else None
    accuracy = {}
    for name in ACCURACIES:
        vals = _values(run.rows, name)
        tail = _values(train, name)[-LAST:]
        accuracy[name] = Accuracy(round(100 * vals[-1], 2) if vals else None,
                                  round(100 * max(vals), 2) if vals else None,
                                  round(100 * sum(tail) / len(tail), 2) if tail else None)
    accs = sorted(100 * float(c["accuracy"]) for c in run.clients if c.get("accuracy"))
    worst = accs[: max(1, math.ceil(0.1 * len(accs)))]
    joules = [r.energy_j for r in train if r.energy_j is not None]
    tuned = [r.energy_j for r in run.rows if r.phase == "finetune" and r.energy_j is not None]
    return RunSummary(
        run=run.label, algorithm=run.algorithm,
        rule=_rule_label(run.config.get("aggregation", {})),
        dataset=run.config.get("data", {}).get("dataset", "?"),
        model=_model_label(run.config.get("model", {})),
        wire=_wire_label(run.config.get("wire", {})),
        rounds=len(train), of=run.config.get("rounds", len(train)),
        finetuned=last is not None and last.phase == "finetune",
        state=run.status.get("state", "?"), device=run.status.get("device"),
        accuracy=accuracy,
        # the mean over clients ± the sd over clients, beside P's pooled sum-correct / sum-total
        client_mean=round(statistics.fmean(accs), 2) if accs else None,
        client_sd=round(statistics.pstdev(accs), 2) if accs else None,
        worst10=round(sum(worst) / len(worst), 2) if accs else None,
        init_global=run.init_global,
        mb_moved=round(sum(r.bytes_down + r.bytes_up for r in train) / 1e6, 1),
        train_tflop=round(sum(r.train_flops for r in run.rows) / 1e12, 2),
        wall_s=round(sum(r.seconds or 0 for r in run.rows), 1),
        energy_kj=round(sum(joules) / 1e3, 3) if joules else None,
        j_per_round=round(sum(joules) / len(joules), 1) if joules else None,
        finetune_kj=round(sum(tuned) / 1e3, 3) if tuned else None,
        metrics=picked_up(run.rows),
    )


def picked_up(rows: list[RoundRecord]) -> dict[str, float | None]:
    """Each of RoundRecord.picked_up's fields summarized over the rows that set it."""
    how: dict[str, Callable[[list[float]], float]] = {"sum": sum, "mean": statistics.fmean,
                                                      "max": max}
    out: dict[str, float | None] = {}
    for name, kind in RoundRecord.picked_up().items():
        vals = [v for r in rows if name in r.model_fields_set and (v := getattr(r, name)) is not None]
        out[f"{name} ({kind})"] = round(how[kind](vals), 3) if vals else None
    return out


# -- seeds: runs of one config that differ only by seed ------------------------------------


def _seed_of(run: Run, stream: str) -> Any:
    """The seed of one of the run's random streams; None for the noise of a run without
    [privacy] (it draws none)."""
    if stream == "noise" and not run.config.get("privacy", {}).get("enabled"):
        return None
    pinned = run.config.get("seeds", {}).get(stream)
    if stream == "noise" and pinned is None:
        return "secret"  # a fresh secret of each run (its checkpoint holds it)
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
        """The seeds of the group's runs, in order."""
        return [r.config.get("seed") for r in self.runs]

    @property
    def legend(self) -> str:
        """The group's label, with its number of seeds where there are several."""
        return self.label + (f" ({len(self.runs)} seeds)" if len(self.runs) > 1 else "")

    @property
    def init_global(self) -> bool:
        """Whether a run of the group starts clients from the global model."""
        return any(r.init_global for r in self.runs)


def _seeds_key(run: Run) -> tuple[Any, ...]:
    return tuple(_seed_of(run, s) for s in SEED_STREAMS)


def group_runs(runs: list[Run]) -> list[Group]:
    """Group runs whose configs differ only by seed, in order of first appearance. A group of
    several is labelled by its runs' common parent folder (a sweep's OUT) or the first run. Never
    merged: runs of the same seeds (a simulation and a deployment of one config, say: each is
    its own group, named by its folder), and runs given different --labels."""
    groups: list[tuple[str, list[Run]]] = []
    for run in runs:
        key = _group_key(run) + (f"\0{run.label}" if run.labelled else "")
        seeds = _seeds_key(run)
        home = next((members for k, members in groups if k == key
                     and all(_seeds_key(r) != seeds for r in members)), None)
        if home is None:
            groups.append((key, [run]))
        else:
            home.append(run)
    out = []
    for _, members in groups:
        label = members[0].label
        if len(members) > 1:
            parents = {r.path.resolve().parent for r in members}
            label = parents.pop().name if len(parents) == 1 else f"{label} (+{len(members) - 1})"
        out.append(Group(label, members))
    seen = [g.label for g in out]
    for g in out:  # one algorithm under two settings of a campaign: name the setting too
        parent = g.runs[0].path.resolve().parent
        if seen.count(g.label) > 1 and g.label == parent.name:
            g.label = f"{parent.parent.name}/{g.label}"
    return out


def summarize_group(group: Group) -> dict[str, Any]:
    """One table row for a group: for every number of `summarize`, the mean over the seeds (in
    the metric's own column) and its sd, min and max (sample sd; none for a single run)."""
    rows = [summarize(r).row() for r in group.runs]
    first = rows[0]
    out: dict[str, Any] = {"run": group.label, "algorithm": first["algorithm"],
                           "dataset": first["dataset"], "model": first["model"],
                           "wire": first["wire"],
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
PAIRED = ("G best", "G final", "F best", "P final", "L best", "Lr best")


def _seed_key(run: Run) -> tuple[Any, ...]:
    return tuple(_seed_of(run, s) for s in SEED_STREAMS)


def paired_rows(groups: list[Group]) -> list[dict[str, Any]]:
    """Every other group against the first, seed by seed. Runs of the same seeds share the
    data partition, the client selection and the initial weights, so the per-seed difference
    is free of what the seeds change in both, which a difference of means over seeds is not.
    Per metric: the mean and sd of the differences (points) and in how many seeds the
    difference has the mean's sign. Finished runs only; a group needs two seeds in common."""
    ref, *others = groups
    done = {_seed_key(r): summarize(r).row() for r in ref.runs
            if r.status.get("state") == "finished"}
    out = []
    for group in others:
        pairs = [(done[_seed_key(r)], summarize(r).row()) for r in group.runs
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
