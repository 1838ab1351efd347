"""The run directory every run writes: config.toml, metrics.jsonl, clients.csv, model.safetensors."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import logging
import math
import os
import signal
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from fedseq.common.config import ExperimentConfig, dump_config, load_run_config
from fedseq.common.data.federated import FederatedData
from fedseq.common.errors import ConfigError
from fedseq.common.files import atomic_write
from fedseq.common.models import Weights
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.server.rounds.records import RoundRecord

log = logging.getLogger(__name__)


def resolved_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """The config with absolute file paths, so the run directory means the same from anywhere
    (and --resume works from another working directory)."""
    out = cfg.model_copy(deep=True)
    out.data.root = Path(out.data.root).resolve()
    d = out.deploy
    for key in ("password_file", "ca_file", "cert_file", "key_file", "broker_password_file"):
        value = getattr(d, key)
        if value is not None:
            setattr(d, key, Path(value).resolve())
    return out


def _rows(metrics: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) of every readable row; a torn line (a crash mid-write) is skipped with a
    warning: the checkpoint holds the last round's row and a resume writes it again."""
    out = []
    for ln in metrics.read_text().splitlines() if metrics.exists() else []:
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except ValueError:
            log.warning("%s: skipped an unreadable line (%d bytes), torn by a crash", metrics, len(ln))
            continue
        if isinstance(row, dict) and isinstance(row.get("round"), int):
            out.append((ln, row))
    return out


def write_config(path: Path, cfg: ExperimentConfig, info: dict[str, Any]) -> None:
    """config.toml: the resolved config under a comment header of the run's facts."""
    header = "".join(f"# {k}: {v}\n" for k, v in info.items())
    (path / "config.toml").write_text(header + dump_config(resolved_paths(cfg)))
    atomic_write(path / "plugins.json", (json.dumps(used_code(cfg), indent=1) + "\n").encode(),
                 mode=0o640)


def used_code(cfg: ExperimentConfig) -> list[dict[str, str]]:
    """The registered names the run uses (model, dataset, algorithm, aggregation rule) with the
    installed distribution and version each came from, as plugins.json records them."""
    from fedseq.common.registry import REGISTRY

    return REGISTRY.used(cfg.registered_names())


#: what `fedseq-sim --finetune-from` may change: the final fine-tuning alone
FINETUNE_KEYS = ("algorithm.finetune_epochs", "algorithm.finetune_blocks")


def copy_for_finetune(src: Path, out: Path, overrides: list[str], info: dict[str, Any]
                      ) -> ExperimentConfig:
    """A new run directory `out` holding `src`'s federated rounds (rows and checkpoint) under
    `src`'s config with other fine-tuning settings, so resuming it replays only the final
    fine-tuning (bitwise the original where nothing changed); `info` heads its config.toml.
    Raises ConfigError (one line) for a run not through its rounds, a deployed run, a change to
    anything else, or a non-empty `out`."""
    import shutil

    from fedseq.common.algorithms import algorithm_class
    from fedseq.server.rounds.checkpoint import FILE, load_checkpoint
    from fedseq.server.rounds.seeds import result_changes

    if not (src / "config.toml").is_file():
        raise ConfigError(f"--finetune-from {src}: no config.toml there; is it a run directory?")
    before = load_run_config(src)
    cfg = load_run_config(src, overrides)
    other = [c for c in result_changes(before, cfg) if not c.startswith(FINETUNE_KEYS)]
    if other:
        raise ConfigError(f"--finetune-from replays the fine-tuning alone: --set may change "
                          f"{' and '.join(FINETUNE_KEYS)}, not {', '.join(other)}")
    if not algorithm_class(cfg.algorithm.name).finetunes(cfg):
        raise ConfigError(f"{cfg.algorithm.name} with algorithm.finetune_epochs = "
                          f"{cfg.algorithm.finetune_epochs} has no final fine-tuning to replay")
    ckpt = load_checkpoint(src)
    if ckpt.pool.state is not None:
        raise ConfigError(f"--finetune-from {src}: that run was deployed (its devices hold the "
                          "clients' state); only a simulated run's fine-tuning is replayed")
    done = ckpt.next_round
    if done < cfg.rounds:
        raise ConfigError(f"--finetune-from {src}: {done} of its {cfg.rounds} rounds are done; "
                          f"finish it first (fedseq-sim --resume {src})")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; pass a new folder")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / FILE, out / FILE)
    shutil.copyfile(src / "metrics.jsonl", out / "metrics.jsonl")  # resuming drops its finetune row
    write_config(out, cfg, info)
    return cfg


