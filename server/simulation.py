"""fedseq-sim: a whole federated experiment in one process, on the same code as a deployment."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedseq.common.config import ExperimentConfig
from fedseq.common.errors import ConfigError
from fedseq.common.hardware import compute_record, torch_device
from fedseq.server.checkpoint import load_checkpoint
from fedseq.server.coordinator import Coordinator, RunResult
from fedseq.server.experiment import load_experiment
from fedseq.server.pool import InProcessPool
from fedseq.server.records import RoundRecord
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


def sim_threads(setting: int | str | None) -> int:
    """train.threads as a thread count: a number as given; None = torch's thread count in this
    process (in a fresh fedseq-sim: this machine's physical cores, or OMP_NUM_THREADS), a fixed
    choice, so the same config and seed give the same run whatever else runs (and a program or
    test that set torch's threads keeps them); "auto" = the cores not busy now (default_threads;
    faster beside other work, load-dependent results)."""
    if setting == "auto":
        return default_threads()
    if isinstance(setting, int):
        return setting
    return torch.get_num_threads()


def run_simulation(
    cfg: ExperimentConfig,
    out: Path | None,
    on_round: Callable[[RoundRecord], None] | None = None,
    mode: str = "new",
    info: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    pause_after: int | None = None,
    workers: int = 0,
    workers_per_gpu: int = 0,
) -> RunResult:
    """Load data, build the seed-derived model, run all rounds (and fine-tuning): in-process, or
    with `workers` > 0 by that many worker processes (server/distributed.py; under torchrun, the
    group's; `workers_per_gpu` workers share a GPU, and without `workers` there are that many per
    GPU of this machine). mode "resume" continues `out` after its checkpoint's last complete
    round."""
    from fedseq.server.distributed import under_torchrun

    if workers > 0 or workers_per_gpu > 0 or under_torchrun():
        return _run_distributed(cfg, out, on_round, mode, info, on_progress, pause_after, workers,
                                workers_per_gpu)
    threads = sim_threads(cfg.train.threads)
    torch.set_num_threads(threads)
    info = {**(info or {}), "threads": threads}
    device = torch_device(cfg.train.device)
    # what else bitwise reproducibility depends on (README, Reproducibility); "device" is "cpu"
    # or the GPU's name, as the report reads it
    record = compute_record(device)
    info.update(record, device=record["gpu"] or str(device))
    ckpt = load_checkpoint(out) if mode == "resume" and out is not None else None
    exp = load_experiment(cfg)
    pool = InProcessPool(exp.data, exp.model, exp.algorithm.personal_blocks(), cfg.seed_for("training"),
                         cfg.train.eval_batch_size, device)
    run_dir = None
    if out is not None:
        run_dir = RunDir(out, cfg, mode, ckpt.next_round if ckpt else 0, info)
    coordinator = Coordinator(cfg, exp.algorithm, exp.model, exp.data, pool, run_dir, on_round,
                              on_progress)
    coordinator.pause_after = pause_after
    with recorded(run_dir):
        return coordinator.run(ckpt)


def _run_distributed(
    cfg: ExperimentConfig,
    out: Path | None,
    on_round: Callable[[RoundRecord], None] | None,
    mode: str,
    info: dict[str, Any] | None,
    on_progress: Callable[[int, int], None] | None,
    pause_after: int | None,
    workers: int,
    per_gpu: int,
) -> RunResult:
    """Rank 0 of a distributed simulation: the same round loop over a DistributedPool. Every
    worker and rank 0 use train.threads torch threads (default 1: one thread per client and a
    worker per core is the fast setting, and its numbers are the in-process run's with
    train.threads = 1). With train.device on GPUs, each worker trains on the GPU `placement`
    gives it (rank 0 needs none)."""
    from fedseq.server.distributed import DistributedPool, end_group, start_group, under_torchrun

    if workers == 0 and not under_torchrun():
        workers = per_gpu * torch.cuda.device_count()
        if workers == 0:
            raise ConfigError(f"--workers-per-gpu {per_gpu}: torch {torch.__version__} sees no "
                              "GPU here; give --workers N to train on CPU cores")
    threads = cfg.train.threads if isinstance(cfg.train.threads, int) else 1
    torch.set_num_threads(threads)
    ckpt = load_checkpoint(out) if mode == "resume" and out is not None else None
    # rank 0 never trains: the partition's sizes and labels and the test images are enough
    exp = load_experiment(cfg, test_images_only=True)
    group = start_group(cfg, workers, threads, per_gpu)
    try:
        import torch.distributed as dist

        workers = dist.get_world_size() - 1
        on_gpu = sorted({d for d in group.devices.values() if d != "cpu"})
        info = {**(info or {}), "threads": threads, "workers": workers,
                **compute_record(torch.device("cpu")), "device": group.gpu or "cpu"}
        if on_gpu:
            info.update(gpu=group.gpu, torch_device=", ".join(on_gpu),
                        workers_per_gpu=per_gpu or None)
        pool = DistributedPool({c.client: (len(c.train), len(c.test)) for c in exp.data.clients},
                               exp.model, exp.algorithm.personal_blocks(),
                               cfg.seed_for("training"), cfg.train.eval_batch_size)
        run_dir = None
        if out is not None:
            run_dir = RunDir(out, cfg, mode, ckpt.next_round if ckpt else 0, info)
        coordinator = Coordinator(cfg, exp.algorithm, exp.model, exp.data, pool, run_dir,
                                  on_round, on_progress)
        coordinator.pause_after = pause_after
        with recorded(run_dir):
            result = coordinator.run(ckpt)
        pool.stop()
        return result
    finally:
        end_group(group.procs)
