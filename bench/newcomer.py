"""A newcomer's first steps, as the README gives them, timed on a busy machine: a fresh clone of
this repository, the dataset fetched offline (`fedseq data download fmnist --from DIR`), the
first experiment (`fedseq-sim --config examples/quickstart.toml`), the same on a local fleet
(`fedseq-server start ... --local-devices 3`) and the report on both. Beside them, `--busy N`
processes spin on the CPU (a neighbour's work), so the timings are those of a shared machine;
the machine's load average is printed with every step.

The installed fedseq (this interpreter's environment) runs the commands: installing torch and
the project is not timed. Each command runs in the fresh clone with its own data root.

    python bench/newcomer.py --data-from ../shared/data/FashionMNIST/raw [--busy 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def spin() -> None:
    while True:
        pass


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def step(name: str, cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    """Run one README step; (seconds, its last summary line)."""
    before = load()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    said = next((x for x in lines if x.startswith("run finished")), lines[-1] if lines else "")
    print(f"{name:<34} {took:7.1f} s  exit {r.returncode}  load {before} -> {load()}  | {said[:90]}",
          flush=True)
    if r.returncode != 0:
        print("\n".join(lines[-15:]), file=sys.stderr)
        raise SystemExit(f"step failed: {' '.join(cmd)}")
    return took, said


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-from", type=Path, required=True,
                    help="a folder with Fashion-MNIST's four original .gz files")
    ap.add_argument("--busy", type=int, default=2, help="CPU-spinning neighbour processes")
    ap.add_argument("--keep", action="store_true", help="keep the clone (printed)")
    ap.add_argument("--threads", type=int, default=None,
                    help="add --set train.threads=N to the simulation, as its warning advises "
                         "on a busy machine (default: the README's command as it is)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="fedseq-newcomer-"))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "FEDSEQ_DATA": str(home / "data"),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("OMP_NUM_THREADS", None)  # a newcomer's shell sets none
    neighbours = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in neighbours:
        p.start()
    print(f"{os.cpu_count()} cores, {args.busy} busy neighbour processes; waiting 30 s for the "
          "load average to show them", flush=True)
    time.sleep(30)
    threads = [] if args.threads is None else ["--set", f"train.threads={args.threads}"]
    total = 0.0
    try:
        clone = home / "fedseq"
        total += step("git clone", ["git", "clone", "-q", str(ROOT), str(clone)], home, env)[0]
        for name, cmd in (
            ("fedseq data download fmnist", ["fedseq", "data", "download", "fmnist", "--from",
                                             str(args.data_from.resolve()), "-q"]),
            ("fedseq-sim quickstart", ["fedseq-sim", "--config", "examples/quickstart.toml",
                                       "--out", "runs/first", *threads]),
            ("fedseq-server start --local-devices 3",
             ["fedseq-server", "start", "--config", "examples/quickstart.toml",
              "--local-devices", "3", "--out", "runs/first-fleet"]),
            ("fedseq report", ["fedseq", "report", "runs/first", "runs/first-fleet", "--out",
                               "report"]),
        ):
            total += step(name, cmd, clone, env)[0]
    finally:
        for p in neighbours:
            p.terminate()
        if args.keep:
            print(f"kept: {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    print(f"total {total:.1f} s", flush=True)


if __name__ == "__main__":
    main()
