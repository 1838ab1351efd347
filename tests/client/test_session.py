"""The device session turns what the coordinator publishes into state (no broker needed: messages
are fed to its handler as paho's network thread would)."""

from fedseq.client.session import DeviceSession
from fedseq.common.config import load_config
from fedseq.common.protocol.messages import PROTOCOL_VERSION, Control, RunConfig, Step
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
    s.on_message(T.assignment("dev01"), b'{"v": %d, "run_id": "r1", "device": "dev01", '
                                        b'"clients": [4, 1]}' % PROTOCOL_VERSION)
    step = Step(run_id="r1", seq=1, kind="evaluate", versions={"conv1": 2})
    s.on_message(T.step, step.encode())
    with s.cond:
        assert s.next_ready() is None  # conv1 version 2 not here yet
        assert s.run is not None and s.run.clients == [1, 4]
        s.blocks["r1"] = {"conv1": (2, {"conv1.weight": torch.zeros(1)})}
        assert s.next_ready() == (s.run, step)
        s.blocks["r1"]["conv1"] = (3, {"conv1.weight": torch.zeros(1)})  # the coordinator moved on
        assert s.next_ready() is None and 1 in s.run.done


def test_a_stray_run_config_costs_the_run_neither_its_step_nor_its_blocks(tmp_path):
    """Hardening III, finding 10: on an open broker a stray client publishes another run's config;
    the coordinator restores its own within seconds. The device keeps the run's downloaded blocks
    and its current step meanwhile (and blocks of the run that arrive meanwhile), so it goes on
    at once instead of waiting for every block to be published again."""
    import hashlib

    import torch

    from fedseq.common.protocol.frames import pack_chunk
    from fedseq.common.protocol.messages import WeightsHeader
    from fedseq.common.protocol.tensors import encode_tensors

    s = _session(tmp_path)
    cfg = load_config(None, ["algorithm.name=fedper"])
    step = Step(run_id="r1", seq=2, kind="evaluate", versions={"conv1": 2, "fc1": 1})
    s.on_message(T.step, step.encode())
    with s.cond:
        s.blocks["r1"] = {"conv1": (2, {"conv1.weight": torch.zeros(1)})}
    s.on_message(T.run_config, RunConfig(run_id="stray", config=cfg.model_dump(mode="json")).encode())
    assert s.run.run_id == "stray" and s.step is None  # nothing of the stray run is executed
    frame = encode_tensors({"fc1.weight": torch.ones(2)})
    head = WeightsHeader(run_id="r1", block="fc1", version=1, chunk=0, chunks=1, size=len(frame),
                         sha256=hashlib.sha256(frame).hexdigest())
    s.on_message(T.weights("fc1", 0), pack_chunk(head, frame))
    s.on_message(T.run_config, RunConfig(run_id="r1", config=cfg.model_dump(mode="json")).encode())
    assert s.run.run_id == "r1" and s.step == step
    with s.cond:
        assert set(s.blocks["r1"]) == {"conv1", "fc1"}
        assert s.next_ready() == (s.run, step)
    for i in range(3):  # stray configs one after another keep one parked run: the real one
        s.on_message(T.run_config, RunConfig(run_id=f"stray{i}",
                                             config=cfg.model_dump(mode="json")).encode())
    assert s.parked is not None and s.parked[0].run_id == "r1"  # hardening IV, finding 6
    assert set(s.blocks) <= {"r1", "stray2"} and set(s.blocks["r1"]) == {"conv1", "fc1"}
    s.on_message(T.run_config, RunConfig(run_id="r1", config=cfg.model_dump(mode="json")).encode())
    assert s.run.run_id == "r1" and s.step == step
    with s.cond:
        assert s.next_ready() == (s.run, step)


