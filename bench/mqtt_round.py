"""Round overhead of the MQTT deployment: 10 device processes, the CNN, loopback broker.

Round overhead = the training exchange's wall time (publish changed blocks and the step, until
the last update is in) minus the slowest client's own training time. Also prints the bytes a
FedSeq-Vanilla first-stage round moves relative to a FedAvg round.

    python bench/mqtt_round.py [--devices 10] [--rounds 8] [--broker mosquitto|amqtt]

References on this machine kind (issue 3): bare paho + Mosquitto exchange of the 2.3 MB model with
10 clients 70-130 ms median; the same over amqtt ~390 ms; one Flower 1.41 round ~180-210 ms.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from fedseq.common.config import load_config
from fedseq.server.broker import free_port
from fedseq.server.deployment import run_deployment
from fedseq.server.mqtt_pool import MqttPool

ROOT = Path(__file__).resolve().parent.parent
TIMES: list[tuple[float, float]] = []  # (exchange wall s, slowest client training s)


class TimedPool(MqttPool):
    def train(self, round, clients, plan, weights, check):
        start = time.perf_counter()
        updates = list(super().train(round, clients, plan, weights, check))
        wall = time.perf_counter() - start
        TIMES.append((wall, max((u.train_seconds for u in updates), default=0.0)))
        yield from updates


def start_mosquitto(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    conf = tmp / "bench.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_packet_size 2097152\n"
                    "set_tcp_nodelay true\npersistence false\nlog_dest none\n")
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)])
    time.sleep(0.5)
    return proc, f"mqtt://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--broker", choices=["mosquitto", "amqtt"], default="mosquitto")
    ap.add_argument("--batch-size", type=int, default=1000,
                    help="1000 = one training step per client, close to the references' no-op rounds")
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args()
    import fedseq.server.deployment as dep

    dep.MqttPool = TimedPool  # type: ignore[misc]
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_mosquitto(Path(tmp)) if args.broker == "mosquitto" else (None, None)
        try:
            results = {}
            first_stage = ["algorithm.unfreeze_rounds=[0,1000,2000]"]
            for alg, extra in (("fedavg", []), ("fedseq-vanilla", first_stage)):
                TIMES.clear()
                cfg = load_config(None, [
                    f"data.root={args.data_root!r}", "data.dataset=fmnist", "data.fraction=0.02",
                    f"data.num_clients={args.devices}", "data.alpha=0.5", "data.min_samples=20",
                    f"rounds={args.rounds}", "train.join_ratio=1.0", "train.local_epochs=1",
                    f"train.batch_size={args.batch_size}",
                    f"train.eval_every={10 * args.rounds}", f"algorithm.name={alg}",
                    "algorithm.finetune_epochs=0", "deploy.port=0", *extra])
                res = run_deployment(cfg, None, broker=url, local_clients=args.devices,
                                     announce=lambda s: None, client_threads=1)
                rows = [r for r in res.rows if r["phase"] == "train"]
                overhead = [1000 * (w - s) for w, s in TIMES[1:]]  # round 0 includes warm-up
                results[alg] = rows
                print(f"{alg}: exchange overhead per round (ms), rounds 1..: "
                      + ", ".join(f"{o:.0f}" for o in overhead))
                print(f"{alg}: median overhead {statistics.median(overhead):.0f} ms, "
                      f"slowest client training median "
                      f"{1000 * statistics.median(s for _, s in TIMES[1:]):.0f} ms, bytes/round "
                      f"down {statistics.median(r['bytes_down'] for r in rows[1:]):,.0f} "
                      f"up {statistics.median(r['bytes_up'] for r in rows[1:]):,.0f}")
            avg = results["fedavg"][1:]
            seq = results["fedseq-vanilla"][1:]
            ratio = (statistics.median(r["bytes_down"] + r["bytes_up"] for r in seq)
                     / statistics.median(r["bytes_down"] + r["bytes_up"] for r in avg))
            print(f"FedSeq-Vanilla first-stage round moves {100 * ratio:.3f}% of a FedAvg round's bytes")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
