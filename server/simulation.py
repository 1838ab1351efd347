"""fedseq-sim: a whole federated experiment in one process, on the same code as a deployment."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedseq.common.algorithms import algorithm_class, make_algorithm
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import load_federated
from fedseq.common.errors import ConfigError
from fedseq.server.checkpoint import load_checkpoint
from fedseq.server.coordinator import Coordinator, RunResult
from fedseq.server.pool import InProcessPool, make_model
from fedseq.server.rundir import RunDir, recorded


def default_threads(cores: int | None = None, load: float | None = None) -> int:
    """The cores not already busy when the run starts: all of them on an idle machine, fewer
    beside other work. Measured on 2 cores (a FedAvg testbed round, `bench/sim_round.py`): idle,
    2 threads 16.2 s, 1 thread 25.2 s; beside one busy process, 2 threads > 200 s (OpenMP threads
    spin waiting for a preempted peer), 1 thread 33.4 s."""
    cores = cores or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    return max(1, min(cores, cores - round(load)))


def sim_device(choice: str) -> torch.device:
    """train.device as a torch device; a CUDA choice without CUDA is a one-line ConfigError."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"train.device={choice!r}, but torch {torch.__version__} ({build}) "
                              f"sees no GPU; use train.device='cpu' or install a CUDA torch "
                              f"(README, Set up)")
        index = int(choice.split(":")[1]) if ":" in choice else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"train.device={choice!r}, but this machine has "
                              f"{torch.cuda.device_count()} GPU(s); use cuda:0")
    return torch.device(choice)


def run_simulation(
    cfg: ExperimentConfig,
    out: Path | None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    mode: str = "new",
    info: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    pause_after: int | None = None,
) -> RunResult:
    """Load data, build the seed-derived model, run all rounds (and fine-tuning) in-process.
    mode "resume" continues `out` after its checkpoint's last complete round."""
    threads = cfg.train.threads or default_threads()
    torch.set_num_threads(threads)
    info = {**(info or {}), "threads": threads}
    device = sim_device(cfg.train.device)
    info["device"] = str(device) if device.type == "cpu" else torch.cuda.get_device_name(device)
    ckpt = load_checkpoint(out) if mode == "resume" and out is not None else None
    data = load_federated(cfg.data, cfg.seed)
    model = make_model(cfg.model.name, data, algorithm_class(cfg.algorithm.name).two_heads, cfg.seed)
    alg = make_algorithm(cfg, model.spec)
    pool = InProcessPool(data, model, alg.personal_blocks(), cfg.seed, cfg.train.eval_batch_size,
                         device)
    run_dir = None
    if out is not None:
        run_dir = RunDir(out, cfg, mode, ckpt.next_round if ckpt else 0, info)
    coordinator = Coordinator(cfg, alg, model, data, pool, run_dir, on_round, on_progress)
    coordinator.pause_after = pause_after
    with recorded(run_dir):
        return coordinator.run(ckpt)