def test_a_resend_asks_again_for_the_named_clients_answers_of_the_current_step(tmp_path):
    """Control resend (a broker dropped answers on the coordinator's queue): the device publishes
    again what it sent of that step for the clients named, and nothing for another step."""
    s = _session(tmp_path)
    s.on_message(T.assignment("dev01"), b'{"v": %d, "run_id": "r1", "device": "dev01", '
                                        b'"clients": [1, 4, 7]}' % PROTOCOL_VERSION)
    s.on_message(T.step, Step(run_id="r1", seq=5, kind="train", round=2).encode())
    sent = []
    for c in (1, 4):
        s.send(f"update/{c}", 5, lambda c=c: sent.append(c))
    assert sent == [1, 4]
    with s.cond:
        s.next_ready()  # applies the assignment to the run
    s.on_message(T.control, Control(run_id="r1", command="resend", seq=4, clients=[1]).encode())
    assert sent == [1, 4]  # an older step: nothing
    s.on_message(T.control, Control(run_id="r1", command="resend", seq=5, clients=[4, 7]).encode())
    assert sent == [1, 4, 4]  # client 7 is still training: nothing to send for it yet
    s.on_message(T.step, Step(run_id="r1", seq=6, kind="evaluate").encode())
    s.send("eval", 6, lambda: sent.append("eval"))
    s.on_message(T.control, Control(run_id="r1", command="resend", seq=6, clients=[9]).encode())
    s.on_message(T.control, Control(run_id="r1", command="resend", seq=6, clients=[7]).encode())
    assert sent == [1, 4, 4, "eval", "eval"]  # its evaluation names client 7, not 9


def test_an_answer_still_on_its_way_to_the_broker_is_not_sent_again_when_asked(tmp_path):
    """On a slow link an update takes longer to upload than the coordinator's silence before it
    asks for answers again; sending it again then would only queue another copy behind it (on a
    2 Mbit/s rehearsal link that quadrupled the bytes uploaded). An ask re-sends only what the
    broker has acknowledged (and may have dropped since); a reconnect re-sends everything."""
    import paho.mqtt.client as mqtt

    from fedseq.common.protocol.link import on_the_way

    class Info:  # what paho's publish returns
        def __init__(self, rc=mqtt.MQTT_ERR_SUCCESS):
            self.rc, self.acked = rc, False

        def is_published(self):
            return self.acked

    s = _session(tmp_path)
    s.on_message(T.assignment("dev01"), b'{"v": %d, "run_id": "r1", "device": "dev01", '
                                        b'"clients": [1, 4]}' % PROTOCOL_VERSION)
    s.on_message(T.step, Step(run_id="r1", seq=5, kind="train", round=2).encode())
    with s.cond:
        s.next_ready()
    sent, chunks = [], [Info(), Info()]

    def publish():
        sent.append(4)
        return chunks

    s.send("update/4", 5, publish)
    ask = Control(run_id="r1", command="resend", seq=5, clients=[4]).encode()
    s.on_message(T.control, ask)
    assert sent == [4]  # both chunks on their way
    chunks[0].acked = True
    s.on_message(T.control, ask)
    assert sent == [4]  # one still is
    chunks[1].acked = True
    s.on_message(T.control, ask)
    assert sent == [4, 4]  # acknowledged, and missing at the coordinator: sent again
    chunks[:] = [Info()]
    s.resend("reconnected")
    assert sent == [4, 4, 4]  # a reconnect sends it whatever its state
    assert not on_the_way(None) and not on_the_way(Info(rc=mqtt.MQTT_ERR_NO_CONN))
    assert on_the_way(Info()) and on_the_way([chunks[0]])


