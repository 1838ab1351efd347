"""Rehearse a device on this machine: an emulated aarch64 Debian 11 (Python 3.9, glibc 2.31, the
closest userland to a Nano's community Ubuntu 20.04 image a PC can run), the device client rolled
out into it by the project's ansible role, and real fedseq-client processes in it that join a
coordinator on this host over Mosquitto for real runs. Needs root (debootstrap, chroot, binfmt).

    sudo .venv/bin/python deploy/emulated_device.py --data ../shared/data

Steps (each skipped when its result is already there; --fresh starts over):
  1. build    debootstrap --arch=arm64 bullseye, run through qemu-user-static; then torch 1.12.1
              and numpy<2 installed system-wide, as JetPack's torch wheel is on a Jetson
  2. install  the project wheel and a wheelhouse of the device's dependencies (aarch64, cp39)
              built here; the fedseq_client role applied through ansible's chroot connection
              (community.general, from the `ansible` package), as on a real device
  3. doctor   `fedseq-client doctor` inside the emulated device
  4. run      per algorithm: Mosquitto with broker.conf (password file and ACL), a coordinator
              on this host, two daemons in the emulated device, N rounds; then the same config
              in the x86 simulation, and how far the two results are apart
A summary with the timings is printed and written to DIR/rehearsal.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEVICE_DEPS = ["numpy<2", "pydantic>=2.5", "paho-mqtt>=2.0", "safetensors>=0.4", "packaging",
               "tomli>=2.0"]


def sh(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    kw.setdefault("check", True)
    return subprocess.run([str(c) for c in cmd], **kw)


def in_device(rootfs: Path, *cmd: str, **kw) -> subprocess.CompletedProcess:
    """Run a command in the emulated device with a clean environment (the host's certificate
    bundle for pip: this machine's TLS is intercepted by a CA only the host bundle has)."""
    env = ["/usr/bin/env", "-i", f"PATH={PATH}", "HOME=/root", "LANG=C.UTF-8",
           "PIP_CERT=/etc/ssl/certs/host-ca.crt", "PIP_DISABLE_PIP_VERSION_CHECK=1"]
    return sh("chroot", rootfs, *env, *cmd, **kw)


@contextlib.contextmanager
def mounted(rootfs: Path):
    """/proc, /sys and /dev inside the device for the time of the rehearsal."""
    done = []
    try:
        for fs, target, args in (("proc", "proc", ["-t", "proc"]), ("sysfs", "sys", ["-t", "sysfs"]),
                                 ("/dev", "dev", ["--rbind"])):
            if subprocess.run(["mountpoint", "-q", str(rootfs / target)]).returncode != 0:
                sh("mount", *args, fs, rootfs / target)
                done.append(rootfs / target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-R", "-l", str(target)])


def ensure_emulation() -> None:
    missing = [p for p, exe in (("qemu-user-static", "/usr/bin/qemu-aarch64-static"),
                                ("debootstrap", "/usr/sbin/debootstrap"),
                                ("binfmt-support", "/usr/sbin/update-binfmts")) if not Path(exe).exists()]
    if missing:
        sh("apt-get", "update", "-qq")
        sh("apt-get", "install", "-y", "-qq", *missing,
           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if not Path("/proc/sys/fs/binfmt_misc/register").exists():
        sh("mount", "-t", "binfmt_misc", "binfmt_misc", "/proc/sys/fs/binfmt_misc")
    if not Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists():
        sh("update-binfmts", "--enable", "qemu-aarch64")


def build(rootfs: Path, mirror: str) -> None:
    ensure_emulation()
    if not (rootfs / ".debootstrap-done").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        sh("debootstrap", "--arch=arm64", "--variant=minbase",
           "--include=python3,python3-venv,python3-pip,ca-certificates", "bullseye", rootfs, mirror)
        (rootfs / ".debootstrap-done").touch()
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", rootfs / "etc/ssl/certs/host-ca.crt")
    shutil.copy("/etc/resolv.conf", rootfs / "etc/resolv.conf")
    if not (rootfs / ".torch-done").exists():
        with mounted(rootfs):  # the device's system torch, as JetPack's wheel on a Jetson
            in_device(rootfs, "python3", "-m", "pip", "install", "-q", "--no-cache-dir",
                      "torch==1.12.1", "numpy<2")
        (rootfs / ".torch-done").touch()


def install(rootfs: Path, work: Path, data: Path, port: int) -> None:
    """docs/deploy.md's device route: the bare wheel, its dependencies from a wheelhouse, the role."""
    if shutil.which("ansible-playbook") is None or subprocess.run(
            ["ansible-doc", "-t", "connection", "-l"], capture_output=True, text=True
            ).stdout.find("community.general.chroot") < 0:
        sh(sys.executable, "-m", "pip", "install", "-q", "ansible>=10")  # community.general
    dist, wheels = work / "dist", work / "wheelhouse"
    shutil.rmtree(dist, ignore_errors=True)
    sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT)
    (wheel,) = dist.glob("fedseq-*.whl")
    sh(sys.executable, "-m", "pip", "download", "-q", "-d", wheels, "--only-binary=:all:",
       "--python-version", "3.9", "--implementation", "cp", "--platform", "manylinux2014_aarch64",
       "--platform", "manylinux_2_17_aarch64", "--platform", "linux_aarch64", *DEVICE_DEPS)
    sh("ansible-playbook", "-i", f"{rootfs},", "-c", "community.general.chroot",
       ROOT / "deploy/ansible/client-local.yml",
       "-e", "ansible_python_interpreter=/usr/bin/python3", "-e", f"fedseq_client_wheel={wheel}",
       "-e", f"fedseq_client_wheelhouse={wheels}", "-e", "fedseq_client_device=arm01",
       "-e", f"fedseq_client_dataset_src={data / 'FashionMNIST'}",
       "-e", f"fedseq_client_broker_url=mqtt://127.0.0.1:{port}", "-e", "fedseq_client_threads=1",
       "-e", "fedseq_client_torch_device=cpu",
       # a chroot's mount facts are the host's (its / is not among them): no disk check here
       "-e", "fedseq_client_min_free_mb=0",
       env={**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_HOST_KEY_CHECKING": "False"})


def doctor(rootfs: Path, port: int) -> str:
    """fedseq-client doctor in the device, against a broker that knows its login."""
    home = Path(tempfile.mkdtemp(prefix="fedseq-rehearsal-"))
    broker = start_mosquitto(home, {"arm01": "a1-pw"}, port)
    (rootfs / "etc/fedseq/arm01-rehearsal.pw").write_text("a1-pw\n")
    try:
        r = in_device(rootfs, "/opt/fedseq/venv/bin/fedseq-client", "doctor", "--config",
                      "/etc/fedseq/client.toml", "--broker", f"mqtt://127.0.0.1:{port}",
                      "--username", "arm01", "--password-file",
                      "/etc/fedseq/arm01-rehearsal.pw", check=False, capture_output=True, text=True)
    finally:
        broker.terminate()
        broker.wait(30)
        shutil.rmtree(home, ignore_errors=True)
    print(r.stdout + r.stderr)
    return r.stdout


def start_mosquitto(home: Path, users: dict[str, str], port: int) -> subprocess.Popen:
    """Mosquitto from the project's broker.conf: password file, ACL, loopback, this port."""
    from fedseq.server.ops.broker import write_local_mosquitto

    conf = write_local_mosquitto(home, port, users, ROOT / "broker.conf",
                                 ROOT / "deploy/mosquitto/fedseq.acl", "root")
    proc = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)],
                            stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return proc


def run(rootfs: Path, data: Path, algorithms: list[str], rounds: int, port: int) -> list[dict]:
    import torch

    from fedseq.common.config import load_config
    from fedseq.server.ops.deployment import run_deployment
    from fedseq.server.ops.simulation import run_simulation

    results = []
    devices = ["arm01", "arm02"]
    for alg in algorithms:
        home = Path(tempfile.mkdtemp(prefix="fedseq-rehearsal-"))
        broker = start_mosquitto(home, {"coordinator": "c-pw", "arm01": "a1-pw", "arm02": "a2-pw"}, port)
        daemons = []
        for name in devices:  # the role wrote arm01's config; arm02 is the same board's twin
            pw = f"/etc/fedseq/{name}-rehearsal.pw"
            (rootfs / pw.lstrip("/")).write_text({"arm01": "a1-pw", "arm02": "a2-pw"}[name] + "\n")
            daemons.append(subprocess.Popen(
                ["chroot", str(rootfs), "/usr/bin/env", "-i", f"PATH={PATH}", "HOME=/root",
                 "MALLOC_ARENA_MAX=2", "OMP_NUM_THREADS=1", "/opt/fedseq/venv/bin/fedseq-client",
                 "--config", "/etc/fedseq/client.toml", "--broker", f"mqtt://127.0.0.1:{port}",
                 "--device", name, "--username", name,
                 "--password-file", pw, "--state-dir", f"/var/lib/fedseq/state-{alg}-{name}",
                 "--log-level", "WARNING"]))
        (home / "coordinator.pw").write_text("c-pw\n")
        cfg = load_config(None, [
            f"data.root={str(data)!r}", "data.dataset=fmnist", "data.fraction=0.05",
            "data.num_clients=6", "data.alpha=0.5", "data.min_samples=40", f"rounds={rounds}",
            "train.join_ratio=0.5", "train.local_epochs=1", "train.batch_size=20",
            "train.threads=1", "algorithm.finetune_epochs=1", f"algorithm.name={alg}",
            "deploy.min_devices=2", "deploy.wait_devices_s=600", "deploy.username=coordinator",
            f"deploy.password_file={str(home / 'coordinator.pw')!r}"])
        torch.set_num_threads(1)
        start = time.monotonic()
        try:
            dep = run_deployment(cfg, home / "run", broker=f"mqtt://127.0.0.1:{port}")
        finally:
            for d in daemons:
                d.terminate()
            for d in daemons:
                d.wait(120)
            broker.terminate()
            broker.wait(30)
        wall = time.monotonic() - start
        sim = run_simulation(cfg, out=None)
        keys = sorted(sim.global_weights)
        a = torch.cat([dep.global_weights[k].flatten() for k in keys])
        b = torch.cat([sim.global_weights[k].flatten() for k in keys])
        train = [r for r in dep.rows if r["phase"] == "train"]
        sim_train = [r for r in sim.rows if r["phase"] == "train"]
        res = {
            "algorithm": alg, "rounds": len(train), "wall_s": round(wall, 1),
            "round_s": [round(r["seconds"], 1) for r in train],
            "accepted": [f"{len(r['reported'])}/{len(r['clients'])}" for r in train],
            "daemon_exit": [d.returncode for d in daemons],
            "global_acc_device": [r["global_acc"] for r in train],
            "global_acc_sim": [r["global_acc"] for r in sim_train],
            "final_personal_device": dep.rows[-1].get("personal_acc"),
            "final_personal_sim": sim.rows[-1].get("personal_acc"),
            "rel_l2_weights": float((a - b).norm() / b.norm()),
            "max_abs_weights": float((a - b).abs().max()),
        }
        print(json.dumps(res), flush=True)
        results.append(res)
        shutil.rmtree(home, ignore_errors=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/fedseq-arm64"))
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("FEDSEQ_DATA", "data")),
                    help="data root holding FashionMNIST/raw (default $FEDSEQ_DATA)")
    ap.add_argument("--algorithms", default="fedavg,fedper")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", default="build,install,doctor,run")
    ap.add_argument("--mirror", default="http://deb.debian.org/debian")
    ap.add_argument("--fresh", action="store_true", help="delete the emulated device first")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("error: the rehearsal needs root (debootstrap, chroot, binfmt_misc): run it with sudo",
              file=sys.stderr)
        return 2
    if not (a.data / "FashionMNIST" / "raw").is_dir():
        print(f"error: no FashionMNIST/raw under {a.data}: give --data (fedseq data download fmnist)",
              file=sys.stderr)
        return 2
    from fedseq.server.ops.broker import free_port

    rootfs, steps, port = a.dir / "rootfs", a.steps.split(","), free_port()
    if a.fresh:
        shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    summary: dict = {"seconds": seconds}
    for step in ("build", "install", "doctor", "run"):
        if step not in steps:
            continue
        start = time.monotonic()
        if step == "build":
            build(rootfs, a.mirror)
        else:
            with mounted(rootfs):
                if step == "install":
                    install(rootfs, a.dir, a.data.resolve(), port)
                elif step == "doctor":
                    summary["doctor"] = doctor(rootfs, port)
                else:
                    summary["runs"] = run(rootfs, a.data.resolve(), a.algorithms.split(","), a.rounds, port)
        seconds[step] = round(time.monotonic() - start, 1)
        print(f"== {step}: {seconds[step]} s", flush=True)
    (a.dir / "rehearsal.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    runs = summary.get("runs", [])
    ok = all(r["daemon_exit"] == [0, 0] and all(x.split("/")[0] == x.split("/")[1] for x in r["accepted"])
             for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
