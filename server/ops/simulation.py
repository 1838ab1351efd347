"""fedseq-sim: a whole federated experiment in one process, on the same code as a deployment."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedseq.common.config import ExperimentConfig
from fedseq.common.errors import ConfigError
from fedseq.common.hardware import compute_record, torch_device
from fedseq.server.pools.inprocess import InProcessPool
from fedseq.server.rounds.checkpoint import Checkpoint
from fedseq.server.rounds.coordinator import RunResult
from fedseq.server.rounds.driver import DriverFactory
from fedseq.server.rounds.experiment import Experiment
from fedseq.server.rounds.records import RoundRecord
from fedseq.server.rounds.run import Transport, run_experiment
from fedseq.server.rounds.rundir import RunDir

if TYPE_CHECKING:
    from fedseq.server.pools.distributed import DistributedPool
    from fedseq.server.rounds.ledger import Ledger


log = logging.getLogger(__name__)


def default_threads(cores: int | None = None, load: float | None = None) -> int:
    """The cores not already busy when the run starts: all of them on an idle machine, fewer
    beside other work. Measured on 2 cores (a FedAvg testbed round, `bench/sim_round.py`): idle,
    2 threads 16.2 s, 1 thread 25.2 s; beside one busy process, 2 threads > 200 s (OpenMP threads
    spin waiting for a preempted peer), 1 thread 33.4 s."""
    cores = cores or os.cpu_count() or 1
    if load is None:
        load = load_average() or 0.0
    return max(1, min(cores, cores - round(load)))


def load_average() -> float | None:
    """This machine's one-minute load average (None where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def sim_threads(setting: int | str | None) -> int:
    """train.threads as a thread count: a number as given; None = 1, the same on every machine
    whatever its cores or its load, and bitwise what `--workers` gives (a newcomer's first run on
    2 busy cores took 545 s with 2 threads and 155 s with 1, bench/newcomer.py); "auto" = the
    cores not busy now (default_threads; faster on an idle machine, load-dependent results)."""
    if setting == "auto":
        return default_threads()
    if isinstance(setting, int):
        return setting
    return 1


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
    driver: DriverFactory | None = None,
) -> RunResult:
    """Load data, build the seed-derived model, run all rounds (and fine-tuning): in-process, or
    with `workers` > 0 by that many worker processes (server/pools/distributed.py; under torchrun, the
    group's; `workers_per_gpu` workers share a GPU, and without `workers` there are that many per
    GPU of this machine). mode "resume" continues `out` after its checkpoint's last complete
    round. `driver`: the run's driver (run_experiment; default: by train.mode)."""
    from fedseq.server.pools.distributed import under_torchrun

    cfg = placed_clients(cfg)
    if cfg.train.over_select != 1.0 and not cfg.fleet:
        raise ConfigError("train.over_select in fedseq-sim needs a [fleet]: its devices' paces "
                          "say which clients arrive first; e.g. --set "
                          "'fleet.devices=[{profile=\"nano\",count=5},"
                          "{profile=\"orin-nano\",count=5}]'")
    if cfg.privacy.record_level:  # the clients train here (or on this machine's workers)
        from fedseq.common.dpsgd import unavailable

        why = unavailable()
        if why is not None:
            raise ConfigError(why)
    if workers > 0 or workers_per_gpu > 0 or under_torchrun():
        transport: Transport = Workers(cfg, workers, workers_per_gpu)
    else:
        transport = InProcess(cfg)
    return run_experiment(cfg, out, transport, mode, info, on_round, on_progress, pause_after,
                          driver)


def placed_clients(cfg: ExperimentConfig) -> ExperimentConfig:
    """data.placement = "device": the run has as many clients as the simulated devices' folders
    hold (--devices-data); otherwise `cfg` as it is."""
    if cfg.data.placement != "device":
        return cfg
    from fedseq.common.data.placed import simulated_clients

    return cfg.with_clients(len(simulated_clients(cfg.data)))


def _noise_seed(src: Path) -> int | None:
    """The secret noise seed of the run in `src`, from its checkpoint (None: it has none, e.g. a
    run of an older fedseq, whose noise came from its config's seeds)."""
    from fedseq.server.rounds.checkpoint import FILE, load_checkpoint

    return load_checkpoint(src).loop.noise_seed if (src / FILE).is_file() else None


def replay(src: Path, out: Path | None, overrides: list[str] | None = None, workers: int = 0,
           on_round: Callable[[RoundRecord], None] | None = None,
           info: dict[str, Any] | None = None, mode: str = "new"
           ) -> tuple[RunResult, bool, str]:
    """Re-execute the asynchronous run in `src` in the order its rows record
    (asynchronous.LoggedArrivals) into `out`: the result, whether its global model is bitwise the one
    `src` holds, and that in a sentence."""
    import functools

    from safetensors.torch import load_file

    from fedseq.common.config import FleetConfig, load_run_config
    from fedseq.server.report import load_run
    from fedseq.server.rounds.buffered import BufferedAsync, LoggedArrivals, fold_log

    if not (src / "config.toml").is_file():
        raise ConfigError(f"--replay {src}: no config.toml there; is it a run directory?")
    cfg = load_run_config(src, overrides)
    if cfg.train.mode != "async":
        raise ConfigError(f"--replay {src}: a train.mode = \"{cfg.train.mode}\" run; only an "
                          "asynchronous run is replayed (a synchronous one: run its config again)")
    cfg = cfg.model_copy(update={"fleet": FleetConfig()})  # the order is the log's
    log = fold_log(load_run(src).train_rows)
    done = max(log) + 1
    if done < cfg.rounds:
        cfg = cfg.model_copy(update={"rounds": done})  # a run that stopped early: its steps
    noise_seed = _noise_seed(src) if cfg.privacy.client_level else None

    def driver(book: Ledger) -> BufferedAsync:
        if noise_seed is not None:  # the run's secret noise: replayed bitwise
            book.privacy.noise_seed = noise_seed
        return BufferedAsync(book, functools.partial(LoggedArrivals, log=log))

    result = run_simulation(cfg, out, on_round, mode, info, workers=workers, driver=driver)
    model = src / "model.safetensors"
    if not model.is_file():
        return result, False, f"{src} holds no final model (model.safetensors) to compare with"
    theirs = load_file(str(model))
    same = theirs.keys() == result.global_weights.keys() and all(
        torch.equal(theirs[k], v) for k, v in result.global_weights.items())
    return result, same, ("the replayed global model is bitwise the run's" if same else
                          "the replayed global model differs from the run's (train.threads and "
                          "the devices' torch must equal the run's for bitwise equality)")


