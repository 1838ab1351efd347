"""Seeds as an axis: the four random streams follow `seed` or their own pin, independently; a
sweep (`fedseq-sim --seeds`) writes one run per seed, continues where it stopped and refuses a
folder of another config; `fedseq report` groups the seeds of one config (mean, sd, min, max)."""

import csv
import json
import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import quick_config
from fedseq.common.config import SEED_STREAMS
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.rounds.coordinator import RunPaused, select_clients
from fedseq.server.rounds.experiment import load_experiment
from fedseq.server.rounds.seeds import parse_seeds, parse_vary, seed_config


def _streams(cfg):
    """What each stream decided for a config: the partition, the initial weights, the clients
    of round 1 (of 30), and the batches (the weights after one round of local training)."""
    exp = load_experiment(cfg)
    parts = [np.asarray(s.train).tolist() for s in exp.data.clients]
    init = torch.cat([p.detach().flatten() for p in exp.model.parameters()])
    chosen = select_clients(cfg.seed_for("selection"), 1, 30, 6)
    return parts, init, chosen


@pytest.mark.parametrize("vary", [("init",), ("data",), ("selection",), ("data", "training")])
def test_each_stream_follows_the_seed_only_where_varied(data_root, vary):
    base = quick_config(data_root, "seed=7")
    a, b = seed_config(base, 0, vary), seed_config(base, 1, vary)
    for stream in SEED_STREAMS:
        expect_differ = stream in vary
        assert (a.seed_for(stream) != b.seed_for(stream)) == expect_differ
        if not expect_differ:
            assert a.seed_for(stream) == 7  # pinned at the config's own value
    (pa, ia, sa), (pb, ib, sb) = _streams(a), _streams(b)
    assert (pa != pb) == ("data" in vary)
    assert (not torch.equal(ia, ib)) == ("init" in vary)
    assert (sa != sb) == ("selection" in vary)


def test_a_private_sweep_leaves_the_noise_seed_each_runs_secret(data_root):
    """Under [privacy] a sweep does not pin the noise to the config's seed (which every device
    gets): each seed's run draws its own secret (Ledger.noise_seed); a pinned one stays pinned."""
    base = quick_config(data_root, "seed=7", "privacy.enabled=true")
    assert seed_config(base, 1, ("init",)).seeds.noise is None
    pinned = quick_config(data_root, "seed=7", "privacy.enabled=true", "seeds.noise=3")
    assert seed_config(pinned, 1, ("init",)).seeds.noise == 3
    assert seed_config(pinned, 1, ("noise",)).seeds.noise is None


def test_training_stream_changes_batches_alone(data_root):
    base = quick_config(data_root, "rounds=1", "train.threads=1", "algorithm.name=fedavg")
    runs = [run_simulation(seed_config(base, s, ("training",)), None) for s in (0, 1)]
    same_start = [load_experiment(seed_config(base, s, ("training",))) for s in (0, 1)]
    assert all(torch.equal(x, y) for x, y in zip(same_start[0].model.parameters(),
                                                 same_start[1].model.parameters(), strict=True))
    assert any(not torch.equal(runs[0].global_weights[k], runs[1].global_weights[k])
               for k in runs[0].global_weights)


def test_nothing_pinned_is_the_plain_seed_and_devices_see_no_pinned_stream(data_root):
    cfg = quick_config(data_root, "seed=5")
    assert all(cfg.seed_for(s) == 5 for s in SEED_STREAMS)
    assert not any(cfg.for_devices()["seeds"].values())
    pinned = quick_config(data_root, "seed=5", "seeds.init=2")
    assert pinned.seed_for("init") == 2 and pinned.for_devices()["seeds"]["init"] == 2


def test_seed_lists_and_streams_parse_or_explain():
    assert parse_seeds("0-2,7") == [0, 1, 2, 7]
    assert parse_vary("all") == SEED_STREAMS and parse_vary("init, data") == ("init", "data")
    for bad in ("", "a", "3-1", "-1", "0,0"):
        with pytest.raises(Exception, match="--seeds"):
            parse_seeds(bad)
    with pytest.raises(Exception, match="--vary"):
        parse_vary("init,weather")


def _sim(*args):
    return subprocess.run([sys.executable, "-c",
                           "from fedseq.server.cli.commands import sim_main; sim_main()",
                           *args], capture_output=True, text=True, timeout=600)


QUICK = ["--set", "data.fraction=0.05", "--set", "data.num_clients=5", "--set", "data.alpha=0.5",
         "--set", "train.join_ratio=1.0", "--set", "train.local_epochs=1", "--set", "rounds=2",
         "--set", "algorithm.name=fedbabu", "--set", "algorithm.finetune_epochs=1",
         "--set", "train.threads=1", "-q"]


