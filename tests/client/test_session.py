"""The device session turns what the coordinator publishes into state (no broker needed: messages
are fed to its handler as paho's network thread would)."""

from fedseq.client.session import DeviceSession
from fedseq.common.config import load_config
from fedseq.common.protocol.messages import Control, RunConfig, Step
from fedseq.common.protocol.topics import Topics

T = Topics()


def _session(tmp_path):
    s = DeviceSession("dev01", "mqtt://127.0.0.1:1", "cpu", tmp_path)
    cfg = load_config(None, ["algorithm.name=fedper"])
    s.on_message(T.run_config, RunConfig(run_id="r1", config=cfg.model_dump(mode="json")).encode())
    return s


def test_an_abort_of_the_current_run_drops_its_step_and_unsent_results(tmp_path, caplog):
    s = _session(tmp_path)
    step = Step(run_id="r1", seq=3, kind="evaluate", personal=["fc2"])
    s.on_message(T.step, step.encode())
    assert s.step == step and not s.superseded(step)
    sent = []
    s.send("eval", 3, lambda: sent.append(1))
    s.on_message(T.control, Control(run_id="other", command="abort").encode())  # another run's
    s.on_message(T.control, Control(command="abort").encode())  # names no run
    assert s.step == step and s.outbox and not s.superseded(step)
    s.on_message(T.control, Control(run_id="r1", command="abort", reason="operator stop").encode())
    assert s.step is None and s.superseded(step) and not s.outbox
    assert any("abort run r1: operator stop" in r.message for r in caplog.records)
    s.on_message(T.step, Step(run_id="r1", seq=1004, kind="train", round=2).encode())  # resumed
    assert "r1" not in s.aborted and s.step is not None and s.step.seq == 1004


def test_a_step_waits_for_its_blocks_and_is_skipped_once_superseded(tmp_path):
    import torch

    s = _session(tmp_path)
    s.on_message(T.assignment("dev01"), b'{"v": 4, "run_id": "r1", "device": "dev01", '
                                        b'"clients": [4, 1]}')
    step = Step(run_id="r1", seq=1, kind="evaluate", versions={"conv1": 2})
    s.on_message(T.step, step.encode())
    with s.cond:
        assert s.next_ready() is None  # conv1 version 2 not here yet
        assert s.run is not None and s.run.clients == [1, 4]
        s.blocks["r1"] = {"conv1": (2, {"conv1.weight": torch.zeros(1)})}
        assert s.next_ready() == (s.run, step)
        s.blocks["r1"]["conv1"] = (3, {"conv1.weight": torch.zeros(1)})  # the coordinator moved on
        assert s.next_ready() is None and 1 in s.run.done
