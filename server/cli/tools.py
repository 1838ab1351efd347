"""`fedseq`: the researcher's tools around the runs: get the datasets, report on run directories.
(`fedseq-sim` runs an experiment, `fedseq-server` drives a fleet, `fedseq-client` is a device.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)

from fedseq.common.errors import FedseqError
from fedseq.server.cli.commands import EPILOG, VersionOpt

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, epilog=EPILOG)
data_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="Datasets: download (or copy from a folder with --from), verify, the "
                            "training rows' statistics, where they live.")
app.add_typer(data_app, name="data")


@app.callback()
def _tools_options(version: VersionOpt = False) -> None:
    """The tools' options (`--version`, as fedseq-sim and fedseq-server have it)."""

RootOpt = Annotated[Path | None, typer.Option(
    "--root", help="data root (default: $FEDSEQ_DATA, else ~/.local/share/fedseq/data)")]
DatasetsArg = Annotated[list[str], typer.Argument(
    help="mnist, fmnist, cifar10, cifar100, tiny-imagenet, emnist-letters (or another split: -digits, "
         "-balanced, -byclass, -bymerge, -mnist)")]


def _fail(exc: Exception) -> None:
    print(f"error: {exc}", file=sys.stderr)
    raise typer.Exit(2)


def _root(root: Path | None) -> Path:
    from fedseq.common.data.store import default_data_root

    return root if root is not None else default_data_root()


@data_app.command()
def download(
    datasets: DatasetsArg,
    root: RootOpt = None,
    from_: Annotated[Path | None, typer.Option(
        "--from", help="import the original files from this folder instead (offline labs)")] = None,
    mirror: Annotated[list[str] | None, typer.Option(
        help="base URL to try before the official mirrors, repeatable")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """Fetch datasets into the data root: official mirrors with fallbacks, resumed partial
    downloads, every file checked against its md5 (a corrupt file is refused, never kept)."""
    from fedseq.common.data import store

    target = _root(root)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), disable=quiet, transient=True)
    tasks: dict[str, TaskID] = {}

    def on_bytes(name: str, done: int, total: int) -> None:
        if name not in tasks:
            tasks[name] = progress.add_task(name, total=total)
        progress.update(tasks[name], completed=done)

    try:
        with progress:
            for name in datasets:
                if from_ is not None:
                    store.import_from(name, from_, target, log=progress.console.print)
                else:
                    mirrors = (*(mirror or []), *store.spec_of(name).mirrors)
                    store.download(name, target, mirrors, on_bytes, log=progress.console.print)
    except FedseqError as exc:
        _fail(exc)
    print(f"ok: {', '.join(datasets)} under {target}")


@data_app.command()
def verify(datasets: DatasetsArg, root: RootOpt = None) -> None:
    """Check that every file of the datasets is byte-identical to the original (md5); exit 1 if
    not, with what is wrong and how to fix it."""
    from fedseq.common.data import store

    target = _root(root)
    bad = False
    for name in datasets:
        try:
            problems = store.verify(target, name)
        except FedseqError as exc:
            _fail(exc)
        for p in problems:
            print(f"{name}: {p}; run: fedseq data download {name} --root {target}")
        bad |= bool(problems)
        if not problems:
            print(f"{name}: ok under {target}")
    if bad:
        raise typer.Exit(1)


@data_app.command()
def stats(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Experiment TOML file.")
                      ] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override: dotted.key=value (TOML value), repeatable.")] = None,
    devices_data: Annotated[Path | None, typer.Option(
        help="Data on the devices: the simulated devices' folders (as fedseq-sim's)")] = None,
) -> None:
    """Print data.normalize = "stats"' mean and std from the run's training rows (each channel's,
    or each tabular feature's), as keys of the config's data table (append them to a config
    whose last table is that one): every process of the run then normalizes with the same
    numbers."""
    import json

    from fedseq.common.config import load_config
    from fedseq.common.data.federated import training_stats
    from fedseq.server.cli.commands import with_devices_data

    try:
        cfg = load_config(config, with_devices_data(set_, devices_data))
        mean, std, rows, per = training_stats(cfg.data, cfg.seed_for("data"))
    except FedseqError as exc:
        _fail(exc)
    print(f"# [data] keys: per {per}, from the {rows} training rows of {cfg.data.dataset} over "
          f"{cfg.data.num_clients} clients\nnormalize = \"stats\"\nmean = {json.dumps(mean)}\n"
          f"std = {json.dumps(std)}")


@data_app.command()
def where() -> None:
    """Print the default data root (what every command uses unless told otherwise)."""
    print(_root(None))


@app.command("report")
def report_cmd(
    runs: Annotated[list[Path], typer.Argument(help="run directories (fedseq-sim/server --out)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for the figures and tables")
                   ] = Path("report"),
    paper: Annotated[str | None, typer.Option(
        help="print a paper's numbers beside ours: fedreg-table6, fedseq-table2-mnist")] = None,
    label: Annotated[list[str] | None, typer.Option(help="a name per run (default: its folder)")
                     ] = None,
    no_figures: Annotated[bool, typer.Option("--no-figures", help="tables only")] = False,
) -> None:
    """Figures (accuracy per round, per-client accuracy, bytes and FLOPs against accuracy,
    seconds per round) and a Markdown/CSV summary of one or more runs."""
    from fedseq.server.report import report
    from fedseq.server.report.tables import terminal_table

    try:
        rows, figures = report(runs, out, paper, not no_figures, label)
    except FedseqError as exc:
        _fail(exc)
    print(terminal_table(rows), end="")
    print(f"every column, with the notes: {out / 'summary.md'}; wrote {out / 'summary.csv'}"
          + "".join(f", {f}" for f in figures))


