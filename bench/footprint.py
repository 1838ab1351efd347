"""Peak memory (VmHWM, peak resident set) of the device daemon and of the coordinator, on the
FMNIST testbed configuration: 10 fedseq-client processes hosting 3 logical clients each
(30 clients, FedReG's ConvNet, CPU torch), a loopback Mosquitto, `fedseq-server start`.

    python bench/footprint.py [--rounds 2] [--algorithm fedavg] [--data-root DIR]

Targets (issue 10): daemon <= 400 MB, coordinator <= 600 MB. Prints each process's peak and the
ratio to its target. Rounds are shortened (1 local epoch) to keep the run short; memory does not
grow with rounds (personal state goes to disk), so the peak is reached in the first one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedseq.common.data.store import default_data_root
from fedseq.server.ops.broker import free_port

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"daemon": 400, "coordinator": 600}


def peak_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--data-root", default=str(default_data_root()))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedseq-footprint-"))
    port = free_port()
    conf = tmp / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_packet_size 2097152\n"
                    "persistence false\nlog_dest none\n")
    broker = subprocess.Popen(["mosquitto", "-c", str(conf)])
    url = f"mqtt://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the daemons run as the systemd unit runs them (deploy/systemd/fedseq-client@.service)
    daemon_env = {**env, "MALLOC_ARENA_MAX": env.get("MALLOC_ARENA_MAX", "2")}
    server = subprocess.Popen(
        ["fedseq-server", "start", "-q", "--config", str(ROOT / "examples" / "fmnist-testbed.toml"),
         "--broker", url, "--out", str(tmp / "run"),
         "--set", f"data.root={args.data_root!r}", "--set", f"rounds={args.rounds}",
         "--set", "train.local_epochs=1", "--set", f"algorithm.name={args.algorithm}",
         "--set", "algorithm.finetune_epochs=1", "--set", f"deploy.min_devices={args.devices}"],
        env=env)
    time.sleep(1)
    daemons = [subprocess.Popen(
        ["fedseq-client", "--device", f"dev{i:02d}", "--broker", url, "--threads", "1",
         "--torch-device", "cpu", "--data-dir", args.data_root,
         "--state-dir", str(tmp / f"state{i}"), "--log-level", "WARNING"], env=daemon_env)
        for i in range(args.devices)]
    peaks: dict[int, float] = {}
    try:
        while server.poll() is None:
            for p in [server, *daemons]:
                v = peak_mb(p.pid)
                if v is not None:
                    peaks[p.pid] = max(v, peaks.get(p.pid, 0.0))
            time.sleep(0.2)
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            d.wait(timeout=60)
        broker.terminate()
    if server.returncode != 0:
        sys.exit(f"the run failed (exit {server.returncode}); see the output above")
    dm = [peaks[d.pid] for d in daemons if d.pid in peaks]
    coord = peaks[server.pid]
    clients = 30 // args.devices
    print(f"daemon peak RSS ({clients} logical clients each, {len(dm)} daemons): median "
          f"{statistics.median(dm):.0f} MB, max {max(dm):.0f} MB; target {TARGETS['daemon']} MB "
          f"-> max/target {max(dm) / TARGETS['daemon']:.2f}")
    print("daemons, each:", " ".join(f"{v:.0f}" for v in sorted(dm)), "MB")
    print(f"coordinator peak RSS: {coord:.0f} MB; target {TARGETS['coordinator']} MB "
          f"-> {coord / TARGETS['coordinator']:.2f}")


if __name__ == "__main__":
    main()
