"""Advance several long runs in turn, a few rounds each, so they progress level and can be left
and continued at any time (every round is checkpointed; a later call resumes each run).

    python bench/advance_runs.py --config examples/fmnist-testbed.toml --out runs/testbed \\
        --step 5 --until 100 --threads 1 fedavg fedbabu fedreg fedseq-vanilla fedseq-anti

Each run is `OUT/<algorithm>/`, a normal fedseq-sim run directory with rounds = --until (so its
schedule, e.g. FedSeq's t_k, is the full run's). Fine-tuning happens when a run reaches --until.
Extra `--set KEY=VALUE` apply to every run (`--set seed=1` for another seed; one algorithm
under several seeds in one command is `fedseq-sim --seeds 0-2`: docs/explanation/reproducibility.md).
Stop with Ctrl-C; call again to continue. `--once` advances each run by --step rounds and stops: the first
rounds of the full schedule (docs/results.md, "Wire codecs": --step 11 --once).

Several processes may share one set of runs (one per core, `taskset -c N`): each takes, --step
rounds at a time, the unfinished run that no other process holds (a lock file in its directory)
with the fewest rounds done, so the cores stay busy until the last run ends however unequal the
algorithms' costs. A process exits when every unfinished run is held by another.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
from pathlib import Path

from fedseq.common.config import load_config
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.rounds.coordinator import RunPaused
from fedseq.server.rounds.rundir import stop_on_sigterm


def rounds_done(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    if not metrics.exists():
        return 0
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return sum(1 for r in rows if r.get("phase") == "train")


def finished(out: Path) -> bool:
    status = out / "status.json"
    return status.exists() and json.loads(status.read_text()).get("state") == "finished"


def advance(config: Path, out: Path, alg: str, until: int, step: int, sets: list[str],
            threads: int) -> None:
    cfg = load_config(config, [*sets, f"algorithm.name={alg}", f"rounds={until}",
                               f"train.threads={threads}"])
    start = rounds_done(out)
    mode = "resume" if (out / "checkpoint.safetensors").exists() else "overwrite"
    with contextlib.suppress(RunPaused):
        run_simulation(cfg, out, mode=mode, info={"command": " ".join(sys.argv)},
                       pause_after=start + step)
    print(f"{alg}: {rounds_done(out)}/{until} rounds", flush=True)


@contextlib.contextmanager
def claim(out: Path):
    """Hold OUT/.advance.lock while advancing it; yield False if another process holds it."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".advance.lock", "w") as f:  # closing it releases the lock
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = False
        else:
            held = True
        yield held


def advance_one(a: argparse.Namespace, todo: list[str]) -> bool:
    """Advance the least advanced run no other process holds; False if every one is held."""
    for alg in sorted(todo, key=lambda alg: rounds_done(a.out / alg)):
        with claim(a.out / alg) as mine:
            if mine and not finished(a.out / alg):
                advance(a.config, a.out / alg, alg, a.until, a.step, a.sets, a.threads)
                return True
    return False


def main() -> None:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--until", type=int, default=100)
    ap.add_argument("--step", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--once", action="store_true",
                    help="advance each run by --step rounds once, then stop (the first rounds of "
                         "a long schedule: --step 11 --once)")
    ap.add_argument("algorithms", nargs="+")
    a = ap.parse_args()
    if a.once:
        for alg in a.algorithms:
            if not finished(a.out / alg):
                advance(a.config, a.out / alg, alg, a.until, a.step, a.sets, a.threads)
        return
    while True:
        todo = [alg for alg in a.algorithms if not finished(a.out / alg)]
        if not todo or not advance_one(a, todo):
            break


if __name__ == "__main__":
    main()
