"""Export runs to an experiment tracker: TensorBoard event files (the `track` extra).

One seam for simulation and deployment alike: both write the same run directory, and a
`Tracker` takes a run's config once and its metrics.jsonl rows one by one. `fedseq export
tensorboard RUN_DIR...` replays them (after the run, or again while it goes on: it rewrites that
run's events, so TensorBoard follows a running experiment). Another tracker (MLflow, W&B) is a
class with the same three methods. Nothing here runs on a device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from fedseq.common.errors import ConfigError

# metrics.jsonl keys -> TensorBoard tags (accuracies in %, as the report shows them; tags of
# letters, digits and _ only, which TensorBoard keeps as written)
ACCURACY_TAGS = {"global_acc": "accuracy/G_global", "personal_acc": "accuracy/P_personalized",
                 "local_acc": "accuracy/L_local_all_clients",
                 "round_local_acc": "accuracy/Lr_local_round_trainers"}
COST_TAGS = {"bytes_down": "cost/bytes_down", "bytes_up": "cost/bytes_up",
             "train_flops": "cost/train_flops", "seconds": "time/seconds",
             "energy_j": "energy/joules_devices"}


class Tracker(Protocol):
    def log_config(self, config_toml: str, info: dict[str, Any]) -> None: ...
    def log_row(self, row: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class TensorBoard:
    """Event files under `logdir` (one folder per run: TensorBoard overlays the runs, the seeds
    of a sweep as seed-<s> beside each other). Rounds are the steps; the fine-tuning row is
    logged at step = rounds as accuracy/P_after_finetuning; cumulative MB and TFLOP as well
    as per-round values."""

    def __init__(self, logdir: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise ConfigError("TensorBoard export needs tensorboardX: pip install "
                              "'fedseq[track]' (the coordinator's side only)") from exc
        self.writer = SummaryWriter(logdir=str(logdir), flush_secs=10)
        self.moved = 0.0
        self.flops = 0.0

    def log_config(self, config_toml: str, info: dict[str, Any]) -> None:
        lines = "\n".join(f"    {line}" for line in config_toml.splitlines())  # Markdown code
        facts = "\n".join(f"- {k}: {v}" for k, v in info.items())
        self.writer.add_text("run/config.toml", lines, 0)
        if facts:
            self.writer.add_text("run/info", facts, 0)

    def log_row(self, row: dict[str, Any]) -> None:
        step = int(row["round"])
        if row.get("phase") == "finetune":
            for key, tag in (("personal_acc", "accuracy/P_after_finetuning"),
                             ("global_acc", "accuracy/G_global")):
                if row.get(key) is not None:
                    self.writer.add_scalar(tag, 100 * row[key], step)
            if row.get("train_flops"):
                self.writer.add_scalar("cost/finetune_flops", row["train_flops"], step)
            return
        for key, tag in ACCURACY_TAGS.items():
            if row.get(key) is not None:
                self.writer.add_scalar(tag, 100 * row[key], step)
        for key, tag in COST_TAGS.items():
            if row.get(key) is not None:
                self.writer.add_scalar(tag, row[key], step)
        self.moved += row.get("bytes_down", 0) + row.get("bytes_up", 0)
        self.flops += row.get("train_flops", 0)
        self.writer.add_scalar("cost/cumulative_MB", self.moved / 1e6, step)
        self.writer.add_scalar("cost/cumulative_TFLOP", self.flops / 1e12, step)
        self.writer.add_scalar("clients/reported", len(row.get("reported", [])), step)
        self.writer.add_scalar("clients/missing_or_rejected",
                               len(row.get("failed", [])) + len(row.get("rejected", {})), step)

    def close(self) -> None:
        self.writer.close()


def export_tensorboard(paths: list[Path], logdir: Path) -> list[Path]:
    """Write every run's events to logdir/<run label>/ (a sweep's seeds: <sweep>/seed-<s>);
    replaces the events an earlier export wrote there. Returns the folders written."""
    import shutil

    from fedseq.server.report import expand_sweeps, load_run

    written = []
    for path in expand_sweeps(paths, None):
        run = load_run(path)
        name = f"{path.resolve().parent.name}/{path.name}" if path.name.startswith("seed-") \
            else path.name
        target = logdir / name
        if target.exists():
            shutil.rmtree(target)
        tb = TensorBoard(target)
        config = (path / "config.toml").read_text() if (path / "config.toml").exists() else ""
        tb.log_config(config, {"state": run.status.get("state", "?"),
                               "command": run.status.get("command", "?")})
        for row in run.rows:
            tb.log_row(row)
        tb.close()
        written.append(target)
    return written
