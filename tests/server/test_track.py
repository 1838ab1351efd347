"""fedseq export tensorboard|mlflow: event files (or MLflow runs) that hold every round's numbers
of simulated runs, a sweep's seeds side by side; without the library, or with no tracker
there, a one-line error."""

import json
import os
import struct
import subprocess
import sys

import pytest

from conftest import quick_config
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.rounds.seeds import seed_config

pytest.importorskip("tensorboardX")


def _scalars(folder):
    """{tag: {step: value}} read back from the TFRecord event files (length, crc, Event, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict = {}
    for f in folder.glob("events.out.tfevents.*"):
        blob = f.read_bytes()
        i = 0
        while i < len(blob):
            (n,) = struct.unpack("<Q", blob[i:i + 8])
            event = Event.FromString(blob[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.mark.slow("runs exported to TensorBoard and MLflow: 10 s on 2 cores")
def test_export_writes_every_round_of_each_run(data_root, tmp_path):
    base = quick_config(data_root, "algorithm.name=fedbabu", "train.threads=1", "rounds=2",
                        "algorithm.finetune_epochs=1")
    for s in (0, 1):
        run_simulation(seed_config(base, s, ("init",)), tmp_path / "sweep" / f"seed-{s}")
    r = subprocess.run([sys.executable, "-m", "fedseq.server.cli.tools", "export", "tensorboard",
                        str(tmp_path / "sweep"), "--out", str(tmp_path / "tb")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sweep/seed-0, sweep/seed-1" in r.stdout
    for s in (0, 1):
        rows = [json.loads(x) for x in
                (tmp_path / "sweep" / f"seed-{s}" / "metrics.jsonl").read_text().splitlines()]
        got = _scalars(tmp_path / "tb" / "sweep" / f"seed-{s}")
        train = [x for x in rows if x["phase"] == "train"]
        assert got["accuracy/G_global"] == pytest.approx(
            {x["round"]: 100 * x["global_acc"] for x in rows})
        assert got["accuracy/Lr_local_round_trainers"] == pytest.approx(
            {x["round"]: 100 * x["round_local_acc"] for x in train})
        assert got["cost/bytes_down"] == {x["round"]: x["bytes_down"] for x in train}
        assert got["accuracy/P_after_finetuning"] == pytest.approx({2: 100 * rows[-1]["personal_acc"]})
    # exporting again replaces, not doubles, the events
    subprocess.run([sys.executable, "-m", "fedseq.server.cli.tools", "export", "tensorboard",
                    str(tmp_path / "sweep"), "--out", str(tmp_path / "tb")], check=True,
                   capture_output=True, timeout=300)
    assert len(list((tmp_path / "tb" / "sweep" / "seed-0").iterdir())) == 1


@pytest.mark.slow("runs exported to TensorBoard and MLflow: 8 s on 2 cores")
def test_export_from_inside_a_run_deletes_nothing_but_its_own_events(data_root, tmp_path):
    """Hardening III, finding 7: `fedseq export tensorboard .` from a run's folder (the default
    --out is a folder inside it) and `..` from a subfolder removed whole folders; now only event
    files the export replaces go, and every other file stays."""
    cfg = quick_config(data_root, "algorithm.name=fedavg", "train.threads=1", "rounds=1",
                       "train.eval_every=1")
    run = tmp_path / "run"
    run_simulation(cfg, run)
    (run / "notes").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for where, target, out in ((run, ".", "tb"), (run / "notes", "..", "tb"), (run, ".", ".")):
        r = subprocess.run([sys.executable, "-m", "fedseq.server.cli.tools", "export", "tensorboard",
                            target, "--out", out], capture_output=True, text=True, timeout=300,
                           cwd=where)
        assert r.returncode == 0, r.stderr
        assert "run" in r.stdout
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert set(before) <= set(after), set(before) - set(after)


@pytest.mark.slow("runs exported to TensorBoard and MLflow: 7 s on 2 cores")
def test_mlflow_export_holds_every_round_and_replaces_itself(data_root, tmp_path):
    """Into a real MLflow store (its local file store stands in for a tracking server: the
    client calls are the same): metrics per round, params, artifact, status; again = replaced."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    cfg = quick_config(data_root, "algorithm.name=fedbabu", "train.threads=1", "rounds=2",
                       "algorithm.finetune_epochs=1")
    run_dir = tmp_path / "babu"
    run_simulation(cfg, run_dir)
    uri = (tmp_path / "mlruns").as_uri()
    env = {**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow 3 wants it for a folder
    cmd = [sys.executable, "-m", "fedseq.server.cli.tools", "export", "mlflow", str(run_dir),
           "--tracking-uri", uri, "--experiment", "testbed"]
    for _ in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
    assert "wrote 1 runs to MLflow experiment 'testbed'" in r.stdout
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("testbed")
        (run,) = client.search_runs([exp.experiment_id])  # the second export replaced the first
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(run.info.run_id, "accuracy/G_global")
    assert {m.step: m.value for m in history} == pytest.approx(
        {x["round"]: 100 * x["global_acc"] for x in rows})
    tuned = client.get_metric_history(run.info.run_id, "accuracy/P_after_finetuning")
    assert [(m.step, m.value) for m in tuned] == [(2, pytest.approx(100 * rows[-1]["personal_acc"]))]
    assert run.data.params["algorithm.name"] == "fedbabu" and run.data.params["train.lr"] == "0.01"
    assert run.info.status == "FINISHED" and run.info.run_name == "babu"
    assert run.data.tags["fedseq.run_dir"] == str(run_dir.resolve())
    assert "config.toml" in [a.path for a in client.list_artifacts(run.info.run_id)]


@pytest.mark.slow("runs exported to TensorBoard and MLflow: 4 s on 2 cores")
def test_mlflow_export_to_nowhere_is_one_line(tmp_path, data_root):
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    run_simulation(quick_config(data_root, "rounds=1", "train.threads=1"), run_dir)
    r = subprocess.run([sys.executable, "-m", "fedseq.server.cli.tools", "export", "mlflow",
                        str(run_dir), "--tracking-uri", "nosuchscheme://x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: MLflow at 'nosuchscheme://x'"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_every_numeric_field_of_a_row_reaches_the_trackers():
    """Open records: a numeric field the named tags do not cover is logged by its name, and
    a new field would be too (checked against every numeric field RoundRecord has)."""
    from fedseq.server.ops.track import NAMED, row_scalars
    from fedseq.server.rounds.records import RoundRecord

    numeric = {n for n, f in RoundRecord.model_fields.items()
               if any(t in str(f.annotation) for t in ("int", "float")) and "dict" not in
               str(f.annotation) and "list" not in str(f.annotation) and "bool" not in str(f.annotation)}
    row = RoundRecord(round=4, phase="train", **{n: 7 for n in numeric - {"v", "round"}})
    _, got = row_scalars(row, {})
    assert {k.removeprefix("metrics/") for k in got if k.startswith("metrics/")} == numeric - NAMED
    assert "metrics/wire_bytes_in" in got and "metrics/late_updates" in got


def test_a_device_placed_rows_federated_accuracy_is_tracked_as_F():
    """data.placement = "device": a row's federated_acc is the accuracy F (accuracy/F_federated,
    in % like the others), not a generic metric, and the report does not sum it as one."""
    from fedseq.server.ops.track import row_scalars
    from fedseq.server.rounds.records import RoundRecord

    row = RoundRecord(round=3, phase="train", global_acc=0.5, federated_acc=0.625)
    _, got = row_scalars(row, {})
    assert got["accuracy/F_federated"] == 62.5 and got["accuracy/G_global"] == 50.0
    assert "metrics/federated_acc" not in got
    assert "federated_acc" not in RoundRecord.picked_up()
