"""Export runs to an experiment tracker: TensorBoard event files (the `track` extra) or an
MLflow tracking server (the `mlflow` extra).

One seam for simulation and deployment alike: both write the same run directory, and a
`Tracker` takes a run's config once and its metrics.jsonl rows one by one. `fedseq export
tensorboard|mlflow RUN_DIR...` replays them (after the run, or again while it goes on: it
replaces that run's earlier export, so the tracker follows a running experiment). Both log the
same scalars under the same names (`row_scalars`). Another tracker (W&B) is a class with the
same three methods. Nothing here runs on a device.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fedseq.common.errors import ConfigError
from fedseq.server.rounds.records import OWN_NAMES, RoundRecord

# accuracies (RoundRecord.accuracies' names) -> TensorBoard tags (in %, as the report shows them;
# tags of letters, digits and _ only, which TensorBoard keeps as written)
ACCURACY_TAGS = {"G": "accuracy/G_global", "F": "accuracy/F_federated",
                 "P": "accuracy/P_personalized", "L": "accuracy/L_local_all_clients",
                 "Lr": "accuracy/Lr_local_round_trainers"}


#: RoundRecord fields logged under names of their own below (or not at all: the step); every
#: other numeric field a row holds is logged as metrics/<field>, so a new field needs no change here
NAMED = OWN_NAMES | {"client_steps"}


def row_scalars(row: RoundRecord, totals: dict[str, float]) -> tuple[int, dict[str, float]]:
    """One metrics.jsonl row as (step, {name: value}): the round is the step; the fine-tuning
    row is logged at step = rounds as accuracy/P_after_finetuning; cumulative MB and TFLOP
    beside the per-round values (`totals` carries the sums from row to row); every other
    numeric field as metrics/<field>."""
    out: dict[str, float] = {}
    for name in type(row).model_fields:
        value = getattr(row, name)
        if name not in NAMED and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"metrics/{name}"] = value
    if row.phase == "finetune":
        if row.personal_acc is not None:
            out["accuracy/P_after_finetuning"] = 100 * row.personal_acc
        if row.global_acc is not None:
            out["accuracy/G_global"] = 100 * row.global_acc
        if row.train_flops:
            out["cost/finetune_flops"] = row.train_flops
        return row.round, out
    for name, acc in row.accuracies().items():
        if acc is not None:
            out[ACCURACY_TAGS[name]] = 100 * acc
    costs = {"cost/bytes_down": row.bytes_down, "cost/bytes_up": row.bytes_up,
             "cost/train_flops": row.train_flops, "cost/client_steps": row.client_steps,
             "time/seconds": row.seconds, "energy/joules_devices": row.energy_j}
    out.update({tag: v for tag, v in costs.items() if v is not None})
    totals["moved"] = totals.get("moved", 0.0) + row.bytes_down + row.bytes_up
    totals["flops"] = totals.get("flops", 0.0) + row.train_flops
    out["cost/cumulative_MB"] = totals["moved"] / 1e6
    out["cost/cumulative_TFLOP"] = totals["flops"] / 1e12
    out["clients/reported"] = len(row.reported)
    out["clients/missing_or_rejected"] = len(row.failed) + len(row.rejected)
    return row.round, out


class Tracker(Protocol):
    """An experiment tracker a run's rows are exported to (TensorBoard, MLflow; `fedseq export`):
    a new one implements these three and an `export_...` function that `replay`s runs into it."""

    def log_config(self, config_toml: str, config: dict[str, Any], info: dict[str, Any]) -> None:
        """Once at the start: the run's config (as TOML and as a dict) and what it ran on."""
        ...

    def log_row(self, row: RoundRecord) -> None:
        """Every row of metrics.jsonl, as it is written."""
        ...

    def close(self) -> None:
        """At the end of the run (also when it fails): flush and release."""
        ...


