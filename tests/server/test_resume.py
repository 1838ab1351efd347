"""Checkpoint and resume: an interrupted run continued with --resume ends bitwise where an
uninterrupted one does, in simulation and in deployment (the coordinator SIGKILLed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import device_process, quick_config
from fedseq.common.protocol.tensors import decode_tensors
from fedseq.common.text import markdown_cell
from fedseq.server.ops.deployment import stop_children
from fedseq.server.ops.simulation import run_simulation


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _status(run):
    return json.loads((run / "status.json").read_text())["state"]


@pytest.mark.slow("a run crashed (or killed) and resumed: 4 s on 2 cores")
@pytest.mark.parametrize("algorithm", ["fedavg", "fedper"])
def test_simulation_resume_is_bitwise(data_root, tmp_path, algorithm):
    cfg = quick_config(data_root, f"algorithm.name={algorithm}", "rounds=3", "train.join_ratio=0.6")
    full = run_simulation(cfg, tmp_path / "full")

    def stop_after_round_1(row):
        if row.round == 1:
            raise KeyboardInterrupt

    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        run_simulation(cfg, part, stop_after_round_1)
    assert _status(part) == "interrupted" and not (part / "model.safetensors").exists()
    resumed = run_simulation(cfg, part, mode="resume")
    for k, v in full.global_weights.items():
        assert torch.equal(resumed.global_weights[k], v), k
    a, b = _rows(tmp_path / "full"), _rows(part)
    assert [r["round"] for r in b] == [0, 1, 2]
    assert [(r["global_acc"], r["personal_acc"]) for r in a] == [
        (r["global_acc"], r["personal_acc"]) for r in b]
    assert _status(part) == "finished" and _status(tmp_path / "full") == "finished"


@pytest.mark.slow("a run crashed (or killed) and resumed: 17 s on 2 cores")
def test_sigterm_leaves_a_resumable_interrupted_run(data_root, tmp_path):
    """`kill` / `systemctl stop`: status.json says interrupted, exit 130 with the resume line,
    and --resume finishes the run."""
    out = tmp_path / "run"
    cmd = ["fedseq-sim", "-q", "--set", f"data.root={str(data_root)!r}", "--set",
           "data.fraction=0.05", "--set", "data.num_clients=5", "--set", "rounds=40",
           "--set", "train.local_epochs=1", "--set", "train.threads=1",
           "--set", "algorithm.name=fedavg", "--out", str(out)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").exists() and _rows(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert _status(out) == "interrupted" and f"--resume {out}" in err
    done = len(_rows(out))
    r = subprocess.run(["fedseq-sim", "-q", "--resume", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert _status(out) == "finished" and [x["round"] for x in _rows(out)] == list(range(40))
    assert done < 40


@pytest.mark.slow("a run crashed (or killed) and resumed: 14 s on 2 cores")
def test_existing_out_is_refused_without_resume_or_overwrite(data_root, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    base = ["fedseq-sim", "-q", "--set", f"data.root={str(data_root)!r}", "--set",
            "data.fraction=0.03", "--set", "data.num_clients=4", "--set", "rounds=1",
            "--set", "train.local_epochs=1"]
    r = subprocess.run(base + ["--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--resume" in r.stderr and "--overwrite" in r.stderr
    assert (out / "metrics.jsonl").read_text() == "precious\n"
    r = subprocess.run(base + ["--out", str(out), "--overwrite"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert _status(out) == "finished" and _rows(out)[0]["round"] == 0
    r = subprocess.run(["fedseq-sim", "--resume", str(tmp_path / "nothing")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "config.toml" in r.stderr


@pytest.mark.slow("a run crashed (or killed) and resumed: 19 s on 2 cores")
def test_resume_refuses_a_set_that_changes_the_results(data_root, tmp_path):
    """A run directory describes one run: --resume with --set train.lr=... would continue it
    under a config its config.toml does not record, so it is refused and nothing changes;
    a key that cannot change the numbers (data.root) is still accepted."""
    out = tmp_path / "run"
    base = ["fedseq-sim", "-q", "--set", f"data.root={str(data_root)!r}", "--set",
            "data.fraction=0.03", "--set", "data.num_clients=4", "--set", "rounds=1",
            "--set", "train.local_epochs=1", "--set", "train.threads=1", "--out", str(out)]
    r = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    facts = json.loads((out / "status.json").read_text())  # what reproducing it depends on
    assert facts["threads"] == 1 and facts["torch"] == torch.__version__ and facts["cpu"]
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = subprocess.run(["fedseq-sim", "-q", "--resume", str(out), "--set", "train.lr=0.5",
                        "--set", "algorithm.name=fedprox"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2
    assert "train.lr (0.01 -> 0.5)" in r.stderr and "algorithm.name" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    r = subprocess.run(["fedseq-sim", "-q", "--resume", str(out), "--set",
                        f"data.root={str(data_root)!r}"], capture_output=True, text=True,
                       timeout=300)
    assert "would change" not in r.stderr, r.stderr


def _server_sets(cfg, over: list[str]) -> list[str]:
    """--set arguments that make fedseq-server's config equal quick_config(..., *over)."""
    quick = ["data.root", "data.dataset", "data.fraction", "data.num_clients", "data.alpha",
             "data.min_samples", "train.local_epochs", "train.batch_size", "algorithm.finetune_epochs"]
    sets = []
    for key in quick:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        sets += ["--set", f"{key}={str(value)!r}" if isinstance(value, str) or key == "data.root"
                 else f"{key}={value}"]
    for o in over:
        sets += ["--set", o]
    return sets


