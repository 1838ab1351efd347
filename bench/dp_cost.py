"""What [privacy] costs a client: the seconds of `training.clip_update` (client level,
DP-FedAvg) on one update, and of the same client round under record-level DP-SGD (per-example
gradients by Opacus, clipped and noised every step), against the seconds of the plain client
round, on this machine's CPU, for the testbed's ConvNet and the FedSeq paper's CNN
(Fashion-MNIST, one client of the testbed config, one torch thread). Prints one line per model
with the figures and their ratios (one run, so the ratios share the machine's load).

    python bench/dp_cost.py [--data-root ../shared/data] [--repeat 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from fedseq.common.codecs import Codec
from fedseq.common.config import load_config
from fedseq.common.models import get_blocks
from fedseq.common.training import clip_update, run_client_round
from fedseq.server.rounds.experiment import load_experiment

ROOT = Path(__file__).resolve().parent.parent


def measure(data_root: Path, model: str, repeat: int) -> str:
    cfg = load_config(ROOT / "examples" / "fmnist-testbed.toml", [
        f"data.root={str(data_root)!r}", "algorithm.name=fedavg", f"model.name={model}",
        "privacy.enabled=true", "privacy.clip_norm=0.01"])  # every update is scaled
    exp = load_experiment(cfg)
    plan = exp.algorithm.plan(0)
    shard = exp.data.clients[0]
    start = get_blocks(exp.model, exp.model.spec.blocks)
    t0 = time.perf_counter()
    update, _ = run_client_round(exp.model, dict(start), plan, exp.data, shard, 0, 0)
    round_s = time.perf_counter() - t0
    raw = {k: v * 100 for k, v in update.deltas.items()}  # above C again: the scaling runs
    t0 = time.perf_counter()
    for _ in range(repeat):
        clip_update(raw, 0.01, Codec())
    clip_s = (time.perf_counter() - t0) / repeat
    params = sum(v.numel() for v in raw.values())
    dp_sgd = dataclasses.replace(plan, clip=None, record_dp=(1.0, 1.0))
    t0 = time.perf_counter()
    run_client_round(exp.model, dict(start), dp_sgd, exp.data, shard, 0, 0)
    sgd_s = time.perf_counter() - t0
    return (f"{model:8s} {params:>9,d} parameters, {len(shard.train)} rows x "
            f"{cfg.train.local_epochs} epochs: client round {round_s:.3f} s, clipping "
            f"{clip_s * 1000:.2f} ms ({clip_s / round_s:.2e} of the round); DP-SGD client round "
            f"{sgd_s:.3f} s ({sgd_s / round_s:.2f} x the plain round)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data-root", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for model in ("convnet", "cnn"):
        print(measure(args.data_root, model, args.repeat), flush=True)


if __name__ == "__main__":
    main()
