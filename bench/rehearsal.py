"""Seconds per round of FedAvg and FedSeq-Vanilla/-Anti on the FedReG testbed's ConvNet with ten
local devices behind each link profile (a rehearsal: network namespaces and tc; needs root).

    sudo python bench/rehearsal.py [--profiles none,wifi-good,wifi-poor,lte] [--rounds 4]
                                   [--devices 10] [--set key=value ...]

The testbed config (examples/fmnist-testbed.toml: 30 clients, join 0.2, ConvNet) with less local
work by default (data.fraction 0.2, 1 local epoch, evaluation only after the last round), so that
transfer time is visible beside training on a 2-core machine. Round 0 carries every device's
first download of the whole model; later rounds carry what each algorithm changes, which is where
FedSeq's byte savings can appear as time. Prints one row per profile and algorithm: round 0's
seconds, the later rounds' mean seconds, their mean MB under the per-client definition of
bytes_down + bytes_up (a client's first download of the model counts), and their mean wire MB
(what the coordinator's connection published and received: blocks once per version, fanned out
by the broker).

Its figures of issue 18 were taken on the embedded amqtt. amqtt drops what a device does not
acknowledge within 5 s (docs/rehearsal.md), which wifi-poor's 2 Mbit/s can exceed: add
`--set deploy.embedded_broker='"mosquitto"'` to rehearse slow links on the run's Mosquitto.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fedseq.common.config import load_config
from fedseq.server.ops import rehearsal as rh
from fedseq.server.ops.deployment import run_deployment
from fedseq.server.ops.local_fleet import local_device_names
from fedseq.server.rounds import links as ln

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="none,wifi-good,wifi-poor,lte")
    ap.add_argument("--algorithms", default="fedavg,fedseq-vanilla,fedseq-anti")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    names = local_device_names(args.devices)
    print(f"{'profile':<10} {'algorithm':<15} {'round 0 s':>9} {'later s':>8} {'later MB':>9} "
          f"{'wire MB':>8}  emulation")
    for profile in args.profiles.split(","):
        for alg in args.algorithms.split(","):
            cfg = load_config(ROOT / "examples" / "fmnist-testbed.toml", [
                f"algorithm.name={alg}", f"rounds={args.rounds}", "data.fraction=0.2",
                "train.local_epochs=1", "train.eval_every=1000", "train.threads=1",
                "deploy.port=0", f"deploy.min_devices={args.devices}",
                "algorithm.finetune_epochs=1",
                # the testbed's 100-round schedule (blocks unfrozen at 0/25/50/75): its first
                # rounds, not the whole schedule squeezed into --rounds
                "algorithm.unfreeze_rounds=[0, 25, 50, 75]", *args.overrides])
            links = {} if profile == "none" else {d: ln.parse_profile(profile) for d in names}
            with tempfile.TemporaryDirectory() as tmp, rh.Rehearsal(names, links) as r:
                start = time.monotonic()
                run_deployment(cfg, Path(tmp) / "run", local_devices=args.devices,
                               client_threads=1, announce=lambda s: None, rehearsal=r)
                rows = [__import__("json").loads(x) for x in
                        (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
                emulation = "netem" if r.netem else "tbf rate only"
            train = [x for x in rows if x["phase"] == "train"]
            later = train[1:]
            mb = statistics.mean((x["bytes_down"] + x["bytes_up"]) / 1e6 for x in later)
            wire = statistics.mean((x["wire_bytes_out"] + x["wire_bytes_in"]) / 1e6 for x in later)
            print(f"{profile:<10} {alg:<15} {train[0]['seconds']:>9.1f} "
                  f"{statistics.mean(x['seconds'] for x in later):>8.1f} {mb:>9.2f} {wire:>8.2f}  "
                  f"{emulation if profile != 'none' else '-'} "
                  f"(run {time.monotonic() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