CRASH = [str(Path(__file__).resolve().parents[1] / "crash_server.py")]


@pytest.mark.slow("a run crashed (or killed) and resumed: 17 s on 2 cores")
@pytest.mark.parametrize("points, algorithm, more", [
    (["after-aggregate"], "fedavg", []),
    (["mid-checkpoint"], "fedper", []),
    (["mid-finetune"], "fedbabu", []),
    (["after-aggregate", "first-resumed-round"], "fedavg", []),
    (["mid-secure-unmask"], "fedavg", ["secagg.enabled=true"]),
])
def test_resume_after_a_crash_at_the_worst_points(data_root, tmp_path, mosquitto, one_thread,
                                                  points, algorithm, more):
    """The coordinator is SIGKILLed at each worst point (tests/crash_server.py says where), the
    devices stay up, and `--resume` (once per crash) ends with the uninterrupted run's weights and
    scores, every round with every update, and without waiting for a single 120 s deadline. A
    secure round interrupted after its unmasking shares were revealed starts again with fresh
    keys (a new step: the devices draw new ones) and ends as the uninterrupted run."""
    port, home, _ = mosquitto
    devices = [device_process(n, port, home, data_root) for n in ("local01", "local02")]
    out = tmp_path / "run"
    over = [f"algorithm.name={algorithm}", "rounds=3", "train.join_ratio=0.6",
            "deploy.min_devices=2", "deploy.round_timeout_s=120", "deploy.eval_timeout_s=120",
            "deploy.finetune_timeout_s=120", *more]
    cfg = quick_config(data_root, *over)
    url = f"mqtt://127.0.0.1:{port}"
    cred = ["--set", "deploy.username=coordinator",
            "--set", f"deploy.password_file={str(home / 'coordinator.pw')!r}"]
    first = ["start", "-q", "--broker", url, "--out", str(out), *_server_sets(cfg, over), *cred]
    again = ["start", "-q", "--broker", url, "--resume", str(out)]
    try:
        for i, point in enumerate(points):
            r = subprocess.run([sys.executable, *CRASH, point, *(again if i else first)],
                               capture_output=True, text=True, timeout=400)
            assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr[-2000:])
            assert _status(out) == "running"  # what a crash leaves behind
        if "mid-checkpoint" in points:
            assert (out / "checkpoint.safetensors.tmp").exists()
        start = time.monotonic()
        r = subprocess.run([sys.executable, *CRASH, "none", *again], capture_output=True,
                           text=True, timeout=600)
        took = time.monotonic() - start
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        stop_children(devices)
    rows = _rows(out)
    train = [x for x in rows if x["phase"] == "train"]
    assert [x["round"] for x in train] == [0, 1, 2]
    assert all(x["reported"] == x["clients"] for x in train), train
    assert took < 100, took  # one deadline waited out would take 120 s
    sim = run_simulation(cfg, None)
    saved = decode_tensors((out / "model.safetensors").read_bytes())
    for k, v in sim.global_weights.items():
        assert torch.equal(saved[k], v), k
    assert [(x["global_acc"], x["personal_acc"]) for x in rows] == [
        (x["global_acc"], x["personal_acc"]) for x in sim.rows]


