"""Campaigns (server/ops/campaign.py): a grid of runs back to back, in simulation and on a fleet of
real daemons on Mosquitto with the project's broker.conf and ACL; every run bitwise the run it
stands for, continued after a SIGKILL by the same command, a changed file refused, added runs
appended, a failed run recorded and passed."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import device_process, server_only
from fedseq.common.protocol.tensors import decode_tensors
from fedseq.server.ops.campaign import load_campaign
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.pools.processes import stop_children

pytestmark = server_only


def _campaign(folder: Path, data_root: Path, body: str, **base: str) -> Path:
    """A base config (5% of FMNIST over 5 clients, one thread) and a campaign file over it, whose
    `set` gives the data root and `base` (key=TOML value) to every run."""
    (folder / "base.toml").write_text(
        "seed = 0\nrounds = 2\n[data]\ndataset = \"fmnist\"\nfraction = 0.05\nnum_clients = 5\n"
        "alpha = 0.5\n[algorithm]\nfinetune_epochs = 1\n[train]\njoin_ratio = 0.6\n"
        "local_epochs = 1\nthreads = 1\n")
    sets = [f"data.root={str(data_root)!r}", *(f"{k}={v}" for k, v in base.items())]
    (folder / "campaign.toml").write_text(f'config = "base.toml"\nset = {json.dumps(sets)}\n{body}')
    return folder / "campaign.toml"


def _sim(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["fedseq-sim", "-q", *args], capture_output=True, text=True,
                          timeout=timeout)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return decode_tensors((run / "model.safetensors").read_bytes())


def _same(run: Path, weights: dict[str, torch.Tensor]) -> bool:
    saved = _weights(run)
    return saved.keys() == weights.keys() and all(torch.equal(saved[k], v) for k, v in weights.items())


def _outcomes(out: Path) -> dict[str, str]:
    return {r["folder"]: r["outcome"]["state"]
            for r in json.loads((out / "campaign.json").read_text())["runs"]}


@pytest.mark.slow("a campaign of several runs back to back: 42 s on 2 cores")
def test_a_campaign_in_simulation_is_its_runs_and_continues_where_it_stopped(data_root, tmp_path,
                                                                           one_thread):
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg", "fedseq-anti"]\nseeds = "0-1"\n'
                     'order = ["seed", "algorithm", "setting"]\n')
    _, runs = load_campaign(file)
    assert [r.folder for r in runs] == ["fedavg/seed-0", "fedseq-anti/seed-0", "fedavg/seed-1",
                                        "fedseq-anti/seed-1"]
    out = tmp_path / "out"
    done = _sim("--campaign", str(file), "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(_outcomes(out).values()) == {"finished"}
    for run in runs:  # each run is what fedseq-sim gives for its config and seed
        assert _same(out / run.folder, run_simulation(run.cfg, None).global_weights), run.folder
        assert json.loads((out / run.folder / "status.json").read_text())["state"] == "finished"

    again = _sim("--campaign", str(file), "--out", str(out))
    assert again.returncode == 0 and "4 finished before" in again.stderr

    # only runs added: appended, the others kept
    file.write_text(file.read_text().replace('seeds = "0-1"', 'seeds = "0-2"'))
    more = _sim("--campaign", str(file), "--out", str(out))
    assert more.returncode == 0, more.stderr[-2000:]
    assert "2 runs added to the 4" in more.stderr and "4 finished before, 2 finished" in more.stderr
    assert len(_outcomes(out)) == 6

    # a run's config changed: refused in one line, nothing touched
    file.write_text(file.read_text().replace('set = [', 'set = ["train.lr=0.02", '))
    changed = _sim("--campaign", str(file), "--out", str(out))
    assert changed.returncode == 2
    assert "changed run fedavg/seed-0" in changed.stderr and "train.lr" in changed.stderr
    assert len(changed.stderr.strip().splitlines()) == 1


@pytest.mark.slow("a campaign of several runs back to back: 7 s on 2 cores")
def test_a_failed_run_is_recorded_and_the_campaign_goes_on_or_stops(data_root, tmp_path):
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg"]\nseeds = [0]\n'
                     'order = ["setting", "algorithm", "seed"]\n'
                     '[settings.broken]\nset = ["data.root=\\"/nonexistent/fedseq-data\\""]\n'
                     '[settings.fine]\nset = ["rounds=2"]\n')
    out = tmp_path / "go-on"
    done = _sim("--campaign", str(file), "--out", str(out))
    assert done.returncode == 1  # a run failed
    assert _outcomes(out) == {"broken/fedavg/seed-0": "failed", "fine/fedavg/seed-0": "finished"}
    reason = json.loads((out / "campaign.json").read_text())["runs"][0]["outcome"]["reason"]
    assert "/nonexistent/fedseq-data" in reason

    stop = tmp_path / "stop"
    text = file.read_text().replace('order = [', 'on_failure = "stop"\norder = [')
    file.write_text(text)
    done = _sim("--campaign", str(file), "--out", str(stop))
    assert done.returncode == 1 and "campaign stopped" in done.stderr
    assert _outcomes(stop) == {"broken/fedavg/seed-0": "failed", "fine/fedavg/seed-0": "pending"}


@pytest.mark.slow("a campaign of several runs back to back: 4 s on 2 cores")
def test_a_bad_campaign_file_is_one_line(tmp_path, data_root):
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg"]\nseedz = [0]\n')
    done = _sim("--campaign", str(file), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "seedz" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavgg"]\n')
    done = _sim("--campaign", str(file), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "fedavgg" in done.stderr


@pytest.mark.slow("a campaign of four runs on Mosquitto with two daemons, the coordinator killed once")
def test_a_campaign_on_a_fleet_keeps_its_daemons_and_survives_a_killed_coordinator(
        data_root, tmp_path, mosquitto, one_thread):
    """2 algorithms x 2 seeds on Mosquitto (broker.conf, ACL) with two real daemons started once:
    the coordinator is SIGKILLed during the second run and the same command finishes the
    campaign; every run is bitwise the simulation's, and the daemons were never restarted."""
    port, home, _ = mosquitto
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg", "fedper"]\nseeds = [0, 1]\n',
                     **{"rounds": "4", "deploy.min_devices": "2", "deploy.round_timeout_s": "120",
                        "deploy.eval_timeout_s": "120"})
    _, runs = load_campaign(file)
    out = tmp_path / "out"
    cmd = ["fedseq-server", "campaign", str(file), "--out", str(out), "-q", "--broker",
           f"mqtt://127.0.0.1:{port}", "--username", "coordinator", "--password-file",
           str(home / "coordinator.pw")]
    devices = [device_process(n, port, home, data_root) for n in ("local01", "local02")]
    try:
        server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        second = out / runs[1].folder / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and server.poll() is None and not (
                second.exists() and len(second.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        assert server.poll() is None, server.stderr.read()[-2000:] if server.stderr else ""
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        assert _outcomes(out)[runs[0].folder] == "finished"
        assert _outcomes(out)[runs[1].folder] == "running"  # as the kill left it
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "1 finished before, 3 finished" in done.stderr
        assert f"campaign run 2 of 4: {runs[1].name} (resume)" in done.stderr
        assert all(d.poll() is None for d in devices), "a daemon stopped during the campaign"
    finally:
        stop_children(devices)
    assert set(_outcomes(out).values()) == {"finished"}
    for run in runs:
        assert _same(out / run.folder, run_simulation(run.cfg, None).global_weights), run.folder


@pytest.mark.slow("a campaign of several runs back to back: 7 s on 2 cores")
def test_the_campaign_report_groups_its_runs(tmp_path, data_root):
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg"]\nseeds = [0, 1]\n'
                     '[settings.a]\nset = ["rounds=1"]\n[settings.b]\nset = ["rounds=2"]\n')
    out = tmp_path / "out"
    assert _sim("--campaign", str(file), "--out", str(out)).returncode == 0
    report = subprocess.run(["fedseq", "report", str(out),
                             "--out", str(tmp_path / "rep"), "--no-figures"],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "| a/fedavg |" in summary and "| b/fedavg |" in summary


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[2]
                                                         / "examples" / "campaigns").glob("*.toml")))
