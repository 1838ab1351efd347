"""Results V's headline (issue 95): time, device energy and bytes to the baseline's accuracy, per
arm of examples/campaigns/headline.toml (a campaign folder: OUT/<arm>/<algorithm>/seed-S).

The target, per seed, is the baseline's (FedAvg, sync, float32) final accuracy on FedReG's
testbed metric, each client's local model on its own test rows (`local_acc`, L), taken as the
mean of its last three evaluations (one round's figure swings by points on this non-IID
testbed). Every arm is scored by the simulated seconds, the modelled device joules and the bytes
(devices' up + down, and what reached the coordinator) until its L first reaches that target,
and again until the mean of three consecutive evaluations does ("held"); ratios are to the
baseline's whole run. An arm that never reaches it says so, with its best L. Final L, G and P
stand beside. Nothing is tuned to the figure: the arms are the campaign file's.

    python bench/headline.py docs/results/testbed/headline
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from fedseq.server.report import load_run

BASELINE = "baseline"


def _cost(rows: list, upto: int) -> tuple[float, float, float, float]:
    """(simulated s, device J, device MB up + down, MB into the coordinator) over rows[:upto]."""
    part = rows[:upto]
    energy = sum(r.modelled_energy_j or 0.0 for r in part)
    device = sum(r.bytes_up + r.bytes_down for r in part) / 1e6
    inbound = sum(r.upstream_bytes if r.upstream_bytes is not None else r.bytes_up
                  for r in part) / 1e6
    return part[-1].virtual_time_s or 0.0, energy, device, inbound


def _reach(rows: list, target: float, window: int) -> int | None:
    """How many rows until the mean of the last `window` local accuracies reaches `target`."""
    last: list[float] = []
    for i, r in enumerate(rows, 1):
        if r.local_acc is None:
            continue
        last = (last + [r.local_acc])[-window:]
        if len(last) == window and statistics.mean(last) >= target - 1e-12:
            return i
    return None


def _final(rows: list, name: str) -> float | None:
    vals = [getattr(r, name) for r in rows if getattr(r, name) is not None]
    return 100 * vals[-1] if vals else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("campaign", type=Path)
    args = parser.parse_args()
    arms = [p for p in sorted(args.campaign.iterdir()) if p.is_dir()]
    arms.sort(key=lambda p: p.name != BASELINE)
    print(f"{'arm':17s} seed target L  first: round  sim s (x)      kJ (x)      device MB (x)   "
          "coord MB (x)   held: sim s (x)   final L / G / P")
    ratios: dict[str, list[tuple[float, ...]]] = {}
    for base_seed in sorted((args.campaign / BASELINE).glob("*/seed-*")):
        base = load_run(base_seed).train_rows
        scored = [r for r in base if r.local_acc is not None]
        if not scored:
            continue
        target = statistics.mean(r.local_acc for r in scored[-3:])
        whole = _cost(base, len(base))
        for arm in arms:
            for run in sorted(arm.glob(f"*/{base_seed.name}")):
                rows = load_run(run).train_rows
                if not rows or (run / "status.json").read_text().find('"finished"') < 0:
                    print(f"{arm.name:17s} {base_seed.name[5:]:>4s}  (not finished)")
                    continue
                first = len(rows) if arm.name == BASELINE else _reach(rows, target, 1)
                held = len(rows) if arm.name == BASELINE else _reach(rows, target, 3)
                finals = " / ".join("-" if v is None else f"{v:.2f}" for v in
                                    (_final(rows, n) for n in ("local_acc", "global_acc",
                                                               "personal_acc")))
                if first is None:
                    best = max(100 * (r.local_acc or 0) for r in rows)
                    print(f"{arm.name:17s} {base_seed.name[5:]:>4s}  {100 * target:6.2f}   "
                          f"not reached in {len(rows)} rows ({rows[-1].virtual_time_s:.0f} s), "
                          f"best L {best:.2f}          final {finals}")
                    continue
                got = _cost(rows, first)
                x = tuple(g / w if w else float("nan") for g, w in zip(got, whole, strict=True))
                h = _cost(rows, held)[0] if held is not None else None
                ratios.setdefault(arm.name, []).append(x + ((h / whole[0],) if h else ()))
                print(f"{arm.name:17s} {base_seed.name[5:]:>4s}  {100 * target:6.2f}   {first:5d}  "
                      f"{got[0]:7.0f} ({x[0]:4.2f})  {got[1] / 1e3:6.1f} ({x[1]:4.2f})  "
                      f"{got[2]:8.1f} ({x[2]:4.2f})  {got[3]:7.1f} ({x[3]:4.2f})  "
                      + ("not held        " if h is None else f"{h:7.0f} ({h / whole[0]:4.2f})  ")
                      + f"final {finals}")
    print("\nmean ratios to the baseline's whole run, over the seeds that reached the target")
    for arm_name, rs in ratios.items():
        held = [r[4] for r in rs if len(r) == 5]
        print(f"{arm_name:17s} time x{statistics.mean(r[0] for r in rs):.2f}  energy "
              f"x{statistics.mean(r[1] for r in rs):.2f}  device bytes "
              f"x{statistics.mean(r[2] for r in rs):.2f}  coordinator bytes "
              f"x{statistics.mean(r[3] for r in rs):.2f}  ({len(rs)} seeds)"
              + (f"; held: time x{statistics.mean(held):.2f} ({len(held)} seeds)" if held else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