def test_a_step_lacking_blocks_resyncs_after_a_silence_with_backoff(tmp_path):
    """A step whose blocks stopped arriving (chunks the broker dropped for this device) asks for
    the retained blocks again after RESYNC_S without a weights chunk, then after twice that, and
    so on up to RESYNC_MAX_S; a chunk arriving restarts the silence, and a step that has its
    blocks resets the interval."""
    import torch

    from fedseq.client import session as mod

    s = _session(tmp_path)
    step = Step(run_id="r1", seq=1, kind="evaluate", versions={"conv1": 2})
    s.on_message(T.step, step.encode())
    t0 = s.weights_heard
    with s.cond:
        assert not s.weights_stalled(t0 + mod.RESYNC_S - 1)
        assert s.weights_stalled(t0 + mod.RESYNC_S)
        assert not s.weights_stalled(t0 + 2 * mod.RESYNC_S)  # the next silence is twice as long
        assert s.weights_stalled(t0 + 3 * mod.RESYNC_S)
    s.weights_heard = t0 + 10 * mod.RESYNC_S  # a chunk arrived: silence counts from there
    with s.cond:
        assert not s.weights_stalled(t0 + 10 * mod.RESYNC_S + 3 * mod.RESYNC_S)
        for _ in range(10):
            s.weights_heard = 0.0
            s.weights_stalled(1e9)
        assert s.resync_after == mod.RESYNC_MAX_S
        s.blocks["r1"] = {"conv1": (2, {"conv1.weight": torch.zeros(1)})}
        assert s.next_ready() == (s.run, step)
        assert not s.weights_stalled(1e12) and s.resync_after == mod.RESYNC_S


def test_an_async_step_owes_each_dispatch_once_and_keeps_its_answers_while_listed(tmp_path):
    """An async step lists every client in flight with the step that dispatched it: the device
    owes its own clients' dispatches it has not answered, oldest first; a newer async step does
    not drop an answer to a dispatch it still lists (a reconnect sends it again), and a client
    dispatched again is owed again."""
    import torch

    s = _session(tmp_path)
    s.on_message(T.assignment("dev01"), b'{"v": %d, "run_id": "r1", "device": "dev01", '
                                        b'"clients": [1, 4, 6]}' % PROTOCOL_VERSION)
    first = Step(run_id="r1", seq=5, kind="async", round=2, clients=[1, 3, 4, 6],
                 dispatched=[5, 5, 4, 5], versions={"conv1": 2})
    s.on_message(T.step, first.encode())
    with s.cond:
        s.blocks["r1"] = {"conv1": (2, {"conv1.weight": torch.zeros(1)})}
        run, step = s.next_ready()
        assert s.owed_dispatches(run, step) == [(4, 4), (1, 5), (6, 5)]  # not 3: not ours
        run.answered[4] = 4
        assert s.owed_dispatches(run, step) == [(1, 5), (6, 5)]
    sent = []
    s.send("update/4", 4, lambda: sent.append(4))
    later = Step(run_id="r1", seq=6, kind="async", round=3, clients=[1, 4, 6],
                 dispatched=[5, 4, 5], versions={"conv1": 3})
    s.on_message(T.step, later.encode())
    s.send("update/1", 5, lambda: sent.append(1))
    s.resend("reconnected")
    assert sorted(sent) == [1, 1, 4, 4]  # both still listed: both sent again
    again = Step(run_id="r1", seq=7, kind="async", round=4, clients=[4, 6], dispatched=[7, 5],
                 versions={"conv1": 4})
    s.on_message(T.step, again.encode())
    with s.cond:
        s.blocks["r1"]["conv1"] = (4, {"conv1.weight": torch.zeros(1)})
        run, step = s.next_ready()
        assert s.owed_dispatches(run, step) == [(6, 5), (4, 7)]  # 4 dispatched anew
    sent.clear()
    s.send("update/6", 5, lambda: sent.append(6))  # 1's answer is no longer listed: dropped
    s.resend("reconnected")
    assert sorted(sent) == [6, 6]
    bad = Step(run_id="r1", seq=8, kind="async", round=4, clients=[4, 6], dispatched=[8],
               versions={"conv1": 4})
    s.on_message(T.step, bad.encode())
    with s.cond:
        import pytest

        from fedseq.common.errors import ProtocolError
        with pytest.raises(ProtocolError, match="lists 2 clients and 1 dispatches"):
            s.next_ready()


