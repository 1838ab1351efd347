"""What [secagg] costs on a local fleet: real fedseq-client daemons (local01.., one torch thread
each) on a Mosquitto started from the project's broker.conf and ACL, one login per device, against
the real coordinator (run_deployment) in this process; the testbed's ConvNet and FedAvg on
Fashion-MNIST, every client in every round, the same config with and without [secagg].

    python bench/secagg_fleet.py [--clients 10 30 100] [--devices 5] [--rounds 2] [--drop 0 1]
                                 [--partition dirichlet|iid] [--data-root ../shared/data]
                                 [--secure-up none|int8]

`--secure-up int8`: the secure run masks in the 16-bit ring (wire.up = "int8"), against the
same plain float32 run.

`--drop 1`: in round 0 the last device is killed (SIGKILL) as soon as it has sent its clients'
encrypted shares (plain: as soon as it has the round's step): its clients drop after sharing
their keys (1/devices of them), and the coordinator learns it from the device's last will (the
broker sends it as soon as it sees the connection closed: at once for a killed process on
loopback, 45 s after the link went quiet for a device that vanishes from Wi-Fi, keepalive 30 s);
the round then recovers their masks from their neighbours' shares. Printed per (clients, drop,
plain or secure), over the training rounds:

- round_s: wall seconds of each training round (step out to the model updated, unmasking
  included; after a drop, the next round first waits up to a minute for the killed device)
- up_kb_client: what the coordinator received per client and round (the stages' payloads and
  the masked input, or the plain update), and secure/plain
- coord_cpu_s: this process's CPU per training round (every thread)
- dev_cpu_s: the daemons' CPU per client-round (training included: the secure run's extra over
  the plain one is what the stages and masking cost a device)
- counted: the clients whose update counted, over all rounds; recovered: dropped after sharing

Everything (coordinator, broker, daemons) shares this machine's cores: read wall times with the
load the run had (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet import cpu_s, start_broker  # noqa: E402  (bench/, this script's folder)

ROOT = Path(__file__).resolve().parent.parent


def killer(port: int, secret: str, victim: str, secure: bool, pid: int) -> threading.Thread:
    """Kill `victim`'s daemon once it sent its shares (secure) or got the first train step."""
    import paho.mqtt.client as mqtt

    from fedseq.common.protocol.messages import SecAggMessage, Step
    from fedseq.common.protocol.topics import Topics

    t = Topics()
    done = threading.Event()

    def message(client, userdata, msg):
        if done.is_set() or not msg.payload:
            return
        if secure and msg.topic == t.secagg(victim):
            if SecAggMessage.decode(msg.payload).stage != "shares":
                return
        elif secure or msg.topic != t.step or Step.decode(msg.payload).kind != "train":
            return
        os.kill(pid, signal.SIGKILL)
        done.set()

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-killer")
    c.username_pw_set("coordinator", secret)
    c.on_connect = lambda cl, u, f, rc, p: cl.subscribe([(t.secagg(victim), 1), (t.step, 1)])
    c.on_message = message
    c.connect("127.0.0.1", port)
    c.loop_start()
    th = threading.Thread(target=lambda: (done.wait(600), c.loop_stop()), daemon=True)
    th.start()
    return th


