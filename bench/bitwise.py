"""Fingerprints of short real-data simulations: did a code change alter any result?

For each algorithm, a 3-round run on 5% of Fashion-MNIST (5 clients, all of them every round,
fine-tuning where the algorithm has it, one torch thread) and one line: the sha256 of the final
global weights, of every round's accuracies (global, personalized, local) and of the final
per-client (correct, total). Run it before and after a refactor and diff the output: identical
lines mean bitwise identical results.

    python bench/bitwise.py [--data-root ../shared/data] [fedavg fedper fedreg ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch

from fedseq.common.config import load_config
from fedseq.server.ops.simulation import run_simulation

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["fedavg", "fedavgm", "fedadam", "fedyogi", "scaffold", "fedper", "fedrep", "lg-fedavg",
           "fedbabu", "fedrod", "fedreg", "fedseq-anti", "feddyn", "ditto", "gpfl", "moon",
           "fednova", "fedavg+fleet", "fedavg+over", "fedavg+async", "fedavgm+async",
           "fedper+async", "fedavg+dp", "fedavg+secagg"]

#: NAME+VARIANT runs the algorithm under another driver or setting: a simulated fleet's clock
#: (sync), over-selection on it, buffered asynchronous aggregation, client-level DP, secure
#: aggregation (its sum, decoded, does not depend on the keys). DP pins its noise seed to the
#: run's seed (0), the noise an unpinned run drew before the noise seed became each run's secret,
#: so its fingerprint is comparable across that change
FLEET = "fleet.devices=[{profile='nano',count=2},{profile='orin-nano',count=2}]"
VARIANTS = {
    "fleet": [FLEET],
    "over": [FLEET, "train.join_ratio=0.6", "train.over_select=1.7"],
    "async": [FLEET, "train.mode='async'", "train.concurrency=3", "train.buffer=2"],
    "dp": ["privacy.enabled=true", "privacy.clip_norm=1.0", "privacy.noise_multiplier=0.5",
           "privacy.delta=1e-3", "train.join_ratio=0.8", "seeds.noise=0"],
    "secagg": ["secagg.enabled=true"],
}


def fingerprint(data_root: Path, name: str) -> str:
    algorithm, _, variant = name.partition("+")
    cfg = load_config(None, [
        f"data.root={str(data_root)!r}", "data.dataset=fmnist", "data.fraction=0.05",
        "data.num_clients=5", "data.alpha=0.5", "data.min_samples=40", "rounds=3",
        "train.join_ratio=1.0", "train.local_epochs=1", "train.batch_size=20",
        "algorithm.finetune_epochs=2", "algorithm.unfreeze_rounds=[0,1,1,2]", "train.threads=1",
        f"algorithm.name={algorithm}", "model.name=convnet", *VARIANTS.get(variant, []),
    ])
    with tempfile.TemporaryDirectory() as tmp:
        result = run_simulation(cfg, Path(tmp) / "run")
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    weights = hashlib.sha256()
    for k in sorted(result.global_weights):
        weights.update(k.encode() + result.global_weights[k].contiguous().numpy().tobytes())
    accs = [(r["round"], r["phase"], r.get("global_acc"), r.get("personal_acc"), r.get("local_acc"))
            for r in rows]
    final = sorted(result.final.per_client.items())
    h = lambda x: hashlib.sha256(repr(x).encode()).hexdigest()[:16]  # noqa: E731
    return (f"{name:14s} weights {weights.hexdigest()[:16]}  rounds {h(accs)}  "
            f"final {h(final)}  personal_acc {result.final.personal_acc:.6f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data-root", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("algorithms", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for alg in args.algorithms:
        print(fingerprint(args.data_root, alg), flush=True)


if __name__ == "__main__":
    main()