def test_example_campaigns_load(name):
    file = Path(__file__).resolve().parents[2] / "examples" / "campaigns" / name
    spec, runs = load_campaign(file)
    assert runs and len({r.folder for r in runs}) == len(runs)


def test_campaign_names_and_folders_stay_inside(tmp_path, data_root):
    """Hardening V, finding 8: a setting name with a trailing newline is refused (a full match,
    not `$`); `fedseq report` on a campaign folder reads only run folders inside it; a
    campaign.json of another shape is one line when the campaign is continued."""
    from fedseq.common.errors import ConfigError
    from fedseq.server.ops.campaign import Campaign
    from fedseq.server.report.load import expand_sweeps

    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg"]\n[settings."a\\n"]\nset = []\n')
    with pytest.raises(ConfigError, match="setting") as err:
        load_campaign(file)
    assert "\n" not in str(err.value)
    out = tmp_path / "out"
    (out / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "metrics.jsonl").write_text("")
    for folder in ("../elsewhere", str(tmp_path / "elsewhere"), "a/../../elsewhere"):
        (out / "campaign.json").write_text(json.dumps({"runs": [{"folder": folder}]}))
        with pytest.raises(ConfigError, match="outside the campaign's folder") as err:
            expand_sweeps([out], None)
        assert "\n" not in str(err.value)
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg"]\n')
    _, runs = load_campaign(file)
    for odd in ([1], {"runs": 3}, {"runs": [7]}, {"runs": [{"folder": "fedavg/seed-0", "config": 3}]},
                {"runs": [{"folder": 5, "config": {}}]}):
        (out / "campaign.json").write_text(json.dumps(odd))
        with pytest.raises(ConfigError, match="damaged") as err:
            Campaign(out, runs, file).open(lambda m: None)
        assert "\n" not in str(err.value)