@pytest.mark.slow("a run crashed (or killed) and resumed: 14 s on 2 cores")
@pytest.mark.parametrize("algorithm", ["fedavg", "fedper"])
def test_deployment_resume_after_sigkill_is_bitwise(data_root, tmp_path, mosquitto, one_thread,
                                                    algorithm):
    """fedseq-server is SIGKILLed once round 1 is recorded; the same command with --resume ends
    with the uninterrupted simulation's weights, and the devices (kept up) reuse their personal
    heads under the same run id."""
    port, home, _ = mosquitto
    devices = [device_process(n, port, home, data_root) for n in ("local01", "local02")]
    out = tmp_path / "run"
    over = [f"algorithm.name={algorithm}", "rounds=4", "train.join_ratio=0.6", "deploy.min_devices=2",
            "deploy.round_timeout_s=120", "deploy.eval_timeout_s=120"]
    cfg = quick_config(data_root, *over)
    try:
        _kill_after_two_rows_then_resume(port, home, out, _server_sets(cfg, over), most=3)
    finally:
        stop_children(devices)
    rows = _rows(out)
    assert [x["round"] for x in rows] == [0, 1, 2, 3]
    assert all(x["reported"] == x["clients"] for x in rows)
    assert _status(out) == "finished"
    sim = run_simulation(cfg, None)
    saved = decode_tensors((out / "model.safetensors").read_bytes())
    for k, v in sim.global_weights.items():
        assert torch.equal(saved[k], v), k
    run_id = json.loads((out / "status.json").read_text())["run_id"]
    if algorithm == "fedper":
        assert (home / "state" / "local01" / run_id).is_dir()  # personal heads, same run id


