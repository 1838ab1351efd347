"""Round overhead of the MQTT deployment: 10 device processes, the CNN, loopback broker.

Round overhead = the training exchange's wall time (publish changed blocks and the step, until
the last update is in and aggregated) minus the slowest client's own computation (training and
its local score). Also prints the bytes a FedSeq-Vanilla first-stage round moves relative to a
FedAvg round.

    python bench/mqtt_round.py [--devices 10] [--rounds 8] [--broker mosquitto|amqtt]

Also prints the CPU time each side spent per round (from /proc): with 10 device processes on a
2-core machine the devices' own work competes with the coordinator's, so the overhead is mostly
CPU contention; `--devices 1` shows one device's exchange on an otherwise idle machine. (CPU
times come in 10 ms ticks: small figures, even negative differences, are within that.)

References on this machine kind (issue 3): bare paho + Mosquitto exchange of the 2.3 MB model with
10 clients 70-130 ms median; the same over amqtt ~390 ms; one Flower 1.41 round ~180-210 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from fedseq.common.config import load_config
from fedseq.server.ops.broker import free_port
from fedseq.server.ops.deployment import run_deployment
from fedseq.server.pools.mqtt import MqttPool
from fedseq.server.rounds.pool_api import TrainRound

ROOT = Path(__file__).resolve().parent.parent
TIMES: list[tuple[float, float]] = []  # (exchange wall s, slowest client computation s)
CPU: list[dict[str, float]] = []  # per round: CPU seconds of the coordinator, devices, broker
BROKER_PID: list[int] = []
TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds: utime + stime) from /proc/PID/stat; (-1, 0.0) once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return -1, 0.0


def cpu_now() -> dict[str, float]:
    me = os.getpid()
    stats = {int(p): proc_stat(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    kids = [p for p, (parent, _) in stats.items() if parent == me]
    return {"coordinator": stats[me][1],
            "devices": sum(stats[p][1] for p in kids if p not in BROKER_PID),
            "broker": sum(stats[p][1] for p in BROKER_PID if p in stats)}


class TimedPool(MqttPool):
    def train(self, round, clients, plan, weights, check, enough=None):
        # Updates are consumed (aggregated) as they stream in, as in a real run.
        before = cpu_now()
        start = time.perf_counter()
        inner = super().train(round, clients, plan, weights, check, enough)

        def timed():
            slowest = 0.0
            for u in inner:
                slowest = max(slowest, u.train_seconds)
                yield u
            TIMES.append((time.perf_counter() - start, slowest))
            after = cpu_now()
            CPU.append({k: after[k] - before[k] for k in after})
            return inner.outcome

        return TrainRound(timed())


def start_mosquitto(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    conf = tmp / "bench.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_packet_size 2097152\n"
                    "set_tcp_nodelay true\npersistence false\nlog_dest none\n")
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)])
    BROKER_PID.append(proc.pid)
    time.sleep(0.5)
    return proc, f"mqtt://127.0.0.1:{port}"


def training_cpu(cfg) -> float:
    """CPU seconds the round's local work (training and local scoring) of all clients takes at
    one thread, measured in this process: what the devices would spend with no transport."""
    import torch

    from fedseq.common.models import get_blocks
    from fedseq.common.training import run_client_round
    from fedseq.server.rounds.experiment import load_experiment

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    exp = load_experiment(cfg)
    data, model = exp.data, exp.model
    exp.algorithm.prepare([len(c.train) for c in data.clients])
    plan = exp.algorithm.plan(1)
    weights = get_blocks(model, model.spec.blocks)
    run_client_round(model, weights, plan, data, data.clients[0], cfg.seed, 1)  # warm-up
    runs = []
    for _ in range(3):
        start = time.process_time()
        for shard in data.clients:
            run_client_round(model, weights, plan, data, shard, cfg.seed, 1)
        runs.append(time.process_time() - start)
    torch.set_num_threads(threads)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--broker", choices=["mosquitto", "amqtt"], default="mosquitto")
    ap.add_argument("--batch-size", type=int, default=1000,
                    help="1000 = one training step per client, close to the references' no-op rounds")
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args()
    import fedseq.server.ops.deployment as dep

    dep.MqttPool = TimedPool  # type: ignore[misc]
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_mosquitto(Path(tmp)) if args.broker == "mosquitto" else (None, None)
        try:
            results = {}
            first_stage = ["algorithm.unfreeze_rounds=[0,1000,2000]"]
            for alg, extra in (("fedavg", []), ("fedseq-vanilla", first_stage)):
                TIMES.clear()
                CPU.clear()
                cfg = load_config(None, [
                    f"data.root={args.data_root!r}", "data.dataset=fmnist", "data.fraction=0.02",
                    f"data.num_clients={args.devices}", "data.alpha=0.5", "data.min_samples=20",
                    f"rounds={args.rounds}", "train.join_ratio=1.0", "train.local_epochs=1",
                    f"train.batch_size={args.batch_size}",
                    f"train.eval_every={10 * args.rounds}", f"algorithm.name={alg}",
                    "algorithm.finetune_epochs=0", "deploy.port=0", *extra])
                res = run_deployment(cfg, None, broker=url, local_devices=args.devices,
                                     announce=lambda s: None, client_threads=1)
                rows = [r for r in res.rows if r["phase"] == "train"]
                overhead = [1000 * (w - s) for w, s in TIMES[1:]]  # round 0 includes warm-up
                results[alg] = rows
                print(f"{alg}: exchange overhead per round (ms), rounds 1..: "
                      + ", ".join(f"{o:.0f}" for o in overhead))
                print(f"{alg}: median overhead {statistics.median(overhead):.0f} ms, "
                      f"slowest client computation median "
                      f"{1000 * statistics.median(s for _, s in TIMES[1:]):.0f} ms, bytes/round "
                      f"down {statistics.median(r['bytes_down'] for r in rows[1:]):,.0f} "
                      f"up {statistics.median(r['bytes_up'] for r in rows[1:]):,.0f}")
                cpu = {k: 1000 * statistics.median(c[k] for c in CPU[1:]) for k in CPU[0]}
                local = 1000 * training_cpu(cfg)
                beyond = cpu["coordinator"] + cpu["broker"] + cpu["devices"] - local
                wall = 1000 * statistics.median(w for w, _ in TIMES[1:])
                print(f"{alg}: CPU per round (ms, median): coordinator {cpu['coordinator']:.0f}, "
                      f"broker {cpu['broker']:.0f}, devices {cpu['devices']:.0f} of which local "
                      f"training+scoring {local:.0f} (measured alone at 1 thread); beyond training "
                      f"{beyond:.0f} ms on {os.cpu_count()} cores = {beyond / (os.cpu_count() or 1):.0f}"
                      f" ms of wall if spread evenly; exchange wall {wall:.0f} ms")
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