def test_a_config_or_data_error_skips_the_rest_of_its_setting(tmp_path, data_root):
    """Newcomer II, finding 6: a missing dataset (or any config error) fails the first run of its
    setting and skips the others, which would only repeat it; another setting goes on."""
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg", "fedprox"]\nseeds = [0, 1]\n'
                     'order = ["setting", "algorithm", "seed"]\n'
                     '[settings.broken]\nset = ["data.root=\\"/nonexistent/fedseq-data\\""]\n'
                     '[settings.other]\nset = ["data.num_clients=1000"]\n')
    out = tmp_path / "out"
    done = _sim("--campaign", str(file), "--out", str(out))
    assert done.returncode == 1
    outcomes = _outcomes(out)
    assert outcomes["broken/fedavg/seed-0"] == "failed" and outcomes["other/fedavg/seed-0"] == "failed"
    assert [k for k, v in outcomes.items() if v == "skipped"] == [
        "broken/fedavg/seed-1", "broken/fedprox/seed-0", "broken/fedprox/seed-1",
        "other/fedavg/seed-1", "other/fedprox/seed-0", "other/fedprox/seed-1"]
    assert done.stderr.count("are skipped") == 2, done.stderr


def test_a_campaign_recorded_before_a_key_existed_continues(tmp_path, data_root):
    """A newer fedseq adds keys with defaults ([privacy]) and moves keys (the former flat
    [algorithm] keys, into tables): a campaign folder whose recorded configs lack the new keys or
    use the former ones is the same campaign, not a changed file; a real change is still
    refused."""
    from fedseq.common.errors import ConfigError
    from fedseq.server.ops.campaign import Campaign

    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg"]\n')
    _, runs = load_campaign(file)
    out = tmp_path / "out"
    Campaign(out, runs, file).open(lambda m: None)
    book = json.loads((out / "campaign.json").read_text())
    for r in book["runs"]:
        r["config"].pop("privacy")
        r["config"]["algorithm"].update(mu=0.001, ditto_lambda=0.1)  # former keys, defaults
    (out / "campaign.json").write_text(json.dumps(book))
    Campaign(out, runs, file).open(lambda m: None)  # no error
    _, other = load_campaign(file, ["train.lr=0.5"])
    with pytest.raises(ConfigError, match="changed run"):
        Campaign(out, other, file).open(lambda m: None)


def test_a_setting_that_names_its_algorithms_runs_only_those(tmp_path, data_root):
    """An arm that is one algorithm (Results V's campaign): a setting's own `algorithms` replace
    the campaign's for that setting alone, in the grid's order."""
    file = _campaign(tmp_path, data_root, 'algorithms = ["fedavg"]\norder = ["seed", "setting", '
                     '"algorithm"]\nseeds = "0,1"\n[settings.base]\nset = []\n[settings.anti]\n'
                     'algorithms = ["fedseq-anti", "fedavg"]\nset = ["train.local_epochs=2"]\n')
    _, runs = load_campaign(file)
    assert [r.folder for r in runs] == [
        "base/fedavg/seed-0", "anti/fedavg/seed-0", "anti/fedseq-anti/seed-0",
        "base/fedavg/seed-1", "anti/fedavg/seed-1", "anti/fedseq-anti/seed-1"]
    assert {r.cfg.algorithm.name for r in runs if r.setting == "anti"} == {"fedavg", "fedseq-anti"}
    assert all(r.cfg.train.local_epochs == 2 for r in runs if r.setting == "anti")
