"""How large legitimate update elements are against the global model's largest weight: the
figures behind aggregation.max_abs_delta = "auto" (10 x the largest weight; docs/security.md).

    python bench/delta_scale.py examples/fmnist-testbed.toml [--rounds 3] [--set key=value ...]

Runs FedAvg in simulation on real data and prints, per update, the round, the client, its largest
|element| and the global model's largest |weight| when the round began; then the maxima and their
ratio (the auto bound leaves 10 / ratio of headroom).
"""

from __future__ import annotations

import argparse

from fedseq.common.config import load_config
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.rounds import contract as validation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    seen: list[tuple[int, int, float, float]] = []
    check = validation.RoundContract.check
    largest: dict[int, float] = {}

    def measuring(self, update):
        biggest = max(float(d.abs().max()) for d in update.deltas.values())
        seen.append((update.round, update.client, biggest, largest[update.round]))
        return check(self, update)

    contract = validation.round_contract

    def remembering(round, selected, upload, global_weights, *rest):
        largest[round] = max(float(v.abs().max()) for v in global_weights.values()
                             if v.is_floating_point() and v.numel())
        return contract(round, selected, upload, global_weights, *rest)

    validation.RoundContract.check = measuring
    from fedseq.server.rounds import coordinator
    coordinator.round_contract = remembering
    cfg = load_config(args.config, [f"rounds={args.rounds}", "algorithm.name=fedavg",
                                    "train.threads=1", *args.overrides])
    run_simulation(cfg, out=None)
    for r, c, d, w in seen:
        print(f"round {r} client {c:3d}: largest delta {d:.4g}, largest weight {w:.4g}")
    d, w = max(s[2] for s in seen), max(s[3] for s in seen)
    print(f"max delta {d:.4g}, max weight {w:.4g}, ratio {d / w:.3g} (auto bound = 10 x weight: "
          f"{10 / (d / w):.1f}x headroom)")


if __name__ == "__main__":
    main()
