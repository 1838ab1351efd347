"""The console scripts as a user runs them: real processes, exit codes, one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, cwd=None):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow("the commands in subprocesses, each importing torch and training: 5 s on 2 cores")
def test_fedseq_sim_writes_run_dir(tmp_path, data_root):
    out = tmp_path / "run"
    r = _run("fedseq-sim", "-q", "--set", f"data.root={str(data_root)!r}", "--set", "data.fraction=0.03",
             "--set", "data.num_clients=4", "--set", "rounds=2", "--set", "train.local_epochs=1",
             "--set", "algorithm.name=fedseq-vanilla", "--set", "algorithm.finetune_epochs=1",
             "--set", "train.join_ratio=0.5", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["phase"] == "finetune"
    assert {p.name for p in out.iterdir()} >= {"config.toml", "metrics.jsonl", "clients.csv",
                                                "model.safetensors"}
    # the closing summary
    assert "run finished: fedseq-vanilla on fmnist (cnn), 2 rounds + fine-tuning" in r.stderr
    assert "personalized: final" in r.stderr and f"fedseq report {out}" in r.stderr
    assert "wire_bytes_in" not in r.stderr  # a simulation measures no wire


def test_bad_key_exit_2_one_line(tmp_path):
    r = _run("fedseq-sim", "--set", "train.lrr=0.1", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "train.lrr" in lines[0] and "unknown key" in lines[0]


def test_missing_dataset_exit_2_names_file(tmp_path):
    r = _run("fedseq-sim", "-q", "--set", f"data.root={str(tmp_path)!r}", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert "train-images-idx3-ubyte.gz" in r.stderr and "data.root" in r.stderr
    assert "fedseq data download fmnist" in r.stderr
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1


@pytest.mark.slow("the commands in subprocesses, each importing torch and training: 8 s on 2 cores")
def test_server_quick_start_with_local_devices(tmp_path, data_root):
    """docs/how-to/fleet.md's one-machine quick start: embedded broker + N fedseq-client child processes."""
    out = tmp_path / "dep"
    r = _run("fedseq-server", "start", "--local-devices", "2", "--client-threads", "1",
             "--set", f"data.root={str(data_root)!r}", "--set", "data.fraction=0.03",
             "--set", "data.num_clients=4", "--set", "rounds=2", "--set", "train.local_epochs=1",
             "--set", "algorithm.name=fedrep", "--set", "train.join_ratio=0.5",
             "--set", "deploy.port=0", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "embedded MQTT broker at mqtt://127.0.0.1:" in r.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["reported"] == row["clients"] for row in rows)
    assert "run finished: fedrep on fmnist (cnn), 2 rounds" in r.stderr
    # every numeric field without a line of its own, summarized: a deployment's wire bytes
    assert "wire_bytes_in (sum) " in r.stderr and "client_steps (sum) " in r.stderr


def test_client_bad_broker_url_exit_2():
    r = _run(sys.executable, "-m", "fedseq.client.cli", "--device", "jetson01", "--broker",
             "http://example:80")
    assert r.returncode == 2 and "mqtt://HOST:PORT" in r.stderr


def _server(*extra):
    import tempfile

    out = Path(tempfile.mkdtemp()) / "run"  # never the working directory's runs/
    return _run("fedseq-server", "start", "-q", "--out", str(out), *extra)


@pytest.mark.slow("the commands in subprocesses, each importing torch and training: 5 s on 2 cores")
def test_server_tries_the_broker_before_the_dataset(tmp_path):
    from fedseq.server.ops.broker import free_port

    r = _server("--broker", f"mqtt://127.0.0.1:{free_port()}", "--set",
                f"data.root={str(tmp_path / 'no-data')!r}")
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "cannot reach broker" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow("the commands in subprocesses, each importing torch and training: 4 s on 2 cores")
def test_server_password_file_and_port_in_use_are_one_line(tmp_path, data_root):
    import socket

    r = _server("--set", "deploy.password_file='/nonexistent/coordinator.pw'",
                "--set", "deploy.port=0")
    assert r.returncode == 2 and "deploy.password_file /nonexistent/coordinator.pw" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _server("--set", f"deploy.port={s.getsockname()[1]}")
    assert r.returncode == 2 and "the port is in use" in r.stderr
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1, r.stderr