@pytest.mark.slow("whole runs compared seed by seed: 23 s on 2 cores")
def test_a_sweep_writes_one_run_per_seed_and_continues_where_it_stopped(data_root, tmp_path):
    out = tmp_path / "sweep"
    args = ["--set", f"data.root={str(data_root)!r}", *QUICK, "--vary", "init", "--out", str(out)]
    r = _sim(*args, "--seeds", "0,1")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["seed-0", "seed-1"]
    first = (out / "seed-0" / "metrics.jsonl").read_text()
    # seed 2 stops after round 0 (a crash, Ctrl-C): the sweep resumes it and keeps the others
    cfg = seed_config(quick_config(data_root, *[a for a in QUICK[1::2] if "=" in a]), 2, ("init",))
    with pytest.raises(RunPaused):
        run_simulation(cfg, out / "seed-2", pause_after=1)
    r = _sim(*args, "--seeds", "0-3")
    assert r.returncode == 0, r.stderr
    assert "seed 0: finished before, kept" in r.stderr and "seed 2: resume" in r.stderr
    assert "seed 3: new" in r.stderr
    assert (out / "seed-0" / "metrics.jsonl").read_text() == first
    for s in range(4):
        assert json.loads((out / f"seed-{s}" / "status.json").read_text())["state"] == "finished"
        rows = [json.loads(x) for x in (out / f"seed-{s}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1, 2]  # two rounds, then fine-tuning
    # another config in the same folder: one line, nothing touched
    r = _sim(*args, "--seeds", "0-3", "--set", "train.lr=0.1")
    assert r.returncode == 2 and "holds a run of another config" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert (out / "seed-0" / "metrics.jsonl").read_text() == first


@pytest.mark.slow("whole runs compared seed by seed: 10 s on 2 cores")
def test_report_groups_the_seeds_of_one_config(data_root, tmp_path):
    pytest.importorskip("matplotlib")
    from fedseq.server.report import report

    base = quick_config(data_root, "algorithm.name=fedavg", "train.threads=1", "rounds=2")
    for s in (0, 1, 2):
        run_simulation(seed_config(base, s, ("init", "training")), tmp_path / "fedavg" / f"seed-{s}")
    run_simulation(quick_config(data_root, "algorithm.name=local", "train.threads=1", "rounds=2"),
                   tmp_path / "local")
    # a run directory written before a key existed records no value for it: it is the default
    old = tmp_path / "fedavg" / "seed-2" / "config.toml"
    text = old.read_text()
    assert 'finetune_blocks = "all"\n' in text
    old.write_text(text.replace('finetune_blocks = "all"\n', ""))
    rows, _ = report([tmp_path / "fedavg", tmp_path / "local"], tmp_path / "rep", figures=False)
    assert [(r["run"], r["seeds"], r["varied"]) for r in rows] == [("fedavg", 3, "init,training"),
                                                                   ("local", 1, "-")]
    finals = []
    for s in (0, 1, 2):
        metrics = [json.loads(x) for x in
                   (tmp_path / "fedavg" / f"seed-{s}" / "metrics.jsonl").read_text().splitlines()]
        finals.append(round(100 * metrics[-1]["global_acc"], 2))
    assert len(set(finals)) > 1  # the seeds did change the run
    table = list(csv.DictReader((tmp_path / "rep" / "summary.csv").open()))
    assert float(table[0]["G final"]) == pytest.approx(statistics.fmean(finals), abs=0.001)
    assert float(table[0]["G final sd"]) == pytest.approx(statistics.stdev(finals), abs=0.001)
    assert float(table[0]["G final min"]) == min(finals)
    assert table[1]["G final sd"] == ""  # one run: no spread
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert f"{float(table[0]['G final']):.2f} ± {float(table[0]['G final sd']):.2f}" in md


@pytest.mark.slow("whole runs compared seed by seed: 11 s on 2 cores")
def test_report_pairs_seeds_against_the_first_group(data_root, tmp_path):
    """Two sweeps of the same seeds: the paired table holds the per-seed differences' mean, sd
    and sign count; a seed the reference lacks is left out; no pairs, no table."""
    pytest.importorskip("matplotlib")
    from fedseq.server.report import report

    finals = {}
    for name, seeds in (("fedavg", (0, 1)), ("fedprox", (0, 1, 2))):
        base = quick_config(data_root, f"algorithm.name={name}", "train.threads=1", "rounds=2",
                            "algorithm.fedprox.mu=0.5")
        for s in seeds:
            out = tmp_path / name / f"seed-{s}"
            run_simulation(seed_config(base, s, SEED_STREAMS), out)
            last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
            finals[name, s] = round(100 * last["global_acc"], 2)
    report([tmp_path / "fedavg", tmp_path / "fedprox"], tmp_path / "rep", figures=False)
    paired = list(csv.DictReader((tmp_path / "rep" / "paired.csv").open()))
    diffs = [finals["fedprox", s] - finals["fedavg", s] for s in (0, 1)]
    assert [(r["run"], r["against"], r["seeds"]) for r in paired] == [("fedprox", "fedavg", "2")]
    assert float(paired[0]["G final diff"]) == pytest.approx(statistics.fmean(diffs), abs=0.001)
    assert float(paired[0]["G final diff sd"]) == pytest.approx(statistics.stdev(diffs), abs=0.001)
    mean = statistics.fmean(diffs)
    assert int(paired[0]["G final same sign"]) == sum(1 for d in diffs if d * mean > 0)
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "Paired by seed against fedavg" in md
    assert f"{float(paired[0]['G final diff']):+.2f} ± " in md
    report([tmp_path / "fedavg", tmp_path / "fedprox" / "seed-2"], tmp_path / "one", figures=False)
    assert not (tmp_path / "one" / "paired.csv").exists()