@app.command("fleet")
def fleet_cmd(
    run: Annotated[Path, typer.Argument(help="a deployment's run directory (fedseq-server --out)")],
    train_w: Annotated[float, typer.Option(
        help="training watts of a device that measured none")] = 0.0,
    idle_w: Annotated[float, typer.Option(help="idle watts of every device")] = 0.0,
    link: Annotated[str, typer.Option(
        help="every device's link (a --link profile; the rows do not say)")] = "wifi-good",
) -> None:
    """The deployment's devices as the config's fleet section for fedseq-sim: each device's
    measured training pace (GFLOP/s of its counted updates) as a custom profile, in the
    deployment's order."""
    from fedseq.server.report.load import load_run
    from fedseq.server.rounds.virtual_fleet import measured_fleet

    try:
        print(measured_fleet(load_run(run).train_rows, train_w, idle_w, link))
    except FedseqError as exc:
        _fail(exc)


@app.command("new")
def new_cmd(
    name: Annotated[str, typer.Argument(help="the package's name, e.g. labnet")],
    folder: Annotated[Path | None, typer.Option("--dir", help="where to write it (default: ./NAME)")] = None,
) -> None:
    """Write a pip-installable package of fedseq plugins, ready to edit: a model, a dataset and an
    algorithm (a server step and a client hook), a config.toml that runs them on the data root's
    Fashion-MNIST, a device-data.toml that runs them on data left on the devices, tests that
    pass with `python -m pytest` inside it, and a README."""
    from fedseq.server.cli.new_package import new_package

    dest = folder if folder is not None else Path(name)
    try:
        written = new_package(name, dest)
    except FedseqError as exc:
        _fail(exc)
    print(f"wrote {len(written)} files into {dest}: pip install -e '{dest}[test]', then "
          f"`python -m pytest -q` and `fedseq-sim --config config.toml` inside it")


@app.command("plugins")
def plugins_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON list instead of a table")] = False,
) -> None:
    """Every registered name (models, datasets, algorithms, aggregation rules) with the installed
    distribution and version that provides it: fedseq's built-ins and every plugin package's
    entry points (groups fedseq.models, fedseq.datasets, fedseq.algorithms, fedseq.aggregators)."""
    import json

    from fedseq.common.registry import plugin_table

    try:
        rows = plugin_table()
    except FedseqError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    from fedseq.common.text import printable

    width = max(len(r["name"]) for r in rows)
    group = None
    for r in rows:
        if r["group"] != group:
            group = r["group"]
            print(f"{group}:")
        print(f"  {printable(r['name'], 64):<{width}}  {printable(r['distribution'], 64)} "
              f"{printable(r['version'], 32)}  {printable(r['value'], 120)}")


export_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Export run directories to an experiment tracker.")
app.add_typer(export_app, name="export")


@export_app.command("tensorboard")
def export_tensorboard_cmd(
    runs: Annotated[list[Path], typer.Argument(help="run directories or sweep folders")],
    out: Annotated[Path, typer.Option("--out", "-o", help="TensorBoard log directory")
                   ] = Path("tensorboard"),
) -> None:
    """TensorBoard event files of simulated or deployed runs (one folder per run; a sweep's
    seeds side by side); run it again to follow a running experiment. Then:
    tensorboard --logdir OUT"""
    from fedseq.server.ops.track import export_tensorboard

    try:
        written = export_tensorboard(runs, out)
    except FedseqError as exc:
        _fail(exc)
    print(f"wrote {len(written)} runs to {out}: " + ", ".join(written)
          + f"\nview them with: tensorboard --logdir {out}")


@export_app.command("mlflow")
def export_mlflow_cmd(
    runs: Annotated[list[Path], typer.Argument(help="run directories or sweep folders")],
    tracking_uri: Annotated[str, typer.Option(
        "--tracking-uri", envvar="MLFLOW_TRACKING_URI",
        help="the MLflow tracking server, e.g. http://mlflow.lab:5000 (or MLFLOW_TRACKING_URI)")],
    experiment: Annotated[str, typer.Option("--experiment", help="MLflow experiment name")
                          ] = "fedseq",
) -> None:
    """One MLflow run per run directory (a sweep's seeds as <sweep>/seed-<s>): every round's
    accuracies, bytes, FLOPs, seconds and energy as metrics, the config as params and as
    config.toml; run it again to follow a running experiment (it replaces its earlier export)."""
    from fedseq.server.ops.track import export_mlflow

    try:
        written = export_mlflow(runs, tracking_uri, experiment)
    except FedseqError as exc:
        _fail(exc)
    print(f"wrote {len(written)} runs to MLflow experiment {experiment!r} at {tracking_uri}: "
          + ", ".join(written))


def main() -> None:
    """fedseq's command line: data, fleet, report, export, new, plugins."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
