"""What a fleet of N devices costs the coordinator and the broker: synthetic devices
(bench/synthetic.py) on a Mosquitto started from the project's broker.conf and ACL, one login
per device, against the real coordinator (run_deployment) in this process.

    python bench/fleet.py [--devices 10 100 300 1000] [--rounds 4] [--model convnet mobilenet]
                          [--pace 0.05] [--spread 0] [--nofile 0] [--data-root ../shared/data]
                          [--wire none int8 topk ...]

Each (model, N) runs in a fresh child process with a fresh broker: N devices of 3 logical clients
each (3N clients, IID), join ratio 0.2, FedAvg (every block changes every round: the most bytes),
`--pace` seconds per client on the devices, so a device with k clients in a round answers k x pace
after it holds the round's weights (all devices at once: a burst; with `--spread S` each device
has its own pace, between pace and pace x (1 + S), so the answers come over a while). Printed
per (model, N), rounds after the first:

- round_s: wall time of a training round (step out to last update folded in); beyond_pace_s:
  that minus the slowest participating device's own pace (its clients x pace), i.e. what the
  transport and the coordinator add; goal: at most 50 ms + 1 ms per participating device
- coord_cpu_ms: the coordinator process's CPU per round (all its threads: paho's network thread,
  the round loop, aggregation); broker_cpu_ms likewise for Mosquitto; loop_cpu_ms: the part
  of coord_cpu_ms spent by the round loop (checking, folding, the norm; the rest is paho's
  network thread: reading, reassembling and hashing frames); cpu_per_update_ms: coord_cpu_ms
  over the round's updates (Linux counts CPU in 10 ms ticks: read these over several rounds)
- assign_ms (publishing the run config, every assignment and the model once), step_ms (from the
  round loop's dispatch until the step is published: waiting for devices, publishing the changed
  blocks and the step)
- coord_rss_mb / broker_rss_mb: peak resident memory (VmHWM) of the coordinator's process and of
  Mosquitto over the whole run; broker_mb_round: bytes Mosquitto read and wrote per round (its
  /proc io counters: every socket byte)
- lost: selected clients whose update did not count, over all rounds (goal 0)
- status_s: `fedseq-server status` against the fleet's retained statuses (--status)
- wire: the updates' codec (`--wire`: wire.up, e.g. `int8`, `topk:0.01`; the synthetic devices
  encode their updates in it and the coordinator checks and decodes them); mb_per_update: an
  update's frame in MB (bytes_up over the updates); cpu_per_mb_ms: cpu_per_update_ms over it

The devices run in processes of 250 beside the coordinator and the broker on the same cores: on
a 2-core machine, wall times include that contention; CPU figures do not.
`--nofile 1024` starts Mosquitto under the soft file-descriptor limit systemd gives a service by
default (what Debian's mosquitto.service runs with unless the drop-in raises it).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PER_PROCESS = 250
SEED = 0  # the synthetic devices' --seed: their paces under --spread (device_pace)
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, main_thread: bool = False) -> float:
    """CPU seconds of a process, or of its main thread alone (in the coordinator: the round
    loop)."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def io_bytes(pid: int) -> int:
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["rchar"]) + int(io["wchar"])


def start_broker(tmp: Path, names: list[str], nofile: int) -> tuple[subprocess.Popen, int]:
    """Mosquitto from broker.conf with the project's ACL, one account per name."""
    from fedseq.server.ops.broker import free_port, write_local_mosquitto

    port = free_port()
    conf = write_local_mosquitto(tmp, port, {n: f"secret-{n[:5]}" for n in names},
                                 ROOT / "broker.conf", ROOT / "deploy" / "mosquitto" / "fedseq.acl",
                                 getpass.getuser(), log_file=tmp / "broker.log")
    cmd = [shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)]
    if nofile:
        cmd = ["prlimit", f"--nofile={nofile}:{max(nofile, 4096)}", *cmd]
    proc = subprocess.Popen(cmd)
    time.sleep(0.5)
    return proc, port


