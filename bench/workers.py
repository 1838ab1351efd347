"""fedseq-sim in one process against fedseq-sim --workers N, on the same machine in one run.

For each workload, a few rounds of: in-process with 1 torch thread, in-process with all cores'
threads, and `--workers N` (1 thread each; default N = the cores). Per mode: seconds per round
(training rounds only: evaluation happens only in the last round, which is not timed),
training samples per second and client steps (local optimizer steps) per second; for the workers,
the overhead per round beside the training: the step's wall time on rank 0 from broadcast to
gathered answers minus its busiest worker's compute.

Workloads: `peers` is issue 33's comparison with Flower and pfl-research (FedAvg, the FedSeq/PFLlib
CNN, Fashion-MNIST, 30 IID clients of 2,000 training images, 6 a round, 1 local epoch, batch 20,
SGD lr 0.01); `testbed` is examples/fmnist-testbed.toml with FedAvg; `fedseq-mnist` is
examples/mnist-fedseq.toml (FedSeq Anti, 100 clients, 10 a round).

With --flower-python / --pfl-python (a Python of a venv that has Flower 1.42 with Ray, or
pfl-research 0.6 with torch), the peers workload also runs on Flower's simulation engine
(bench/flower_peer.py: Ray, one CPU per client, as many actors as --workers) and on pfl-research
under torchrun (bench/pfl_peer.py: --workers processes, one thread each), in the same run, with
the same rounds timed.

    python bench/workers.py [--rounds 4] [--workers 2] [--workloads peers testbed fedseq-mnist]
                            [--flower-python /tmp/flwr/bin/python] [--pfl-python /tmp/pfl/bin/python]
    python bench/workers.py --gpu-per 1 2 4 8 ...   # on a GPU machine: the GPU scaling curve
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from fedseq.common.config import load_config
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.rounds.experiment import load_experiment
from fedseq.server.rounds.records import RoundRecord

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "peers": (None, ["algorithm.name=fedavg", "model.name=cnn", "data.dataset=fmnist",
                     "data.partition=iid", "data.num_clients=30", "data.train_fraction=0.8571429",
                     "train.join_ratio=0.2", "train.local_epochs=1", "train.batch_size=20",
                     "train.lr=0.01", "train.momentum=0.0"]),
    "testbed": (ROOT / "examples" / "fmnist-testbed.toml", ["algorithm.name=fedavg"]),
    "fedseq-mnist": (ROOT / "examples" / "mnist-fedseq.toml", []),
}


def measure(cfg, workers: int, train_rows: dict[int, int], per_gpu: int = 0) -> dict[str, float]:
    rows: list[RoundRecord] = []
    pool_timings: list = []
    distributed_run = bool(workers or per_gpu)
    if distributed_run:
        from fedseq.server.pools import distributed

        real = distributed.DistributedPool.__init__

        def keep(self, *a, **k):
            real(self, *a, **k)
            pool_timings.append(self.timings)

        distributed.DistributedPool.__init__ = keep  # type: ignore[method-assign]
    try:
        run_simulation(cfg, None, on_round=rows.append, workers=workers, workers_per_gpu=per_gpu)
    finally:
        if distributed_run:
            distributed.DistributedPool.__init__ = real  # type: ignore[method-assign]
    timed = [r for r in rows if r.phase == "train"][1:-1]  # not the first (warm-up), not the last (evaluates)
    seconds = sum(r.seconds or 0 for r in timed)
    samples = sum(train_rows[c] for r in timed for c in r.reported) * cfg.train.local_epochs
    out = {"s/round": seconds / len(timed), "samples/s": samples / seconds,
           "steps/s": sum(r.client_steps or 0 for r in timed) / seconds}
    if distributed_run:
        trains = [t for t in pool_timings[0] if t.kind == "train"][1:-1]
        out["overhead s/round"] = statistics.fmean(t.wall_s - t.busiest_s for t in trains)
        out["busiest s/round"] = statistics.fmean(t.busiest_s for t in trains)
    return out


def peer(command: list[str], rounds: int) -> dict[str, float]:
    """A peer framework's run of the peers workload (bench/flower_peer.py, bench/pfl_peer.py):
    its rounds 1..rounds-2 timed, as fedseq's (the first is its warm-up)."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"{command[0]} failed: {done.stderr[-2000:]}")
    got = json.loads(lines[-1])
    timed = got["round_s"][1:rounds - 1]
    seconds = statistics.fmean(timed)
    return {"s/round": seconds, "samples/s": got["samples_per_round"] / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--flower-python", help="a Python with flwr[simulation] 1.42 (peers workload)")
    ap.add_argument("--pfl-python", help="a Python with pfl[pytorch] 0.6 (peers workload)")
    ap.add_argument("--gpu-per", type=int, nargs="*", default=[],
                    help="on a GPU machine: the in-process GPU run, then --workers-per-gpu K for "
                         "each K given (e.g. 1 2 4 8), instead of the CPU modes")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    print(f"torch {torch.__version__}, {cores} cores, load {os.getloadavg()[0]:.2f}")
    for name in args.workloads:
        path, over = WORKLOADS[name]
        base = [f"data.root={args.data_root!r}", f"rounds={args.rounds}",
                f"train.eval_every={args.rounds}", "algorithm.finetune_epochs=0"]
        cfg = load_config(path, base + over)
        exp = load_experiment(cfg)
        train_rows = {c.client: len(c.train) for c in exp.data.clients}
        del exp
        print(f"\n{name}: {cfg.algorithm.name}, {cfg.model.name}, {cfg.data.dataset}, "
              f"{cfg.data.num_clients} clients, {cfg.clients_per_round()} a round, "
              f"{cfg.train.local_epochs} epochs, batch {cfg.train.batch_size}; rounds 1-"
              f"{args.rounds - 2} timed")
        results = {}
        modes = [("in-process, 1 thread", 1, 0, 0, "cpu"),
                 (f"in-process, {cores} threads", cores, 0, 0, "cpu"),
                 (f"--workers {args.workers}, 1 thread each", 1, args.workers, 0, "cpu")]
        if args.gpu_per:  # the GPU curve: one process on the GPU, then K workers a GPU
            modes = [("in-process on cuda, 1 thread", 1, 0, 0, "cuda")] + [
                (f"--workers-per-gpu {k}", 1, 0, k, "cuda") for k in args.gpu_per]
        for label, threads, workers, per_gpu, device in modes:
            torch.set_num_threads(threads)
            run_cfg = load_config(path, base + over + [f"train.threads={threads}",
                                                       f"train.device={device!r}"])
            start = time.perf_counter()
            results[label] = r = measure(run_cfg, workers, train_rows, per_gpu)
            extra = (f", overhead {1000 * r['overhead s/round']:.0f} ms/round "
                     f"({100 * r['overhead s/round'] / r['s/round']:.1f}% of the round; busiest "
                     f"worker {r['busiest s/round']:.2f} s)") if workers or per_gpu else ""
            print(f"  {label:28s} {r['s/round']:6.2f} s/round  {r['samples/s']:7,.0f} samples/s  "
                  f"{r['steps/s']:6.1f} steps/s{extra}  [{time.perf_counter() - start:.0f} s]",
                  flush=True)
        first = next(iter(results))
        one = results[first]["samples/s"]
        for label, r in results.items():
            print(f"  {label:28s} x{r['samples/s'] / one:.2f} the rate of '{first}'")
        if name != "peers" or args.gpu_per:
            continue
        here = Path(__file__).resolve().parent
        peers = {}
        if args.flower_python:
            peers[f"Flower 1.42, Ray, {args.workers} actors"] = [
                args.flower_python, str(here / "flower_peer.py"), args.data_root,
                str(args.rounds), str(args.workers)]
        if args.pfl_python:
            peers[f"pfl-research, torchrun x{args.workers}"] = [
                args.pfl_python, "-m", "torch.distributed.run", "--nproc-per-node",
                str(args.workers), str(here / "pfl_peer.py"), args.data_root, str(args.rounds)]
        ours = results[f"--workers {args.workers}, 1 thread each"]["samples/s"]
        for label, command in peers.items():
            start = time.perf_counter()
            r = peer(command, args.rounds)
            print(f"  {label:28s} {r['s/round']:6.2f} s/round  {r['samples/s']:7,.0f} samples/s"
                  f"  (--workers {args.workers} x{ours / r['samples/s']:.2f} its rate)"
                  f"  [{time.perf_counter() - start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
