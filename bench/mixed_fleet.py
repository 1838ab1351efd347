"""Time and energy to accuracy on a simulated mixed fleet: sync against over-selection and async.

Reads run directories laid out as RUNS/<algorithm>/<mode>/seed-N (fedseq-sim --seeds sweeps of
one config with a [fleet], one sweep per mode, each over about the same simulated time; "sync"
is the reference) and prints, per algorithm, mode and seed: the synchronous run's final global
accuracy (the mean of its last three evaluations: one round's figure on this non-IID testbed
swings by points), and for every mode the simulated seconds and modelled kJ until its global
accuracy first reaches that target, as ratios to the whole synchronous run's (the issue's goal:
async <= 0.6x the time at no more energy).

    python bench/mixed_fleet.py docs/results/testbed/mixed-fleet
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from fedseq.server.report import load_run


def _reach(rows: list, target: float, window: int = 1) -> tuple[float, float] | None:
    """(simulated seconds, modelled joules) when the mean of the last `window` global
    accuracies first reaches `target` (window 3: held, not a single swing)."""
    energy, last = 0.0, []
    for r in rows:
        energy += r.modelled_energy_j or 0.0
        if r.global_acc is None:
            continue
        last = (last + [r.global_acc])[-window:]
        if len(last) == window and statistics.mean(last) >= target - 1e-12:
            return r.virtual_time_s, energy
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    args = parser.parse_args()
    print("algorithm    mode          seed  target G  time s (x sync)    energy kJ (x sync)  "
          "steps  held 3 evaluations: time s (x sync)")
    ratios: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    for alg in sorted(p for p in args.runs.iterdir() if (p / "sync").is_dir()):
        modes = ["sync"] + sorted(p.name for p in alg.iterdir() if p.is_dir() and p.name != "sync")
        for seed_dir in sorted((alg / "sync").glob("seed-*")):
            ref = load_run(seed_dir).train_rows
            scored = [r for r in ref if r.global_acc is not None]
            target = statistics.mean(r.global_acc for r in scored[-3:])
            t_sync = scored[-1].virtual_time_s
            assert t_sync is not None
            e_sync = sum(r.modelled_energy_j or 0.0 for r in ref)
            for mode in modes:
                path = alg / mode / seed_dir.name
                if not (path / "metrics.jsonl").is_file():
                    continue
                rows = load_run(path).train_rows
                if not rows:
                    continue
                got = (t_sync, e_sync) if mode == "sync" else _reach(rows, target)
                if got is None:
                    last = rows[-1]
                    print(f"{alg.name:12s} {mode:13s} {seed_dir.name[5:]:>4s}  {100 * target:7.2f}"
                          f"  not reached in {last.virtual_time_s:.0f} s ({len(rows)} steps, "
                          f"best G {100 * max(r.global_acc or 0 for r in rows):.2f})")
                    continue
                t, e = got
                steps = next(i for i, r in enumerate(rows, 1) if r.virtual_time_s >= t - 1e-9)
                held = (t_sync, e_sync) if mode == "sync" else _reach(rows, target, 3)
                ratios.setdefault((alg.name, mode), []).append(
                    (t / t_sync, e / e_sync) + ((held[0] / t_sync,) if held else ()))
                print(f"{alg.name:12s} {mode:13s} {seed_dir.name[5:]:>4s}  {100 * target:7.2f}"
                      f"  {t:8.0f} ({t / t_sync:4.2f})    {e / 1e3:8.1f} ({e / e_sync:4.2f})"
                      f"    {steps:4d}   " + ("not held" if held is None else
                                             f"{held[0]:8.0f} ({held[0] / t_sync:4.2f})"))
    print("\nmean over seeds (of those that reached the target)")
    for (alg_name, mode), rs in sorted(ratios.items()):
        held = [r[2] for r in rs if len(r) == 3]
        print(f"{alg_name:12s} {mode:13s} time x{statistics.mean(r[0] for r in rs):.2f}  "
              f"energy x{statistics.mean(r[1] for r in rs):.2f}  ({len(rs)} seeds)"
              + (f"; held: time x{statistics.mean(held):.2f} ({len(held)} seeds)" if held
                 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
