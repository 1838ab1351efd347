"""fedseq report on short real runs: figures exist and are images, the tables hold the runs'
numbers, a paper's table sits beside them, bad input is one line."""

import csv
import json
import subprocess
import sys

import pytest

from conftest import quick_config
from fedseq.server.ops.simulation import run_simulation

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


#: the runs the reports read: 2 rounds on 2% of FMNIST over 5 clients, fine-tuned one epoch
RUN = ("rounds=2", "train.threads=1", "data.fraction=0.02", "algorithm.finetune_epochs=1")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, data_root):
    root = tmp_path_factory.mktemp("runs")
    for name in ("fedavg", "fedbabu"):
        run_simulation(quick_config(data_root, f"algorithm.name={name}", *RUN), root / name)
    return root


def test_the_reports_runs_are_whole(two_runs):
    """What the tests below read (the module's two runs: first here, so that their set-up is
    this test's time, not a report's): 2 rounds each, FedBABU fine-tuned."""
    for name in ("fedavg", "fedbabu"):
        rows = [json.loads(x) for x in (two_runs / name / "metrics.jsonl").read_text().splitlines()]
        assert [r.get("round") for r in rows if r.get("status") == "ok"] == [0, 1], name
    assert (two_runs / "fedbabu" / "clients.csv").is_file()


