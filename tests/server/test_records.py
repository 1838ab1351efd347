"""Round records: typed by attribute, their metrics.jsonl form stable across versions."""

import json

import pytest
from pydantic import ValidationError

from fedseq.common.errors import ConfigError
from fedseq.server.report import load_run, summarize
from fedseq.server.rounds.records import VERSION, RoundRecord

# A deployment round and a fine-tuning row as fedseq wrote them before records had a version
# (keys and value shapes of metrics.jsonl at commit 9b33cd9), plus a key of some other version.
TRAIN_V1 = {
    "round": 3, "phase": "train", "global_acc": 0.5, "personal_acc": 0.75, "local_acc": None,
    "round_local_acc": 0.8, "clients": [1, 4], "reported": [4], "status": "ok", "failed": [1],
    "rejected": {"1": "tensor conv1.weight contains NaN or Inf"}, "outliers": [],
    "bytes_down": 1000, "bytes_up": 200, "trainable_params": 1234, "uploaded_blocks": ["conv1"],
    "train_flops": 5_000_000, "seconds": 2.5, "global_model": "head at init",
    "deadline_s": 60.0, "reporters": {"4": "jetson02"}, "device_failures": {"jetson01": "oom"},
    "late_updates": 0, "missed_deadline": [], "slowest_device": None, "energy_j": 12.5,
    "energy": {"clients": {"4": 12.5}, "devices": {"jetson02": {
        "j": 12.5, "source": "ina3221", "max_temp_c": 51.0, "throttled": False, "gpu_load": 0.9,
        "mem_available_mb": 800, "w": 5.0}}, "unmeasured": []},
    "wire_bytes_out": 1500, "wire_bytes_in": 400, "some_future_key": {"kept": [1, 2]},
}
FINETUNE_V1 = {
    "round": 4, "phase": "finetune", "global_acc": 0.5, "personal_acc": 0.9, "local_acc": 0.9,
    "clients": [0, 1, 4], "finetune_epochs": 5, "trainable_params": 50, "train_flops": 10,
    "seconds": 1.0, "diverged": {"1": 3}, "energy_j": 2.0,
    "energy": {"clients": {"0": 1.0, "4": 1.0}, "unmeasured": [1]},
}


@pytest.mark.parametrize("row", [TRAIN_V1, FINETUNE_V1])
def test_an_old_row_reads_by_attribute_and_writes_back_as_it_was(row):
    rec = RoundRecord.from_json(json.loads(json.dumps(row)))
    assert rec.v == 1 and rec.round == row["round"] and rec.client_steps is None
    assert rec.to_json() == {"v": 1, **row}


def test_fields_are_typed_from_the_json():
    rec = RoundRecord.from_json(TRAIN_V1)
    assert rec.rejected == {1: "tensor conv1.weight contains NaN or Inf"}
    assert rec.reporters == {4: "jetson02"}
    assert rec.energy is not None and rec.energy.clients == {4: 12.5}
    assert rec.energy.devices["jetson02"].w == 5.0  # type: ignore[union-attr]
    assert rec.accuracies() == {"G": 0.5, "F": None, "P": 0.75, "L": None, "Lr": 0.8}
    assert rec.unknown == {"some_future_key": {"kept": [1, 2]}}
    ft = RoundRecord.from_json(FINETUNE_V1)
    assert ft.diverged == {1: 3} and ft.energy is not None and not hasattr(ft.energy, "devices")


def test_a_new_row_has_the_keys_its_round_set_and_its_version():
    rec = RoundRecord(round=0, phase="train", global_acc=None, clients=[2], reported=[2],
                      client_steps=7, seconds=0.1)
    assert rec.to_json() == {"v": VERSION, "round": 0, "phase": "train", "global_acc": None,
                             "clients": [2], "reported": [2], "client_steps": 7, "seconds": 0.1}
    rec.quorum_failed, rec.received = "1 valid updates < deploy.min_updates=2", [2]
    assert rec.to_json()["quorum_failed"].startswith("1 valid") and "deadline_s" not in rec.to_json()


def test_a_misspelt_or_mistyped_field_is_an_error_not_a_silent_none():
    with pytest.raises(ValidationError, match="global_accuracy"):
        RoundRecord(round=0, phase="train", global_accuracy=0.5)  # type: ignore[call-arg]
    rec = RoundRecord(round=0, phase="train")
    with pytest.raises(ValidationError):
        rec.bytes_up = "many"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="'round'"):
        RoundRecord.from_json({"round": "three", "phase": "train"})
    with pytest.raises(ConfigError, match="JSON object"):
        RoundRecord.from_json([1, 2])


def test_the_report_reads_a_run_directory_of_old_rows(tmp_path):
    rows = [dict(TRAIN_V1, round=t, global_acc=0.1 * (t + 1)) for t in range(3)] + [FINETUNE_V1]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(load_run(tmp_path))
    assert s.rounds == 3 and s.finetuned and s.accuracy["P"].final == 90.0
    assert s.accuracy["G"].last == 20.0 and s.accuracy["G"].best == 50.0  # (fine-tuning's G counts)
    assert s.mb_moved == round(3 * 1200 / 1e6, 1) and s.energy_kj == round(3 * 12.5 / 1e3, 3)
    assert s.finetune_kj == 0.002
    row = s.row()  # the table's columns, by their display names
    assert row["P final"] == 90.0 and row["G last10"] == 20.0 and row["finetune kJ"] == 0.002


def test_a_damaged_row_is_one_line_naming_the_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(TRAIN_V1) + "\n"
                                            + json.dumps({"round": 1, "phase": "warmup"}) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: a metrics row's 'phase'") as err:
        load_run(tmp_path)
    assert "\n" not in str(err.value)


def test_refusal_codes_of_old_rows_come_from_the_reasons_words():
    """Rows written before the codes say why in words only: "diverged" is told apart, the rest
    is unknown; rows with codes give them as they are."""
    old = RoundRecord.from_json({"v": 2, "round": 3, "phase": "train", "rejected": {
        "1": "training diverged: the loss was NaN or Inf at batch 4", "2": "num_samples=5, but"}})
    assert old.refusal_codes() == {1: "diverged", 2: "unknown"}
    new = RoundRecord(round=3, phase="train", rejected={2: "num_samples=5, but"},
                      refusals={2: "wrong-samples"})
    assert RoundRecord.from_json(new.to_json()).refusal_codes() == {2: "wrong-samples"}
    with pytest.raises(ConfigError, match="refusals"):
        RoundRecord.from_json({"round": 0, "phase": "train", "refusals": {"1": "made-up"}})