def test_sim_cli_resume_flags_conflict(tmp_path):
    r = subprocess.run([sys.executable, "-c", "from fedseq.server.cli.commands import sim_main; sim_main()",
                        "--resume", str(tmp_path), "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--resume RUN_DIR takes" in r.stderr


@pytest.mark.slow("a run crashed (or killed) and resumed: 9 s on 2 cores")
def test_local_devices_die_with_a_killed_coordinator_and_keep_their_state(data_root, tmp_path):
    """kill -9 of `fedseq-server start --local-devices 2`: its device processes exit by themselves
    (no orphan joins the resumed run's devices), and their personal state is in the run
    directory, where --resume finds it."""
    out = tmp_path / "run"
    sets = ["--set", f"data.root={str(data_root)!r}", "--set", "data.fraction=0.05", "--set",
            "data.num_clients=4", "--set", "rounds=30", "--set", "train.local_epochs=1",
            "--set", "algorithm.name=fedper", "--set", "deploy.port=0"]
    server = subprocess.Popen(["fedseq-server", "start", "-q", "--local-devices", "2",
                               "--client-threads", "1", "--out", str(out), *sets],
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not ((out / "metrics.jsonl").exists() and _rows(out)):
            time.sleep(0.2)
        assert _rows(out), "the run did not start"
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == server.pid]
        assert len(children) == 2
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        assert not any(_alive(c) for c in children), "orphan device daemons outlived the coordinator"
    finally:
        if server.poll() is None:
            server.kill()
    assert any((out / "local-devices").rglob("client-*.safetensors"))


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow("a run crashed (or killed) and resumed: 18 s on 2 cores")
def test_finetune_from_replays_the_fine_tuning_alone(data_root, tmp_path):
    """--finetune-from: the same settings give bitwise the original fine-tuning; other settings
    (head only) a different one under the same federated rounds, recorded in config.toml;
    anything else, an unfinished source or a used --out is refused in one line."""
    from fedseq.server.rounds.coordinator import RunPaused

    cfg = quick_config(data_root, "algorithm.name=fedbabu", "rounds=2", "train.threads=1",
                       "algorithm.finetune_epochs=2")
    src = tmp_path / "src"
    run_simulation(cfg, src)
    sim = ["fedseq-sim", "-q", "--finetune-from", str(src)]
    same, head = tmp_path / "same", tmp_path / "head"
    for out, extra in ((same, []), (head, ["--set", 'algorithm.finetune_blocks="head"'])):
        r = subprocess.run([*sim, *extra, "--out", str(out)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
    def timeless(run):
        return [{k: v for k, v in row.items() if k != "seconds"} for row in _rows(run)]

    original, again, tuned = timeless(src), timeless(same), timeless(head)
    assert again == original and tuned[:-1] == original[:-1]  # the federated rows, unchanged
    assert (same / "clients.csv").read_text() == (src / "clients.csv").read_text()
    assert tuned[-1]["phase"] == "finetune"
    assert tuned[-1]["trainable_params"] < original[-1]["trainable_params"]
    assert tuned[-1]["personal_acc"] != original[-1]["personal_acc"]
    text = (head / "config.toml").read_text()
    assert 'finetune_blocks = "head"' in text and f"# finetuned_from: {src}" in text
    for extra, words in ((["--set", "train.lr=0.5", "--out", str(tmp_path / "x")], "train.lr"),
                         (["--out", str(same)], "not empty")):
        r = subprocess.run([*sim, *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x").exists()
    part = tmp_path / "part"
    with pytest.raises(RunPaused):
        run_simulation(cfg, part, pause_after=1)
    r = subprocess.run(["fedseq-sim", "-q", "--finetune-from", str(part), "--out",
                        str(tmp_path / "y")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "1 of its 2 rounds" in r.stderr, r.stderr


@pytest.mark.slow("a run crashed (or killed) and resumed: 4 s on 2 cores")
def test_a_resume_on_other_cpu_kernels_is_warned_and_recorded(data_root, tmp_path, caplog):
    """A run carried to a machine whose torch uses other CPU kernels (measured: AVX2 against
    AVX-512, docs/results.md) goes on, but says it is no longer bitwise one run: a warning,
    status.json's segments, and a note in `fedseq report`."""
    from fedseq.server.rounds.coordinator import RunPaused

    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "train.threads=1",
                       "train.join_ratio=0.6")
    same, other = tmp_path / "same", tmp_path / "other"
    for run in (same, other):
        with pytest.raises(RunPaused):
            run_simulation(cfg, run, pause_after=1)
    here = json.loads((same / "status.json").read_text())["cpu_kernels"]
    # what another machine would have written: AVX2 where this one has more, else AVX-512
    elsewhere = "AVX2 (avx2)" if here != "AVX2 (avx2)" else "AVX512 (avx512f avx512bw avx512vl)"
    status = json.loads((other / "status.json").read_text())
    status["cpu_kernels"] = elsewhere
    (other / "status.json").write_text(json.dumps(status))
    for run in (same, other):
        caplog.clear()
        run_simulation(cfg, run, mode="resume")
        segments = json.loads((run / "status.json").read_text())["segments"]
        assert [s["from_round"] for s in segments] == [0, 1]
        warned = [r.getMessage() for r in caplog.records if "other compute" in r.getMessage()]
        if run == same:
            assert segments[0] == segments[1] | {"from_round": 0} and not warned
        else:
            assert segments[0]["cpu_kernels"] == elsewhere and segments[1]["cpu_kernels"] == here
            assert len(warned) == 1 and f"cpu_kernels {elsewhere!r} -> {here!r}" in warned[0]
    r = subprocess.run([sys.executable, "-m", "fedseq.server.cli.tools", "report", str(same), str(other),
                        "--out", str(tmp_path / "rep"), "--no-figures"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    note = f"{other}: resumed on other compute (from round 1: cpu_kernels {elsewhere} -> {here})"
    assert markdown_cell(note, 600) in md
    assert f"{same}: resumed" not in md


def test_a_run_folder_is_held_by_one_process_and_only_ours(data_root, tmp_path):
    """Hardening III, finding 14: a second coordinator on a run folder in use (`--resume` while
    the first still runs) is refused in one line, and writes nothing; a folder every local user
    may write is refused; links planted where the old fixed temporary names were are not followed;
    device facts are not readable by every local user."""
    import stat

    from fedseq.common.errors import ConfigError
    from fedseq.server.rounds.rundir import RunDir

    cfg = quick_config(data_root)
    out = tmp_path / "run"
    first = RunDir(out, cfg)
    before = (out / "status.json").read_bytes()
    with pytest.raises(ConfigError, match=rf"in use by another fedseq process \(pid {os.getpid()}\)"):
        RunDir(out, cfg, mode="resume", resume_round=0)
    assert (out / "status.json").read_bytes() == before
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    for name in ("status.json.tmp", "devices.json.tmp"):
        (out / name).symlink_to(victim)
    first.set_status("running")
    first.record_devices({"dev01": [{"seen": 1.0, "torch": "1.12.1"}]})
    assert victim.read_text() == "keep\n"
    assert stat.S_IMODE((out / "devices.json").stat().st_mode) == 0o640
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    first.close()
    RunDir(out, cfg, mode="resume", resume_round=0).close()  # free again once closed
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        RunDir(shared, cfg)


def test_passwd_file_is_never_readable_by_others(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    r = subprocess.run(["fedseq-server", "passwd", str(tmp_path / "passwd"), "dev01",
                        "--password-file", str(pw)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "passwd").stat().st_mode & 0o077 == 0
    assert (tmp_path / "passwd").read_text().startswith("dev01:")


def _kill_after_two_rows_then_resume(port: int, home: Path, out: Path, sets: list[str],
                                     most: int) -> None:
    """fedseq-server start on the test's Mosquitto, SIGKILLed once two rows are recorded (at
    most `most` by then: mid-run), then the same command with --resume, which must succeed."""
    cred = ["--set", "deploy.username=coordinator",
            "--set", f"deploy.password_file={str(home / 'coordinator.pw')!r}"]
    url = f"mqtt://127.0.0.1:{port}"
    server = subprocess.Popen(["fedseq-server", "start", "-q", "--broker", url, "--out",
                               str(out), *sets, *cred])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        if (out / "metrics.jsonl").exists() and len(_rows(out)) >= 2:
            break
        time.sleep(0.2)
    server.send_signal(signal.SIGKILL)
    server.wait(30)
    assert 2 <= len(_rows(out)) <= most, "the coordinator was not killed mid-run"
    assert _status(out) == "running"  # what a crash leaves behind
    r = subprocess.run(["fedseq-server", "start", "-q", "--broker", url, "--resume", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _cpu_quota(pid: int, cores: float, name: str) -> Path | None:
    """Put process `pid` under a cgroup v1 CPU quota of `cores` (root only; None elsewhere)."""
    from fedseq.server.ops.rehearsal import CGROUP_CPU

    if os.geteuid() != 0 or not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return None
    group = CGROUP_CPU / f"fedseq-test-{name}-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text("100000\n")
    (group / "cpu.cfs_quota_us").write_text(f"{int(cores * 100000)}\n")
    (group / "cgroup.procs").write_text(f"{pid}\n")
    return group


@pytest.mark.slow("a run crashed (or killed) and resumed: 24 s on 2 cores")
def test_an_async_deployment_resumes_after_sigkill_and_replays_bitwise(
        data_root, tmp_path, mosquitto, one_thread):
    """train.mode = "async" on Mosquitto (broker.conf, ACL), two daemons of unequal speed (one
    under a quarter of a core, as root): fedseq-server is SIGKILLed after two server steps; the
    same command with --resume re-selects the clients that were in flight and finishes; every
    fold was trained on a model of its step or before, some of them on an older one; and
    fedseq-sim --replay of the run directory gives the deployment's global model bitwise."""
    port, home, _ = mosquitto
    devices = [device_process(n, port, home, data_root) for n in ("local01", "local02")]
    group = _cpu_quota(devices[1].pid, 0.25, "local02")
    out = tmp_path / "run"
    over = ["algorithm.name=fedavg", "rounds=6", "train.mode='async'", "train.concurrency=4",
            "train.buffer=2", "deploy.min_devices=2", "deploy.round_timeout_s=300",
            "deploy.eval_timeout_s=300"]
    cfg = quick_config(data_root, *over)
    try:
        _kill_after_two_rows_then_resume(port, home, out, _server_sets(cfg, over), most=5)
    finally:
        stop_children(devices)
        if group is not None:
            group.rmdir()
    rows = [x for x in _rows(out) if x["phase"] == "train"]
    assert [x["round"] for x in rows] == [0, 1, 2, 3, 4, 5]
    folds = [(x["round"], f) for x in rows for f in x["folds"]]
    assert all(f["refused"] is None and f["version"] <= t for t, f in folds)
    assert all(len(x["reported"]) == 2 for x in rows)
    assert any(f["staleness"] > 0 for _, f in folds)
    r = subprocess.run(["fedseq-sim", "--replay", str(out), "--out", str(tmp_path / "again"),
                        "-q", "--set", "train.threads=1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])


@pytest.mark.slow("a run crashed (or killed) and resumed: 39 s on 2 cores")
def test_an_async_deployment_goes_on_when_a_device_is_killed_and_restarted(
        data_root, tmp_path, mosquitto, one_thread):
    """A daemon SIGKILLed mid-run (its last will says offline): its flights are dropped and the
    other device's clients carry the steps; restarted, it takes dispatches again, without
    training again what it answered before (its state folder says so). The run finishes, and
    fedseq-sim --replay gives its model bitwise."""
    port, home, _ = mosquitto
    devices = [device_process(n, port, home, data_root) for n in ("local01", "local02")]
    out = tmp_path / "run"
    over = ["algorithm.name=fedavg", "rounds=30", "train.mode='async'", "train.concurrency=4",
            "train.buffer=2", "deploy.min_devices=1", "deploy.round_timeout_s=300",
            "deploy.eval_timeout_s=300", "deploy.wait_devices_s=5"]
    cfg = quick_config(data_root, *over)
    cred = ["--set", "deploy.username=coordinator",
            "--set", f"deploy.password_file={str(home / 'coordinator.pw')!r}"]
    try:
        server = subprocess.Popen(["fedseq-server", "start", "-q", "--broker",
                                   f"mqtt://127.0.0.1:{port}", "--out", str(out),
                                   *_server_sets(cfg, over), *cred])
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            if (out / "metrics.jsonl").exists() and len(_rows(out)) >= 1:
                break
            time.sleep(0.1)
        devices[1].send_signal(signal.SIGKILL)
        devices[1].wait(30)
        time.sleep(3.0)
        devices.append(device_process("local02", port, home, data_root))
        assert server.wait(600) == 0
    finally:
        stop_children(devices)
    rows = [x for x in _rows(out) if x["phase"] == "train"]
    assert [x["round"] for x in rows] == list(range(30)) and _status(out) == "finished"
    assert all(len(x["reported"]) == 2 for x in rows)
    assert any(x["failed"] for x in rows)  # the flights it held when it was killed
    # local02 holds the odd clients: it came back and trained again
    assert any(c % 2 for x in rows[-10:] for c in x["reported"])
    answered = json.loads(next((home / "state" / "local02").glob("*/answered.json")).read_text())
    assert answered  # what it answered, kept across its restart
    r = subprocess.run(["fedseq-sim", "--replay", str(out), "--out", str(tmp_path / "again"),
                        "-q", "--set", "train.threads=1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
