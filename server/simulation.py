"""fedseq-sim: a whole federated experiment in one process, on the same code as a deployment."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedseq.common.algorithms import algorithm_class, make_algorithm
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import load_federated
from fedseq.server.coordinator import Coordinator, RunResult
from fedseq.server.pool import InProcessPool, make_model
from fedseq.server.rundir import RunDir


def run_simulation(
    cfg: ExperimentConfig,
    out: Path | None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    """Load data, build the seed-derived model, run all rounds (and fine-tuning) in-process."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    data = load_federated(cfg.data, cfg.seed)
    model = make_model(cfg.model.name, data, algorithm_class(cfg.algorithm.name).two_heads, cfg.seed)
    alg = make_algorithm(cfg, model.spec)
    pool = InProcessPool(data, model, alg.personal_blocks(), cfg.seed, cfg.train.eval_batch_size)
    run_dir = RunDir(out, cfg) if out is not None else None
    try:
        return Coordinator(cfg, alg, model, data, pool, run_dir, on_round).run()
    finally:
        if run_dir is not None:
            run_dir.close()