@pytest.mark.slow("the commands in subprocesses, each importing torch and training: 12 s on 2 cores")
def test_fine_tuning_progress_and_global_note_in_both_clis(tmp_path, data_root):
    common = ["--set", f"data.root={str(data_root)!r}", "--set", "data.fraction=0.03",
              "--set", "data.num_clients=4", "--set", "rounds=1", "--set", "train.local_epochs=1",
              "--set", "algorithm.name=fedbabu", "--set", "algorithm.finetune_epochs=1",
              "--set", "train.join_ratio=0.5"]
    r = _run("fedseq-server", "start", "--local-devices", "2", "--client-threads", "1",
             "--set", "deploy.port=0", "--out", str(tmp_path / "dep"), *common)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fine-tuning: 4/4 clients" in r.stderr, r.stderr[-2000:]
    assert "note: global* = aggregated base + head frozen at its initial weights" in r.stderr
    r = _run("fedseq-sim", "--out", str(tmp_path / "sim"), *common)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: global* = aggregated base" in r.stderr


def test_simulation_reports_fine_tuning_progress(data_root):
    from conftest import quick_config
    from fedseq.server.ops.simulation import run_simulation

    seen = []
    cfg = quick_config(data_root, "algorithm.name=fedseq-anti", "rounds=1")
    run_simulation(cfg, None, on_progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 5) for i in range(1, 6)]


def test_default_threads_leave_busy_cores_alone():
    from fedseq.server.ops.simulation import default_threads

    assert default_threads(cores=2, load=0.1) == 2
    assert default_threads(cores=2, load=1.2) == 1
    assert default_threads(cores=2, load=9.0) == 1
    assert default_threads(cores=16, load=3.6) == 12


def test_default_threads_are_fixed_and_auto_follows_the_load(data_root):
    """Newcomer II, finding 1: one thread unless asked (2 threads beside a busy process ran the
    first experiment 3.5x slower, bench/newcomer.py), whatever the machine: reproducible; a
    simulation gives the calling process its own thread count back."""
    import os

    import torch

    from conftest import quick_config
    from fedseq.server.ops.simulation import run_simulation, sim_threads

    assert sim_threads(None) == 1  # whatever the machine or its load
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = run_simulation(quick_config(data_root, "rounds=1"), None)
        assert torch.get_num_threads() == 2 and result.rows
    finally:
        torch.set_num_threads(before)
    assert sim_threads(3) == 3
    assert 1 <= sim_threads("auto") <= (os.cpu_count() or 1)


@pytest.mark.slow("the commands in subprocesses, each importing torch and training: 29 s on 2 cores")
def test_replay_says_whether_the_model_is_the_runs(tmp_path, data_root):
    """fedseq-sim --replay RUN_DIR --out NEW: exit 0 and 'bitwise' when the re-executed order
    gives the run's model; exit 1 when the run's model is not what its order gives; exit 2
    without --out."""
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    r = _run("fedseq-sim", "-q", "--set", f"data.root={str(data_root)!r}", "--set",
             "data.fraction=0.03", "--set", "data.num_clients=6", "--set", "rounds=3", "--set",
             "train.local_epochs=1", "--set", "train.threads=1", "--set", "train.mode='async'",
             "--set", "algorithm.finetune_epochs=1",  # fedseq-anti's default 10: 25 s more
             "--set", "fleet.devices=[{profile='nano'},{profile='orin-nano'}]", "--out", str(run))
    assert r.returncode == 0, r.stderr
    r = _run("fedseq-sim", "--replay", str(run), "--out", str(tmp_path / "again"))
    assert r.returncode == 0, r.stderr
    assert "the replayed global model is bitwise the run's" in r.stderr
    assert "step 2: global" in r.stderr
    weights = load_file(str(run / "model.safetensors"))
    first = next(iter(weights))
    weights[first] = weights[first] + 1e-3
    save_file(weights, str(run / "model.safetensors"))
    r = _run("fedseq-sim", "-q", "--replay", str(run), "--out", str(tmp_path / "third"))
    assert r.returncode == 1 and "differs from the run's" in r.stderr
    r = _run("fedseq-sim", "--replay", str(run))
    assert r.returncode == 2 and "needs a new --out" in r.stderr


