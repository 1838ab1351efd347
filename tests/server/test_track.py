"""fedseq export tensorboard: event files that hold every round's numbers of simulated runs, a
sweep's seeds side by side; without tensorboardX a one-line hint."""

import json
import struct
import subprocess
import sys

import pytest

from conftest import quick_config
from fedseq.server.seeds import seed_config
from fedseq.server.simulation import run_simulation

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


def test_export_writes_every_round_of_each_run(data_root, tmp_path):
    base = quick_config(data_root, "algorithm.name=fedbabu", "train.threads=1", "rounds=2",
                        "algorithm.finetune_epochs=1")
    for s in (0, 1):
        run_simulation(seed_config(base, s, ("init",)), tmp_path / "sweep" / f"seed-{s}")
    r = subprocess.run([sys.executable, "-m", "fedseq.server.tools", "export", "tensorboard",
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
    subprocess.run([sys.executable, "-m", "fedseq.server.tools", "export", "tensorboard",
                    str(tmp_path / "sweep"), "--out", str(tmp_path / "tb")], check=True,
                   capture_output=True, timeout=300)
    assert len(list((tmp_path / "tb" / "sweep" / "seed-0").iterdir())) == 1