class InProcess(Transport):
    """Every client in this process (InProcessPool), on train.threads torch threads and
    train.device."""

    remote = False
    collect_threads = None

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.threads = sim_threads(cfg.train.threads)
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        self.device = torch_device(cfg.train.device)

    def connect(self, stack: contextlib.ExitStack, ckpt: Checkpoint | None) -> None:
        """Nothing to reach; the process's torch threads are given back when the run ends (a
        program or test that runs a simulation keeps its own count)."""
        stack.callback(torch.set_num_threads, self.before)

    def announced(self, ckpt: Checkpoint | None) -> None:
        """The clients' rows are read here (--devices-data): nothing is announced."""

    def open_pool(self, stack: contextlib.ExitStack, exp: Experiment, ckpt: Checkpoint | None
                  ) -> InProcessPool:
        return stack.enter_context(InProcessPool(
            exp.data, exp.model, exp.algorithm.personal_blocks(), self.cfg.seed_for("training"),
            self.cfg.train.eval_batch_size, self.device, algorithm=exp.algorithm.name))

    def info(self) -> dict[str, Any]:
        # what else bitwise reproducibility depends on (docs/explanation/reproducibility.md); "device" is
        # "cpu" or the GPU's name, as the report reads it
        record = compute_record(self.device)
        return {"threads": self.threads, **record, "device": record["gpu"] or str(self.device)}

    def started(self, stack: contextlib.ExitStack, run_dir: RunDir) -> None:
        """Nothing to record beside the run directory."""


class Workers(Transport):
    """Rank 0 of a distributed simulation: the clients trained by the workers of a
    torch.distributed process group (DistributedPool). Every worker and rank 0 use
    train.threads torch threads (default 1: one thread per client and a worker per core is the
    fast setting, and its numbers are the in-process run's with train.threads = 1). With
    train.device on GPUs, each worker trains on the GPU `placement` gives it (rank 0 needs
    none)."""

    remote = True  # rank 0 never trains: the partition's sizes and labels and the test images
    collect_threads = None

    def __init__(self, cfg: ExperimentConfig, workers: int, per_gpu: int):
        from fedseq.server.pools.distributed import under_torchrun

        if workers == 0 and not under_torchrun():
            workers = per_gpu * torch.cuda.device_count()
            if workers == 0:
                raise ConfigError(f"--workers-per-gpu {per_gpu}: torch {torch.__version__} sees "
                                  "no GPU here; give --workers N to train on CPU cores")
        self.cfg, self.workers, self.per_gpu = cfg, workers, per_gpu
        self.threads = cfg.train.threads if isinstance(cfg.train.threads, int) else 1
        torch.set_num_threads(self.threads)
        self._info: dict[str, Any] = {}

    def connect(self, stack: contextlib.ExitStack, ckpt: Checkpoint | None) -> None:
        """The group starts once the experiment is loaded (open_pool)."""

    def announced(self, ckpt: Checkpoint | None) -> None:
        """The workers read the clients' rows (--devices-data): nothing is announced."""

    def open_pool(self, stack: contextlib.ExitStack, exp: Experiment, ckpt: Checkpoint | None
                  ) -> DistributedPool:
        import torch.distributed as dist

        from fedseq.server.pools.distributed import DistributedPool, end_group, start_group

        group = start_group(self.cfg, self.workers, self.threads, self.per_gpu)
        stack.callback(end_group, group.procs)
        on_gpu = sorted({d for d in group.devices.values() if d != "cpu"})
        self._info = {"threads": self.threads, "workers": dist.get_world_size() - 1,
                      **compute_record(torch.device("cpu")), "device": group.gpu or "cpu"}
        if on_gpu:
            self._info.update(gpu=group.gpu, torch_device=", ".join(on_gpu),
                              workers_per_gpu=self.per_gpu or None)
        # after a finished run the pool tells the workers to stop, then the group ends
        return stack.enter_context(DistributedPool(
            {c.client: (c.num_train, c.num_test) for c in exp.data.clients}, exp.model,
            exp.algorithm.personal_blocks(), self.cfg.seed_for("training"),
            self.cfg.train.eval_batch_size))

    def info(self) -> dict[str, Any]:
        return self._info

    def started(self, stack: contextlib.ExitStack, run_dir: RunDir) -> None:
        """Nothing to record beside the run directory."""