def one(n: int, devices: int, rounds: int, drop: bool, secure: bool, data_root: str,
        partition: str, up: str = "none") -> dict:
    from fedseq.common.config import load_config
    from fedseq.server.ops.deployment import run_deployment, stop_children

    names = [f"local{i + 1:02d}" for i in range(devices)]
    with tempfile.TemporaryDirectory(prefix="secagg-fleet-") as tmp_s:
        tmp = Path(tmp_s)
        broker, port = start_broker(tmp, ["coordinator", *names], 0)
        secret = {u: f"secret-{u[:5]}" for u in ["coordinator", *names]}
        for u, s in secret.items():
            (tmp / f"{u}.pw").write_text(s + "\n")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        daemons = [subprocess.Popen(
            [sys.executable, "-m", "fedseq.client.cli", "--device", d, "--broker",
             f"mqtt://127.0.0.1:{port}", "--data-dir", data_root, "--state-dir",
             str(tmp / "state" / d), "--username", d, "--password-file", str(tmp / f"{d}.pw"),
             "--threads", "1", "--log-level", "ERROR"], env=env) for d in names]
        cfg = load_config(ROOT / "examples" / "fmnist-testbed.toml", [
            f"data.root={data_root!r}", f"data.num_clients={n}", "data.fraction=0.2",
            "data.min_samples=20", f"data.partition={partition!r}", f"rounds={rounds}",
            "train.join_ratio=1.0",
            "train.local_epochs=1", "train.threads=1", "train.eval_every=1000",
            "algorithm.name=fedavg", "algorithm.finetune_epochs=0",
            f"secagg.enabled={'true' if secure else 'false'}", f"wire.up={up!r}",
            f"deploy.min_devices={devices}", "deploy.wait_devices_s=60",
            "deploy.round_timeout_s=600", "deploy.round_timeout_min_s=60",
            "deploy.username='coordinator'", f"deploy.password_file={str(tmp / 'coordinator.pw')!r}"])
        if drop:
            killer(port, secret["coordinator"], names[-1], secure, daemons[-1].pid)
        cpu: list[float] = []
        before = [cpu_s(p.pid) for p in daemons]
        try:
            res = run_deployment(cfg, None, broker=f"mqtt://127.0.0.1:{port}",
                                 announce=lambda s: None,
                                 on_round=lambda row: cpu.append(time.process_time()))
            dev = sum(cpu_s(p.pid) - b for p, b in zip(daemons, before, strict=True) if p.poll() is None)
        finally:
            stop_children(daemons)
            broker.terminate()
            broker.wait(10)
    train = [r for r in res.rows if r["phase"] == "train"]
    steps = [b - a for a, b in zip(cpu, cpu[1:], strict=False)]
    client_rounds = sum(len(r["clients"]) for r in train)
    return {"round_s": [r["seconds"] for r in train],
            "up_kb_client": sum(r["bytes_up"] for r in train) / client_rounds / 1024,
            "coord_cpu_s": sum(steps) / max(1, len(steps)),
            "dev_cpu_s": dev / client_rounds,
            "counted": sum(len(r.get("reported", [])) for r in train),
            "recovered": sum(len(r.get("secure_recovered") or []) for r in train),
            "failed": [r.get("quorum_failed") for r in train if r["status"] != "ok"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 30, 100])
    ap.add_argument("--devices", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--drop", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--partition", default="dirichlet",
                    help="the testbed's Dirichlet(0.1), or iid (100 clients of 20%% of the "
                         "data cannot all get 20 rows under Dirichlet(0.1))")
    ap.add_argument("--secure-up", default="none", choices=["none", "int8"],
                    help="the secure run's wire.up: int8 masks in the 16-bit ring")
    args = ap.parse_args()
    print(f"# load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores",
          flush=True)
    for n in args.clients:
        for drop in args.drop:
            plain = one(n, args.devices, args.rounds, bool(drop), False, args.data_root,
                        args.partition)
            secure = one(n, args.devices, args.rounds, bool(drop), True, args.data_root,
                         args.partition, args.secure_up)
            for name, r in (("plain", plain), ("secure", secure)):
                print(json.dumps({"clients": n, "drop": drop, "run": name,
                                  **{k: round(v, 3) if isinstance(v, float) else v
                                     for k, v in r.items()}}, default=lambda x: x), flush=True)
            print(json.dumps({"clients": n, "drop": drop, "secure_up": args.secure_up,
                              "bytes_x": round(
                secure["up_kb_client"] / plain["up_kb_client"], 4), "round_x": round(
                secure["round_s"][0] / plain["round_s"][0], 3)}), flush=True)
    print(f"# load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