def test_a_step_whose_blocks_are_replaced_after_it_was_taken_is_left_not_trained_on_them(
        tmp_path):
    """In an async run the coordinator steps while a device trains: newer blocks may replace the
    taken step's before the worker reads them (a restarted daemon loads its data in between).
    Reading them raises Superseded instead of handing out the newer tensors under the older
    version's name (that update would fold, and replay, as a different one); the dispatch stays
    owed and the newer step trains it."""
    import pytest
    import torch

    from fedseq.client.session import Superseded

    s = _session(tmp_path)
    s.on_message(T.assignment("dev01"), b'{"v": %d, "run_id": "r1", "device": "dev01", '
                                        b'"clients": [1]}' % PROTOCOL_VERSION)
    step = Step(run_id="r1", seq=5, kind="async", round=2, clients=[1], dispatched=[5],
                versions={"conv1": 2, "fc1": 2})
    s.on_message(T.step, step.encode())
    v2 = {"conv1.weight": torch.zeros(1)}
    with s.cond:
        s.blocks["r1"] = {"conv1": (2, v2), "fc1": (2, {"fc1.weight": torch.zeros(1)})}
        run, taken = s.next_ready()
    assert s.weights(run, taken)["conv1.weight"] is v2["conv1.weight"]
    s.blocks["r1"]["fc1"] = (3, {"fc1.weight": torch.ones(1)})  # one block of version 3 is in
    with pytest.raises(Superseded, match="step 5 needs fc1 version 2, version 3 replaced it"):
        s.weights(run, taken)
    assert s.owed_dispatches(run, taken) == [(1, 5)]
    with s.cond:
        assert s.next_ready() is None  # left, not failed: the newer step is awaited
    later = Step(run_id="r1", seq=6, kind="async", round=3, clients=[1], dispatched=[5],
                 versions={"conv1": 3, "fc1": 3})
    s.on_message(T.step, later.encode())
    with s.cond:
        s.blocks["r1"]["conv1"] = (3, {"conv1.weight": torch.ones(1)})
        run, taken = s.next_ready()
    assert taken.seq == 6 and s.owed_dispatches(run, taken) == [(1, 5)]
    assert all(t.eq(1).all() for t in s.weights(run, taken).values())


def test_an_assignment_it_cannot_read_is_said_to_the_coordinator(tmp_path):
    """Its clients would be unknown here and their rounds would wait out their deadlines: the
    device says at once, as a refusal of the whole run (seq -1), that it cannot read it."""
    s = _session(tmp_path)
    said = []
    s.announce = lambda: said.append(s.last_error)
    newer = (b'{"v": %d, "run_id": "r1", "device": "dev01", "clients": [1], "shards": [7]}'
             % PROTOCOL_VERSION)
    s.on_message(T.assignment("dev01"), newer)
    assert said and said[-1][:2] == ("r1", -1), said
    assert "dev01 cannot read its assignment for run r1" in said[-1][2] and "shards" in said[-1][2]
    s.on_message(T.assignment("dev01"), newer.replace(b'"r1"', b'"other"'))  # not its run
    assert len(said) == 1


def test_a_run_whose_plugin_is_another_version_here_is_refused_saying_which(tmp_path):
    """Issue 77, item 7: the run config names the version of every plugin the coordinator runs;
    a device that has another one installed says so (and how to fix it) instead of training
    other code. (fedseq's own entries stand in for a lab's package here.)"""
    from fedseq.common import __version__
    from fedseq.common.registry import REGISTRY

    s = DeviceSession("dev01", "mqtt://127.0.0.1:1", "cpu", tmp_path)
    said = []
    s.announce = lambda: said.append(s.last_error)
    cfg = load_config(None, []).model_dump(mode="json")
    s.on_message(T.run_config, RunConfig(run_id="r1", config=cfg,
                                         plugins={"models/cnn": "fedseq==0.0.0"}).encode())
    assert s.run is None and said and said[-1][:2] == ("r1", -1)
    assert said[-1][2] == (f"dev01 cannot follow run r1: model 'cnn' is fedseq==0.0.0 on the "
                           f"coordinator but fedseq {__version__} here (pip install "
                           "'fedseq==0.0.0' on this device)")
    same = REGISTRY.pins({"models": "cnn"}) or {"models/cnn": f"fedseq=={__version__}"}
    s.on_message(T.run_config, RunConfig(run_id="r2", config=cfg, plugins=same).encode())
    assert s.run is not None and s.run.run_id == "r2"
    assert REGISTRY.pins({"models": "cnn", "algorithms": "fedavg"}) == {}  # built-ins: no pin