def one(args: argparse.Namespace) -> dict:
    """One (model, N) in this process: broker, synthetic devices, the coordinator's run."""
    from synthetic import device_name, device_pace  # bench/, this script's folder

    from fedseq.common.config import load_config
    from fedseq.server.ops.deployment import run_deployment
    from fedseq.server.pools.mqtt import MqttPool
    from fedseq.server.rounds.pool_api import TrainRound

    n = args.n
    timing: dict[str, list[float]] = {"round": [], "cpu": [], "loop_cpu": [], "broker_cpu": [],
                                      "step": [], "io": [], "pace": [], "updates": []}
    assign: list[float] = []
    broker_pid: list[int] = []
    me = os.getpid()

    class TimedPool(MqttPool):
        def open(self, weights, personal):
            t = time.perf_counter()
            super().open(weights, personal)
            assign.append(time.perf_counter() - t)

        def _publish_step(self, **fields):
            step = super()._publish_step(**fields)
            if fields.get("kind") == "train":
                timing["step"].append(time.perf_counter() - self._t0)
            return step

        def train(self, round, clients, plan, weights, check, enough=None):
            self._t0 = start = time.perf_counter()
            cpu0, bcpu0, io0 = cpu_s(me), cpu_s(broker_pid[0]), io_bytes(broker_pid[0])
            loop0 = cpu_s(me, main_thread=True)
            load: dict[str, int] = {}
            for c in clients:
                load[self.owner[c]] = load.get(self.owner[c], 0) + 1
            inner = super().train(round, clients, plan, weights, check, enough)

            def timed():
                yield from inner
                timing["round"].append(time.perf_counter() - start)
                timing["cpu"].append(cpu_s(me) - cpu0)
                timing["loop_cpu"].append(cpu_s(me, main_thread=True) - loop0)
                timing["updates"].append(len(inner.outcome.reporters))
                timing["broker_cpu"].append(cpu_s(broker_pid[0]) - bcpu0)
                timing["io"].append(io_bytes(broker_pid[0]) - io0)
                timing["pace"].append(max(k * device_pace(args.pace, args.spread, SEED, d)
                                          for d, k in load.items()))
                return inner.outcome

            return TrainRound(timed())

    import fedseq.server.ops.deployment as dep

    dep.MqttPool = TimedPool  # type: ignore[misc]
    names = [device_name("synth", i) for i in range(1, n + 1)]
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        broker, port = start_broker(tmp, ["coordinator", *names], args.nofile)
        broker_pid.append(broker.pid)
        url = f"mqtt://127.0.0.1:{port}"
        (tmp / "coordinator.pw").write_text("secret-coord\n")
        (tmp / "synth.pw").write_text("secret-synth\n")
        procs = []
        try:
            started = time.perf_counter()
            for first in range(1, n + 1, PER_PROCESS):
                procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve().parent / "synthetic.py"), "--broker", url,
                     "--prefix", "synth", "--first", str(first),
                     "--count", str(min(PER_PROCESS, n + 1 - first)),
                     "--password-file", str(tmp / "synth.pw"), "--data-dir", args.data_root,
                     "--pace", str(args.pace), "--spread", str(args.spread),
                     "--seed", str(SEED)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"}))
            connected = [p.stdout.readline().strip() for p in procs if p.stdout is not None]
            connect_s = time.perf_counter() - started
            if not all(line.startswith("ready") for line in connected):
                raise SystemExit(f"synthetic devices did not all connect: {connected}")
            cfg = load_config(None, [
                f"data.root={args.data_root!r}", "data.dataset=fmnist", "data.partition='iid'",
                f"data.num_clients={3 * n}", f"model.name={args.model!r}", "algorithm.name=fedavg",
                "algorithm.finetune_epochs=0", f"rounds={args.rounds}", "train.join_ratio=0.2",
                f"train.eval_every={100 * args.rounds}", f"deploy.min_devices={n}",
                "deploy.wait_devices_s=120", "deploy.username=coordinator",
                f"deploy.round_timeout_max_s={args.timeout}",
                f"deploy.password_file={str(tmp / 'coordinator.pw')!r}",
                *wire_sets(args.wire)])
            out = tmp / "run"
            try:
                res = run_deployment(cfg, out, broker=url, announce=lambda s: None)
            finally:
                dropped = (tmp / "broker.log").read_text().count("are being dropped")
            rows = [r for r in res.records if r.phase == "train"]
            lost = sum(len(set(r.clients) - set(r.reported)) for r in rows)
            status_s = None
            if args.status:
                t = time.perf_counter()
                subprocess.run([str(Path(sys.executable).parent / "fedseq-server"), "status",
                                "--broker", url,
                                "--username", "coordinator", "--password-file",
                                str(tmp / "coordinator.pw")], check=True,
                               stdout=subprocess.DEVNULL)
                status_s = time.perf_counter() - t
            coord_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            broker_rss = hwm_mb(broker.pid)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
            broker.terminate()
            broker.wait(10)
    later = slice(1, None)  # round 0 includes first-time costs (model build, warm caches)
    med = {k: statistics.median(v[later]) if len(v) > 1 else float("nan")
           for k, v in timing.items()}
    participating = statistics.median(len({o for o in r.reporters.values()}) for r in rows[1:])
    mb_update = sum(r.bytes_up for r in rows[1:]) / 1e6 / sum(timing["updates"][later])
    return {"model": args.model, "devices": n, "participating": participating,
            "round_s": med["round"], "beyond_pace_s": med["round"] - med["pace"],
            "goal_s": 0.05 + 0.001 * participating, "coord_cpu_ms": 1000 * med["cpu"],
            "loop_cpu_ms": 1000 * med["loop_cpu"],
            "cpu_per_update_ms": 1000 * sum(timing["cpu"][later]) / sum(timing["updates"][later]),
            "wire": args.wire, "mb_per_update": mb_update,
            "cpu_per_mb_ms": 1000 * sum(timing["cpu"][later]) / sum(timing["updates"][later])
            / mb_update,
            "broker_cpu_ms": 1000 * med["broker_cpu"], "assign_ms": 1000 * assign[0],
            "step_ms": 1000 * med["step"], "coord_rss_mb": coord_rss, "broker_rss_mb": broker_rss,
            "broker_mb_round": med["io"] / 1e6, "lost": lost, "broker_drops": dropped, "connect_s": connect_s,
            "status_s": status_s}