def _report(*args):
    return subprocess.run([sys.executable, "-m", "fedseq.server.cli.tools", "report", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow("figures drawn for whole runs: 10 s on 2 cores")
def test_report_writes_figures_and_tables(two_runs, tmp_path):
    out = tmp_path / "rep"
    r = _report(str(two_runs / "fedavg"), str(two_runs / "fedbabu"), "--out", str(out),
                "--paper", "fedreg-table6")
    assert r.returncode == 0, r.stderr
    for name in ("accuracy.png", "clients.png", "cost.png", "seconds.png"):
        blob = (out / name).read_bytes()
        assert blob.startswith(PNG) and len(blob) > 10_000, name
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["algorithm"] for r in rows] == ["fedavg", "fedbabu"]
    metrics = [json.loads(x) for x in (two_runs / "fedbabu" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["finetuned"] == "True" and rows[1]["rounds"] == "2"
    assert float(rows[1]["P final"]) == round(100 * metrics[-1]["personal_acc"], 2)
    # FedBABU's form: mean ± sd of the final accuracies over clients, each client once
    accs = [100 * float(c["accuracy"])
            for c in csv.DictReader((two_runs / "fedbabu" / "clients.csv").open())]
    assert len(accs) == 5 and float(rows[1]["client mean"]) == round(sum(accs) / 5, 2)
    fedavg = [json.loads(x) for x in (two_runs / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert float(rows[0]["G best"]) == round(100 * max(m["global_acc"] for m in fedavg), 2)
    assert rows[0]["paper G"] == "82.13" and rows[1]["paper P"] == "97.76"
    md = (out / "summary.md").read_text()
    assert "| fedavg | fedavg | fmnist | cnn | 1 | - | 2 |" in md and "FedReG Table 6" in md
    # the paper's columns sit right of the metric they compare with: its testbed "P" scores
    # locally trained models (our L and Lr), not the aggregated personalized model (our P)
    assert "| G best | paper G |" in md and "| Lr best | paper P |" in md
    assert "F best" not in md and "F (data.placement" not in md  # no run scored on devices
    # 2 rounds on 2% of the data over 5 clients: the paper's numbers are not for that setting
    assert "The paper's numbers come from its own setting" in md
    assert "rounds 2 (the paper: 100)" in md and "data.num_clients 5 (the paper: 30)" in md
    # the terminal gets the table's essentials (fitting 100 columns) and where the rest is
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["run", "algorithm", "seeds", "rounds"]
    assert "paper G" in lines[0] and lines[1].split()[:2] == ["fedavg", "fedavg"]
    assert all(len(x) <= 100 for x in lines[:3]) and "every column, with the notes" in r.stdout


def test_an_unfinished_run_says_so(two_runs, tmp_path, data_root):
    """A run stopped after 1 of its 2 rounds is marked in the table, never shown as whole."""
    part = tmp_path / "part"
    cfg = quick_config(data_root, "algorithm.name=fedavg", *RUN, "seed=1")

    def stop_after_round_0(row):
        if row.round == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_simulation(cfg, part, stop_after_round_0)
    r = _report(str(part), "--out", str(tmp_path / "rep"), "--no-figures")
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| part | fedavg | fmnist | cnn | 1 | - | 1 of 2, interrupted |" in md
    assert "finish the runs" in md
    # grouped with the finished run of the same config (another seed): the group says it mixes them
    r = _report(str(two_runs / "fedavg"), str(part), "--out", str(tmp_path / "rep"),
                "--no-figures")
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| fedavg (+1) | fedavg | fmnist | cnn | 2 | data,init,selection,training | 1 of 2, mixed |" \
        in md, md[:900]


def test_a_group_trained_on_cpu_and_gpu_says_so(two_runs, tmp_path):
    """The same config and seed on a GPU is another run (docs/explanation/reproducibility.md): a group that
    mixes devices names them; CPU-only tables carry no device column."""
    import shutil

    gpu = tmp_path / "fedavg"
    shutil.copytree(two_runs / "fedavg", gpu)
    status = json.loads((gpu / "status.json").read_text())
    assert status["device"] == "cpu"
    (gpu / "status.json").write_text(json.dumps({**status, "device": "NVIDIA H100 80GB HBM3"}))
    config = (gpu / "config.toml").read_text()  # another seed of the config (same-seed runs stay apart)
    assert "\nseed = 0\n" in config
    (gpu / "config.toml").write_text(config.replace("\nseed = 0\n", "\nseed = 1\n"))
    r = _report(str(two_runs / "fedavg"), "--out", str(tmp_path / "cpu"), "--no-figures")
    assert r.returncode == 0, r.stderr
    assert "device" not in (tmp_path / "cpu" / "summary.md").read_text().splitlines()[0]
    r = _report(str(two_runs / "fedavg"), str(gpu), "--out", str(tmp_path / "rep"), "--no-figures")
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| rounds | finetuned | device | G best |" in md
    assert "| NVIDIA H100 80GB HBM3 + cpu |" in md


def test_runs_of_the_same_seed_are_never_merged(two_runs, tmp_path):
    """Newcomer II, finding 2: a simulation and a deployment of one config and seed (here a copy
    of a run) were grouped as "2 seeds" with a mean and sd over them; now each is its own row,
    named by its folder, and --label names each row."""
    import shutil

    other = tmp_path / "fedavg-fleet"
    shutil.copytree(two_runs / "fedavg", other)
    r = _report(str(two_runs / "fedavg"), str(other), "--out", str(tmp_path / "rep"), "--no-figures")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader((tmp_path / "rep" / "summary.csv").open()))
    assert [(x["run"], x["seeds"]) for x in rows] == [("fedavg", "1"), ("fedavg-fleet", "1")]
    r = _report(str(two_runs / "fedavg"), str(other), "--label", "sim", "--label", "fleet",
                "--out", str(tmp_path / "lab"), "--no-figures")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader((tmp_path / "lab" / "summary.csv").open()))
    assert [x["run"] for x in rows] == ["sim", "fleet"]


def test_a_deployment_names_its_devices(two_runs, tmp_path):
    """A run directory with devices.json (a deployment) says in the device column what trained
    it, as each device last described itself, and how many devices never did."""
    import shutil

    dep = tmp_path / "fedavg"
    shutil.copytree(two_runs / "fedavg", dep)
    nano = {"seen": 1.0, "torch": "1.12.1", "torch_device": "cuda:0", "gpu": "Tegra",
            "cpu": "NVIDIA Jetson Nano Developer Kit"}
    stacks = {"jetson01": [nano], "jetson02": [{**nano, "torch": "1.10.0"}, nano],
              "jetson03": [{**nano, "torch_device": "cpu", "gpu": ""}], "jetson04": []}
    (dep / "devices.json").write_text(json.dumps(stacks))
    r = _report(str(dep), "--out", str(tmp_path / "rep"), "--no-figures")
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert ("| 1 x NVIDIA Jetson Nano Developer Kit (cpu, torch 1.12.1); "
            "2 x Tegra (cuda:0, torch 1.12.1); 1 undescribed |") in md


def test_report_bad_input_is_one_line(tmp_path, two_runs):
    r = _report(str(tmp_path), "--out", str(tmp_path / "rep"))
    assert r.returncode == 2 and "not a run directory" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _report(str(two_runs / "fedavg"), "--paper", "nature2030", "--out", str(tmp_path / "rep"))
    assert r.returncode == 2 and "fedreg-table6" in r.stderr


def test_a_run_that_diverged_says_so(data_root, tmp_path):
    # lr 1e4: every client's loss turns NaN (or explodes) in training and in fine-tuning
    run = tmp_path / "nan"
    run_simulation(quick_config(data_root, "algorithm.name=fedbabu", "rounds=1", "train.lr=1e4",
                                "train.threads=1"), run)
    ft = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert ft["phase"] == "finetune" and sorted(ft["diverged"]) == ["0", "1", "2", "3", "4"]
    r = _report(str(run), "--out", str(tmp_path / "rep"), "--no-figures")
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "NaN or Inf loss" in md and "fine-tuning diverged for clients 0, 1, 2, 3, 4" in md
    assert "training updates refused as diverged" in md


def test_strings_from_devices_and_folders_stay_data(two_runs, tmp_path):
    """Hardening III, finding 4: device descriptions (devices.json) and run folder names reach
    summary.md as literal cells (no broken table, heading, HTML or link), summary.csv without a
    formula, the terminal without escape sequences, and the figures ($...$ is no mathtext)."""
    import re
    import shutil

    runs = [tmp_path / "$\\foo$ a|b", tmp_path / "=HYPERLINK(x)"]
    shutil.copytree(two_runs / "fedavg", runs[0])
    shutil.copytree(two_runs / "fedbabu", runs[1])
    evil = {"seen": 1.0, "torch": "1.12\x1b[31m", "torch_device": "cuda:0",
            "gpu": "x|y\n# Heading <script>alert(1)</script> [a](http://e)"}
    (runs[0] / "devices.json").write_text(json.dumps({"jetson01": [evil]}))
    out = tmp_path / "rep"
    r = _report(*map(str, runs), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout
    md = (out / "summary.md").read_text()
    table = [x for x in md.splitlines() if x.startswith("|")]
    bars = {len(re.findall(r"(?<!\\)\|", x)) for x in table}
    assert len(bars) == 1, table  # every row has the header's cells
    assert not any(x.startswith("#") for x in md.splitlines())
    assert "<script>" not in md and not re.search(r"(?<!\\)\[", md) and "\x1b" not in md
    assert "\\$\\\\foo\\$ a\\|b" in md  # the folder's name, every character escaped
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["run"] for r in rows] == ["$\\foo$ a|b", "'=HYPERLINK(x)"]
    assert (out / "accuracy.png").read_bytes().startswith(PNG)


def test_the_model_column_names_a_normalization_other_than_the_default():
    from fedseq.server.report import _model_label

    assert _model_label({"name": "4convnet", "norm": "fedbn"}) == "4convnet (fedbn)"
    assert _model_label({"name": "4convnet", "norm": "batch"}) == "4convnet"
    assert _model_label({"name": "cnn"}) == "cnn"  # a run directory from before model.norm


@pytest.mark.parametrize("name, body", [
    ("status.json", "[1, 2]"),
    ("status.json", '{"state": {"x": 1}, "segments": "no"}'),
    ("status.json", '{"state": "finished", "segments": [1, {"threads": 2}, {"from_round": 0}]}'),
    ("devices.json", '["jetson01"]'),
    ("devices.json", '{"d1": "x", "d2": [3], "d3": [{"gpu": 5}]}'),
    ("config.toml", "model = 3\n"),
    ("config.toml", "[data\n"),
    ("clients.csv", "client,accuracy\n0,abc\n"),
    ("clients.csv", "client,accuracy\n0,0.5,extra\n1\n"),
    ("status.json", b"\xff\xfe"),
])
def test_odd_shaped_run_files_are_one_line_or_read(two_runs, tmp_path, name, body):
    """Hardening IV, finding 9: fedseq report on run directories written by others: an odd-shaped
    status.json, devices.json, config.toml or clients.csv is read where its shape allows, else
    refused in one line naming the file; never a traceback."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_runs / "fedavg", run)
    (run / name).write_bytes(body if isinstance(body, bytes) else body.encode())
    r = _report(str(run), "--out", str(tmp_path / "rep"))
    if r.returncode == 0:
        assert (tmp_path / "rep" / "summary.md").exists()
    else:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and name in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_the_report_reads_runs_without_loading_torch(two_runs, tmp_path):
    """Run directories are read, grouped and tabled without torch (the config's registry checks
    are left to where runs are made): a fresh interpreter's modules after a report."""
    code = ("import sys; from pathlib import Path; from fedseq.server.report import report; "
            f"report([Path({str(two_runs / 'fedavg')!r}), Path({str(two_runs / 'fedbabu')!r})], "
            f"Path({str(tmp_path / 'rep')!r}), figures=False); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_a_new_numeric_field_reaches_the_report_by_itself(monkeypatch):
    """Open records: a numeric RoundRecord field without a column of its own is summarized by
    how its field says (sum by default), for every run and group, with no change to the report."""
    import importlib

    from pydantic import Field, create_model

    from fedseq.server.rounds import records

    summarize_module = importlib.import_module("fedseq.server.report.summarize")

    Extended = create_model("Extended", __base__=records.RoundRecord,
                            retries=(int | None, None),
                            peak_mb=(float | None, Field(None, json_schema_extra=records.summary("max"))))
    assert Extended.picked_up()["retries"] == "sum" and Extended.picked_up()["peak_mb"] == "max"
    monkeypatch.setattr(summarize_module, "RoundRecord", Extended)
    rows = [Extended(round=0, phase="train", retries=2, peak_mb=10.5),
            Extended(round=1, phase="train", peak_mb=12.0),
            Extended(round=2, phase="train", retries=3)]
    got = summarize_module.picked_up(rows)
    assert got["retries (sum)"] == 5 and got["peak_mb (max)"] == 12.0
    assert got["wire_bytes_in (sum)"] is None  # no row measured it: no zero made up


@pytest.mark.slow("figures drawn for whole runs: 4 s on 2 cores")
def test_runs_under_a_wire_codec_say_which(two_runs, tmp_path, data_root):
    """A codec column appears once a run uses one; its MB moved is the coded bytes'."""
    coded = tmp_path / "int8"
    run_simulation(quick_config(data_root, "algorithm.name=fedavg", *RUN, "wire.up=int8",
                                "wire.down=fp16"), coded)
    out = tmp_path / "rep"
    r = _report(str(two_runs / "fedavg"), str(coded), "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [x["wire"] for x in rows] == ["", "int8/fp16"]
    assert float(rows[1]["MB moved"]) < 0.4 * float(rows[0]["MB moved"])
    assert "| wire |" in (out / "summary.md").read_text()


def test_a_run_with_another_aggregation_rule_says_which(two_runs, tmp_path):
    """Issue 94, finding 1: two FedAvg runs with different rules were both "fedavg" in the
    report. A rule other than the mean is named beside the algorithm (and so is never compared
    with a paper's FedAvg row)."""
    import shutil

    other = tmp_path / "fedavg-median"
    shutil.copytree(two_runs / "fedavg", other)
    config = other / "config.toml"
    text = config.read_text()
    assert 'rule = "mean"' in text
    config.write_text(text.replace('rule = "mean"', 'rule = "median"'))
    r = _report(str(two_runs / "fedavg"), str(other), "--out", str(tmp_path / "rep"), "--no-figures")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader((tmp_path / "rep" / "summary.csv").open()))
    assert [(x["run"], x["algorithm"]) for x in rows] == [("fedavg", "fedavg"),
                                                         ("fedavg-median", "fedavg+median")]
    # a rule's options are part of its name: the same rule with other options is another method
    assert "[aggregation.options]\n" in text  # recorded, empty: the mean takes none
    config.write_text(text.replace('rule = "mean"', 'rule = "median"')
                      .replace("[aggregation.options]\n", "[aggregation.options]\niters = 8\n"))
    r = _report(str(other), "--out", str(tmp_path / "rep2"), "--no-figures")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader((tmp_path / "rep2" / "summary.csv").open()))
    assert [x["algorithm"] for x in rows] == ["fedavg+median(iters=8)"]