def refuse_used_out(path: Path, mode: str) -> None:
    """A new run's folder must be empty or absent (nothing is ever silently overwritten):
    ConfigError in one line otherwise. The commands check it before anything slow starts."""
    if mode == "new" and path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"--out {path} exists and is not empty: pass --resume {path} to continue "
                          "that run, or --overwrite to replace it")


class RunDir:
    """`mode`: "new" refuses a non-empty folder (nothing is ever silently overwritten),
    "overwrite" replaces a previous run's files, "resume" keeps its rows before `resume_round`."""

    def __init__(self, path: Path, cfg: ExperimentConfig, mode: str = "new",
                 resume_round: int = 0, info: dict[str, Any] | None = None):
        self.path = Path(path)
        refuse_used_out(self.path, mode)
        self.path.mkdir(mode=0o750, parents=True, exist_ok=True)
        _check_owner(self.path)
        self._lock = _lock(self.path)
        self.info = dict(info or {})
        #: the train rounds metrics.jsonl holds (a resumed run's kept rows)
        self.logged_rounds: set[int] = set()
        metrics = self.path / "metrics.jsonl"
        if mode == "resume":
            kept = [ln for ln, row in _rows(metrics)
                    if row.get("phase") == "train" and row["round"] < resume_round]
            self.logged_rounds = {json.loads(ln)["round"] for ln in kept}
            self.info["segments"] = _segments(self.path / "status.json", resume_round, self.info)
            atomic_write(metrics, "".join(ln + "\n" for ln in kept).encode())
            self._metrics = metrics.open("a")
        else:
            for name in ("checkpoint.safetensors", "clients.csv", "model.safetensors"):
                (self.path / name).unlink(missing_ok=True)
            write_config(self.path, cfg, self.info)
            self._metrics = metrics.open("w")
        self.set_status("running")

    def set_status(self, state: str, reason: str = "") -> None:
        """status.json: running, finished, interrupted or failed (with the reason)."""
        body = {"state": state, "reason": reason, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **self.info}
        atomic_write(self.path / "status.json", (json.dumps(body, indent=1) + "\n").encode(),
                     durable=False)

    def log_round(self, row: RoundRecord) -> None:
        """Append one row to metrics.jsonl, on disk before this returns (fsync): the round's
        checkpoint is already written, and a resume trusts the rows it finds."""
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                 for k, v in row.to_json().items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()
        os.fsync(self._metrics.fileno())

    def record_devices(self, stacks: dict[str, list[dict[str, Any]]]) -> None:
        """devices.json (deployments): what each device said it trains with (torch build,
        threads, hardware; DeviceInfo), oldest first, one entry per change, kept across resumes.
        A device listed with no entry never described itself (a fedseq older than DeviceInfo, or
        a broker ACL that does not let it write fedseq/device/<name>/info)."""
        path = self.path / "devices.json"
        merged: dict[str, list[dict[str, Any]]] = {}
        with contextlib.suppress(OSError, ValueError):
            old = json.loads(path.read_text())
            merged = {str(d): list(rows) for d, rows in old.items() if isinstance(rows, list)}
        for device, rows in stacks.items():
            kept = merged.setdefault(device, [])
            for row in rows:
                if not kept or _stack(kept[-1]) != _stack(row):
                    kept.append(row)
        atomic_write(path, (json.dumps(merged, indent=1, sort_keys=True) + "\n").encode(),
                     durable=False, mode=0o640)  # device facts: not for every local user

    def write_outputs(self, data: FederatedData, scores: dict[int, tuple[int, int]],
                      weights: Weights, cfg: ExperimentConfig) -> None:
        """The run's results: clients.csv (per client its sizes, classes and final score) and
        model.safetensors (the final global weights with the run's metadata)."""
        with (self.path / "clients.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("client", "train_samples", "test_samples", "correct", "total", "accuracy",
                        "classes"))
            for shard in data.clients:
                correct, total = scores.get(shard.client, (0, 0))
                classes = shard.train_class_counts(data.y, data.num_classes).count_nonzero()
                w.writerow((shard.client, shard.num_train, shard.num_test, correct, total,
                            round(correct / total, 6) if total else "", int(classes)))
        atomic_write(self.path / "model.safetensors", encode_tensors(weights, {
            "algorithm": cfg.algorithm.name, "rounds": str(cfg.rounds), "seed": str(cfg.seed)}))

    def close(self) -> None:
        """Close metrics.jsonl and let go of the folder (another coordinator may resume it)."""
        self._metrics.close()
        self._lock.close()