def wire_sets(wire: str) -> list[str]:
    """The config lines of an updates' codec given as `int8` or `topk:0.01`."""
    name, _, fraction = wire.partition(":")
    return [f"wire.up={name!r}"] + ([f"wire.topk={fraction}"] if fraction else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, nargs="+", default=[10, 100, 300, 1000])
    ap.add_argument("--model", nargs="+", default=["convnet"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--pace", type=float, default=0.05)
    ap.add_argument("--spread", type=float, default=0.0)
    ap.add_argument("--nofile", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120,
                    help="deploy.round_timeout_max_s: a round waits at most this long")
    ap.add_argument("--status", action="store_true", help="time fedseq-server status too")
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--wire", nargs="+", default=["none"],
                    help="updates' codecs to compare: none fp16 bf16 int8 topk:FRACTION")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        args.n, args.model, args.wire = args.one, args.model[0], args.wire[0]
        print(json.dumps(one(args)), flush=True)
        return
    cols = ["model", "wire", "devices", "participating", "round_s", "beyond_pace_s", "goal_s",
            "coord_cpu_ms", "loop_cpu_ms", "cpu_per_update_ms", "broker_cpu_ms", "assign_ms",
            "step_ms", "coord_rss_mb", "broker_rss_mb", "broker_mb_round", "lost", "broker_drops",
            "connect_s", "status_s", "mb_per_update", "cpu_per_mb_ms"]
    print(" | ".join(cols))
    for model, wire, n in ((m, w, n) for m in args.model for w in args.wire for n in args.devices):
        cmd = [sys.executable, __file__, "--one", str(n), "--model", model, "--wire", wire,
               "--rounds", str(args.rounds), "--pace", str(args.pace),
               "--spread", str(args.spread),
               "--nofile", str(args.nofile), "--timeout", str(args.timeout),
               "--data-root", args.data_root]
        if args.status:
            cmd.append("--status")
        got = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if got.returncode != 0:
            print(f"{model} | {n} | failed (exit {got.returncode})", flush=True)
            continue
        r = json.loads(got.stdout.strip().splitlines()[-1])
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])
                         for c in cols), flush=True)


if __name__ == "__main__":
    main()
