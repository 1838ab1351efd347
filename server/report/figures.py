"""Figures (matplotlib, the `report` extra): accuracy.png, clients.png, cost.png, edge.png,
time.png and seconds.png, each run in its group of seeds' colour."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedseq.common.errors import ConfigError
from fedseq.common.text import plot_label
from fedseq.server.report.load import Run
from fedseq.server.report.summarize import Group, group_runs

#: matplotlib's tab20 colours, for more than ten groups
_TAB20 = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896",
          "#9467bd", "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7",
          "#bcbd22", "#dbdb8d", "#17becf", "#9edae5"]


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
        # matplotlib's ten colours, or its twenty (tab20) for more groups: no two groups share one
        # up to twenty (a campaign of twelve algorithms repeated two after ten)
        colors = [f"C{i}" for i in range(10)] if len(groups) <= 10 else _TAB20
        return cls(groups, {id(r): colors[i % len(colors)] for i, g in enumerate(groups)
                            for r in g.runs},
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
    """accuracy.png: G, P and L per round, a group's seeds as mean, ± sd and min-max; F (the
    global model scored on the devices, data.placement = "device") dotted beside G."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    federated = False
    panels = (("G", "G"), ("G", "F"), ("P", "P"), ("L", "L"))
    titles = {"G": "global model", "P": "personalized (after aggregation)",
              "L": "local model (FedReG testbed)"}
    for panel, name in panels:
        ax = axes["GPL".index(panel)]
        for group in pal.groups:
            star = name == "G" and group.init_global
            label = plot_label(group.legend) + ("*" if star else "") + \
                (" (F, on the devices)" if name == "F" else "")
            curve = _seed_curve(group.runs, name)
            if not curve:
                continue
            federated |= name == "F"
            xs, mean, sd, lo, hi = curve
            color = pal.colors[id(group.runs[0])]
            ax.plot(xs, mean, label=label, lw=1.4, color=color,
                    ls=":" if name == "F" else "--" if star else "-",
                    marker="o" if len(xs) <= 30 else None, ms=3)
            if len(group.runs) > 1:
                ax.fill_between(xs, [m - d for m, d in zip(mean, sd, strict=True)],
                                [m + d for m, d in zip(mean, sd, strict=True)], color=color,
                                alpha=0.25, lw=0)
                ax.fill_between(xs, lo, hi, color=color, alpha=0.1, lw=0)
            ends = [r.rows[-1] for r in group.runs]
            tuned = [100 * a for e in ends
                     if e.phase == "finetune" and (a := e.accuracies()[name]) is not None]
            if name in ("P", "L") and len(tuned) == len(group.runs):
                ax.plot([ends[0].round], [statistics.fmean(tuned)], marker="*", ms=11,
                        color=color)
        ax.set_title(titles[panel] + (" (dotted F: scored on the devices)"
                                      if panel == "G" and federated else ""))
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


def _time_figure(plt: Any, runs: list[Run], pal: _Palette) -> Any:
    """time.png: global accuracy against the simulated fleet's time and modelled energy ([fleet]:
    sync, over-selected and asynchronous runs on one axis of seconds, not of rounds)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    simulated = False
    for run in runs:
        energy = 0.0
        xt, xe, ys = [], [], []
        for r in run.train_rows:
            if r.virtual_time_s is None:
                continue
            energy += r.modelled_energy_j or 0.0
            if r.global_acc is not None:
                xt.append(r.virtual_time_s)
                xe.append(energy / 1e3)
                ys.append(100 * r.global_acc)
        if ys:
            simulated = True
            style = pal.style(run, len(ys))
            axes[0].plot(xt, ys, **style)
            axes[1].plot(xe, ys, **style)
    if not simulated:  # only what was measured: no simulated fleet, no figure
        plt.close(fig)
        return None
    axes[0].set_xlabel("simulated time (s)")
    axes[1].set_xlabel("modelled energy of the fleet (kJ)")
    axes[0].set_ylabel("global accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
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
           "cost.png": _cost_figure, "edge.png": _edge_figure, "time.png": _time_figure,
           "seconds.png": _seconds_figure}


def write_figures(runs: list[Run], out: Path) -> list[Path]:
    """The figures (FIGURES) of the runs into `out`; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("the figures need matplotlib: pip install 'fedseq[report]' "
                          "(or pass --no-figures for the tables alone)") from exc
    from matplotlib.ticker import MaxNLocator

    written = []
    pal = _Palette.of(runs)
    for name, draw in FIGURES.items():
        pal.labelled.clear()
        fig = draw(plt, runs, pal)
        if fig is None:
            continue
        for ax in fig.axes:  # rounds are whole numbers
            if ax.get_xlabel() == "round":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written