def _check_owner(path: Path) -> None:
    """A run folder is this user's to write: one that another account owns, or that every local
    user may write, could hold links planted to make this process (root, in a rehearsal)
    overwrite files elsewhere."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o002:
        raise ConfigError(f"--out {path} is owned by uid {st.st_uid} or writable by others "
                          f"(mode {stat.filemode(st.st_mode)}); pass a folder of your own")


def _lock(path: Path) -> IO[str]:
    """Hold the run folder for this process (an advisory lock, released when it ends): a second
    coordinator on the same folder (`--resume` while the first still runs, say on a laptop that
    slept) stops in one line instead of writing beside it."""
    f = os.fdopen(os.open(path / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o640), "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = f.read().strip() or "?"
        f.close()
        raise ConfigError(f"{path} is in use by another fedseq process (pid {holder}): stop it, "
                          "or wait for it to end, before resuming or overwriting this run") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


#: what a run's rounds were computed with, besides config and seed (hardware.compute_record):
#: a resumed run whose parts differ in any of these is not bitwise one uninterrupted run
SEGMENT_KEYS = ("threads", "torch", "cuda", "device", "cpu", "cpu_kernels")


def _segments(status: Path, resume_round: int, info: dict[str, Any]) -> list[dict[str, Any]]:
    """status.json's `segments` for a run resumed at `resume_round`: the earlier parts (from the
    previous status.json; a run from before segments existed gives one part from round 0) and
    this one, each with the round it started from and SEGMENT_KEYS. Warns where this part
    computes with something else than the last, e.g. other CPU kernels on another machine."""
    old: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(status.read_text())
    parts = [p for p in old.get("segments", []) if p.get("from_round", 0) < resume_round]
    if not parts and old:
        parts = [{"from_round": 0, **{k: old[k] for k in SEGMENT_KEYS if k in old}}]
    here = {"from_round": resume_round, **{k: info[k] for k in SEGMENT_KEYS if k in info}}
    if parts:
        before = parts[-1]
        changed = [f"{k} {before.get(k, '?')!r} -> {here[k]!r}" for k in SEGMENT_KEYS
                   if k in here and before.get(k, here[k]) != here[k]]
        if changed:
            log.warning("%s continues at round %d with other compute than round %d on (%s): "
                        "the result will not be bitwise an uninterrupted run's (docs/"
                        "explanation/reproducibility.md)", status.parent, resume_round, before["from_round"],
                        "; ".join(changed))
    return [*parts, here]


def _stack(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "seen"}


def stop_on_sigterm() -> None:
    """`kill` and `systemctl stop` send SIGTERM: make it Ctrl-C's KeyboardInterrupt, so `recorded`
    marks the run directory interrupted (resumable) instead of leaving it "running"."""
    signal.signal(signal.SIGTERM, _sigterm)


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


@contextmanager
def recorded(run_dir: RunDir | None) -> Iterator[None]:
    """Close the run directory with its final state: finished, interrupted (Ctrl-C, SIGTERM) or
    failed (with the one-line reason)."""
    try:
        yield
    except KeyboardInterrupt:
        if run_dir is not None:
            run_dir.set_status("interrupted", "stopped by the operator; continue with --resume")
        raise
    except BaseException as exc:
        if run_dir is not None:
            run_dir.set_status("failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise
    else:
        if run_dir is not None:
            run_dir.set_status("finished")
    finally:
        if run_dir is not None:
            run_dir.close()