@pytest.mark.slow("the commands in subprocesses, each importing torch and training: 5 s on 2 cores")
def test_a_used_out_is_refused_before_anything_starts(tmp_path):
    """Newcomer II, finding 6: `fedseq-server start` into a non-empty --out is refused in one
    line before the embedded broker or a local daemon starts (it used to start them, log three
    warnings, then refuse); fedseq-sim likewise before loading the data."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    for cmd in (["fedseq-server", "start", "--local-devices", "3"], ["fedseq-sim"]):
        r = _run(*cmd, "--config", str(ROOT / "examples" / "quickstart.toml"), "--out", str(out))
        assert r.returncode == 2 and "exists and is not empty" in r.stderr, (cmd, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_fleet_runs_lines_say_the_time_left(capsys, monkeypatch):
    """Newcomer II, finding 1: a fleet run's line per round says how long is left at the pace
    seen so far, and the fine-tuning's clients theirs."""
    from fedseq.server.cli import commands as cli
    from fedseq.server.rounds.records import RoundRecord

    clock = iter([100.0, 110.0, 120.0, 200.0, 230.0, 260.0])
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock))
    shown = cli._Printer(rounds=3)
    for t in range(3):
        shown.row(RoundRecord(round=t, phase="train", clients=[0, 1], reported=[0, 1],
                              seconds=10.0))
    shown.progress(1, 4)
    shown.progress(2, 4)
    shown.progress(4, 4)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("round 1/3 train:") and err[0].endswith("~20 s left")
    assert err[1].endswith("~10 s left") and not err[2].endswith("left")  # the last round
    assert err[3] == "fine-tuning: 1/4 clients"  # its first: no pace yet
    assert err[4] == "fine-tuning: 2/4 clients, ~60 s left"
    assert err[5] == "fine-tuning: 4/4 clients"


def test_the_summary_names_the_privacy_level_its_epsilon_is_for(capsys):
    """A run's closing summary, from the committed testbed DP runs (docs/results/dp-testbed):
    client-level DP-FedAvg's epsilon with its q, record-level DP-SGD's as the most exposed
    client's."""
    from fedseq.server.cli.commands import _summary

    runs = ROOT / "docs" / "results" / "dp-testbed"
    _summary(runs / "client" / "fedavg" / "seed-0")
    client = capsys.readouterr().err
    assert "privacy: epsilon 7.52 at delta 1e-05 (client-level DP-FedAvg; q = 0.2, z = 1, C = 1)" \
        in client
    _summary(runs / "record" / "fedavg" / "seed-0")
    record = capsys.readouterr().err
    assert ("privacy: epsilon 21.5 at delta 1e-05 (record-level DP-SGD, the most exposed "
            "client's; z = 1.1 a step, C = 1 an example)") in record
    assert "client-level" not in record


def test_local_devices_is_the_flag_and_local_clients_its_deprecated_alias():
    """--local-devices N starts N devices (issue 81: a device is a machine and its daemon, a
    client a logical participant); --local-clients, the flag's old name, still works for one
    release and says so in one line; both at once with other values is a one-line error."""
    shown = _run("fedseq-server", "start", "--help")
    assert "--local-devices" in shown.stdout and "--local-clients" not in shown.stdout
    both = _server("--local-devices", "3", "--local-clients", "2")
    assert both.returncode == 2
    assert [x for x in both.stderr.splitlines() if x.strip()] == [
        "error: --local-clients 2 and --local-devices 3: give --local-devices alone "
        "(--local-clients is its deprecated old name)"]
    old = _server("--local-clients", "2", "--set", "rounds=0")  # a config error ends it early
    assert old.returncode == 2 and "rounds: Input should be" in old.stderr  # it went on with 2
    assert ("--local-clients is deprecated: it starts devices, not clients; use --local-devices 2"
            in old.stderr)


def test_no_help_text_loses_a_bracketed_word_to_rich_markup():
    """Issue 94, finding 5: `fedseq --help` read "as a  for fedseq-sim": rich took "[fleet]" in
    a docstring for a style tag and dropped it (and "([hierarchy])" became "()"). No command's
    or option's help of the three CLIs holds a bare bracketed word."""
    import re

    import typer

    from fedseq.server.cli.commands import server_app
    from fedseq.server.cli.tools import app

    tag = re.compile(r"(?<!\\)\[[A-Za-z][\w.\-]*\]")
    found = []

    def walk(cmd, path):
        texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        found.extend(f"{path}: {m.group()}" for t in texts for m in tag.finditer(t))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    for name, typer_app in (("fedseq", app), ("fedseq-server", server_app)):
        walk(typer.main.get_command(typer_app), name)
    assert found == []


def test_a_second_config_is_refused_not_silently_kept():
    """Issue 94, finding 5: `--config a.toml --config b.toml` ran b alone, without a word."""
    r = subprocess.run([sys.executable, "-c", "from fedseq.server.cli.launch import sim_main; "
                        "sim_main()", "--config", "a.toml", "-c", "b.toml"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: fedseq-sim: --config given 2 times; give one experiment "
                                "file, and change its keys with --set KEY=VALUE")
