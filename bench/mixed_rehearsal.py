"""The mixed fleet rehearsed against its simulation (bench/mixed_rehearsal.sh).

    python bench/mixed_rehearsal.py OUT
        per mode (sync, over-select, async): the rehearsal's wall seconds (its rows' seconds,
        evaluation steps included) and the simulation's virtual seconds (no evaluation time),
        in all and per training round or step without an evaluation, their ratio, and each
        run's final global accuracy; then the synchronous rounds side by side (the same clients
        in both: the same seed).
    python bench/mixed_rehearsal.py --fleet RUN_DIR [--link DEVICE=PROFILE ...]
        the --set argument of the [fleet] RUN_DIR measured (fedseq fleet), one line, each
        device's link wifi-good unless given.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import tomllib

from fedseq.server.report import load_run
from fedseq.server.rounds.virtual_fleet import measured_fleet

MODES = ("sync", "over-select", "async")


def fleet_arg(run: Path, links: list[str]) -> str:
    """`fleet.devices=[...]` for --set: the devices RUN_DIR measured, with their links."""
    text = measured_fleet(load_run(run).train_rows, 0.0, 0.0, "wifi-good")
    names = [line.rsplit("# ", 1)[1] for line in text.splitlines() if "# " in line]
    link = dict(item.split("=", 1) for item in links)
    groups = tomllib.loads(text)["fleet"]["devices"]
    return "fleet.devices=[" + ",".join(
        f'{{profile="{g["profile"]}",count=1,link="{link.get(n, "wifi-good")}"}}'
        for g, n in zip(groups, names, strict=True)) + "]"


def compare(out: Path) -> None:
    print("mode         rounds  wall s (rehearsed)  virtual s (simulated)  ratio   "
          "per round without evaluation: wall / virtual s   final G rehearsed / simulated")
    for mode in MODES:
        real, sim = out / "rehearsed" / mode, out / "simulated" / mode
        if not (real / "metrics.jsonl").is_file() or not (sim / "metrics.jsonl").is_file():
            continue
        r, s = load_run(real).train_rows, load_run(sim).train_rows
        wall = sum(x.seconds or 0.0 for x in r)
        virtual = s[-1].virtual_time_s or 0.0
        quiet_r = [x.seconds for x in r if x.global_acc is None and x.seconds]
        quiet_s = [x.virtual_s for x in s if x.global_acc is None and x.virtual_s]
        per = (f"{statistics.mean(quiet_r):6.1f} / {statistics.mean(quiet_s):6.1f}"
               if quiet_r and quiet_s else "-")
        g_r, g_s = r[-1].global_acc, s[-1].global_acc
        print(f"{mode:12s} {len(r):5d}  {wall:14.0f}      {virtual:14.0f}       "
              f"{wall / virtual:5.2f}   {per:>30s}        "
              f"{100 * (g_r or 0):5.2f} / {100 * (g_s or 0):5.2f}")
    real, sim = out / "rehearsed" / "sync", out / "simulated" / "sync"
    if (real / "metrics.jsonl").is_file() and (sim / "metrics.jsonl").is_file():
        print("\nsync round  clients (same in both)      wall s  virtual s  evaluated")
        for x, y in zip(load_run(real).train_rows, load_run(sim).train_rows, strict=False):
            same = "" if x.clients == y.clients else "  (clients differ!)"
            print(f"{x.round:10d}  {str(x.clients):26s} {x.seconds or 0:7.1f}  "
                  f"{y.virtual_s or 0:9.1f}  {'yes' if x.global_acc is not None else 'no'}{same}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--fleet", action="store_true", help="print the measured fleet's --set")
    parser.add_argument("--link", action="append", default=[], help="DEVICE=PROFILE")
    args = parser.parse_args()
    if args.fleet:
        print(fleet_arg(args.path, args.link))
    else:
        compare(args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