class TensorBoard(Tracker):
    """Event files under `logdir` (one folder per run: TensorBoard overlays the runs, the seeds
    of a sweep as seed-<s> beside each other), the scalars of `row_scalars`."""

    def __init__(self, logdir: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise ConfigError("TensorBoard export needs tensorboardX: pip install "
                              "'fedseq[track]' (the coordinator's side only)") from exc
        self.writer = SummaryWriter(logdir=str(logdir), flush_secs=10)
        self.totals: dict[str, float] = {}

    def log_config(self, config_toml: str, config: dict[str, Any], info: dict[str, Any]) -> None:
        lines = "\n".join(f"    {line}" for line in config_toml.splitlines())  # Markdown code
        facts = "\n".join(f"- {k}: {v}" for k, v in info.items())
        self.writer.add_text("run/config.toml", lines, 0)
        if facts:
            self.writer.add_text("run/info", facts, 0)

    def log_row(self, row: RoundRecord) -> None:
        step, scalars = row_scalars(row, self.totals)
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def run_name(path: Path) -> str:
    """A run's name in a tracker: its folder, a sweep's seeds as <sweep>/seed-<s> (of the resolved
    path: `.` and `..` name the folder they stand for)."""
    path = path.resolve()
    return f"{path.parent.name}/{path.name}" if path.name.startswith("seed-") else path.name


def replay(paths: list[Path], open_tracker: Callable[[Path, str], Tracker]) -> list[str]:
    """Every run (a sweep's folder stands for its seeds) into the tracker `open_tracker(path,
    name)` makes for it: the config, then its metrics.jsonl rows. Returns the names."""
    from fedseq.server.report import expand_sweeps, load_run

    names = []
    for path in expand_sweeps(paths, None):
        run = load_run(path)
        name = run_name(path)
        tracker = open_tracker(path, name)
        config = (path / "config.toml").read_text() if (path / "config.toml").exists() else ""
        tracker.log_config(config, run.config, {"state": run.status.get("state", "?"),
                                                "command": run.status.get("command", "?")})
        for row in run.rows:
            tracker.log_row(row)
        tracker.close()
        names.append(name)
    return names


def export_tensorboard(paths: list[Path], logdir: Path) -> list[str]:
    """Write every run's events to logdir/<run name>/, replacing the event files an earlier
    export wrote there (and nothing else: no folder is removed, and a name that would lead
    outside logdir is refused). Returns the run names."""
    root = logdir.resolve()

    def open_tracker(path: Path, name: str) -> Tracker:
        target = (root / name).resolve()
        if not name or root not in target.parents:
            raise ConfigError(f"run {str(path)!r} would be exported to {str(target)!r}, outside "
                              f"{str(root)!r}; name the run's own folder")
        for old in target.glob("events.out.tfevents.*"):
            old.unlink()
        return TensorBoard(target)

    return replay(paths, open_tracker)


#: a run directory's state as an MLflow run status
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


class MLflow(Tracker):
    """One MLflow run per run directory in `experiment` (created if missing), tagged with the
    directory's path (fedseq.run_dir): an earlier export of the same directory is deleted
    first, so exporting again replaces it. The scalars of `row_scalars` are its metrics (steps
    = rounds), the config's settings its params ("train.lr"), config.toml an artifact, the run's
    state its status (a run still going stays RUNNING)."""

    def __init__(self, tracking_uri: str, experiment: str, path: Path, name: str):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError("MLflow export needs mlflow: pip install 'fedseq[mlflow]' (the "
                              "coordinator's side only)") from exc
        try:
            self.client = client = MlflowClient(tracking_uri)
            found = client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found is not None else client.create_experiment(experiment)
            where = str(path.resolve())
            for old in client.search_runs([exp_id], max_results=5000):
                if old.data.tags.get("fedseq.run_dir") == where:
                    client.delete_run(old.info.run_id)
            self.run_id = client.create_run(exp_id, run_name=name,
                                            tags={"fedseq.run_dir": where}).info.run_id
        except Exception as exc:  # MlflowException, a server that is not there, a bad URI
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"MLflow at {tracking_uri!r}: {first[:300]}") from exc
        self.totals: dict[str, float] = {}
        self.pending: list[Any] = []  # mlflow.entities.Metric, sent by close()
        self.state = "?"

    def log_config(self, config_toml: str, config: dict[str, Any], info: dict[str, Any]) -> None:
        params: dict[str, str] = {}

        def flatten(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    flatten(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                params[prefix] = str(value)[:500]

        flatten("", config)
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        if config_toml:
            self.client.log_text(self.run_id, config_toml, "config.toml")
        for k, v in info.items():
            self.client.set_tag(self.run_id, f"fedseq.{k}", str(v)[:5000])
        self.state = str(info.get("state", "?"))

    def log_row(self, row: RoundRecord) -> None:
        import time

        from mlflow.entities import Metric

        step, scalars = row_scalars(row, self.totals)
        now = int(time.time() * 1000)
        self.pending += [Metric(k, float(v), now, step) for k, v in scalars.items()]

    def close(self) -> None:
        # sent in batches at the end, not one request per round (MLflow: <= 1000 per batch)
        """Send the held metrics in batches and end the MLflow run with the run's state."""
        for i in range(0, len(self.pending), 1000):
            self.client.log_batch(self.run_id, metrics=self.pending[i:i + 1000])
        self.pending = []
        status = MLFLOW_STATUS.get(self.state)
        if status is not None:
            self.client.set_terminated(self.run_id, status)


def export_mlflow(paths: list[Path], tracking_uri: str, experiment: str) -> list[str]:
    """Every run into the MLflow experiment `experiment` at `tracking_uri` (an MLflow server's
    http(s) URL, or what else MLflow accepts), replacing earlier exports of the same run
    directories. Returns the run names."""
    return replay(paths, lambda path, name: MLflow(tracking_uri, experiment, path, name))
