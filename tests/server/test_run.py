"""run_experiment: one set-up and tear-down for every transport, in a fixed order, undone in
reverse whatever ends the run (server/rounds/run.py)."""

import contextlib

import pytest

from conftest import quick_config
from fedseq.common.errors import TransportError
from fedseq.server.pools.inprocess import InProcessPool
from fedseq.server.rounds.coordinator import Rounds
from fedseq.server.rounds.run import run_experiment


class Recording:
    """A transport that trains in process and writes down what run_experiment asks of it."""

    remote = False
    collect_threads = None

    def __init__(self, fail_at: str | None = None):
        self.calls: list[str] = []
        self.fail_at = fail_at

    def _step(self, name: str, stack: contextlib.ExitStack) -> None:
        self.calls.append(name)
        stack.callback(self.calls.append, f"undo {name}")
        if name == self.fail_at:
            raise TransportError(f"{name} failed")

    def connect(self, stack, ckpt):
        self._step("connect", stack)

    def open_pool(self, stack, exp, ckpt):
        self._step("open_pool", stack)
        return stack.enter_context(InProcessPool(exp.data, exp.model,
                                                 exp.algorithm.personal_blocks(), 0,
                                                 algorithm=exp.algorithm.name))

    def info(self):
        return {"transport": "recording"}

    def started(self, stack, run_dir):
        self._step("started", stack)


def test_the_steps_run_in_order_and_are_undone_in_reverse(data_root, tmp_path, one_thread):
    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=1")
    t = Recording()
    result = run_experiment(cfg, tmp_path / "run", t)
    assert t.calls == ["connect", "open_pool", "started", "undo started", "undo open_pool",
                       "undo connect"]
    assert len(result.records) == 1
    assert '"transport": "recording"' in (tmp_path / "run" / "status.json").read_text()


@pytest.mark.parametrize("fail_at", ["connect", "open_pool", "started"])
def test_a_failing_step_undoes_what_came_before_it(data_root, tmp_path, one_thread, fail_at):
    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=1")
    t = Recording(fail_at)
    with pytest.raises(TransportError, match=f"{fail_at} failed"):
        run_experiment(cfg, tmp_path / "run", t)
    done = t.calls[: t.calls.index(fail_at) + 1]
    assert t.calls == done + [f"undo {c}" for c in reversed(done)]


def test_the_round_loop_is_a_driver_of_the_run(data_root, one_thread):
    """A second driver takes the run as the synchronous one does (the next issue's buffered
    asynchronous aggregation); here one that counts its rounds."""

    class Counting(Rounds):
        rounds = 0

        def run_round(self, t):
            Counting.rounds += 1
            return super().run_round(t)

    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=2")
    run_experiment(cfg, None, Recording(), driver=Counting)
    assert Counting.rounds == 2


def test_a_fleet_pool_ended_by_an_error_tells_its_devices_why():
    """MqttPool's lifetime: leaving its block with an error publishes an abort naming the
    error's first line, then the idle step (devices drop work nobody will collect)."""
    import threading

    import paho.mqtt.client as mqtt

    from fedseq.common.config import load_config
    from fedseq.common.protocol.messages import Control, Step
    from fedseq.common.protocol.topics import Topics
    from fedseq.server.ops.broker import EmbeddedBroker
    from fedseq.server.pools.mqtt import MqttPool

    t = Topics("fedseq")
    got: list[tuple[str, bytes]] = []
    subscribed, idle = threading.Event(), threading.Event()

    def on_message(client, userdata, msg):
        got.append((msg.topic, msg.payload))
        if not msg.payload:  # the run's retained step cleared after its idle one
            return
        if msg.topic == t.step and Step.decode(msg.payload).kind == "idle":
            idle.set()

    with EmbeddedBroker("127.0.0.1", 0) as broker:
        watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watcher")
        watcher.on_message = on_message
        watcher.on_connect = lambda c, u, f, rc, p: c.subscribe([(t.control, 1), (t.step, 1)])
        watcher.on_subscribe = lambda *a: subscribed.set()
        watcher.connect("127.0.0.1", broker.port)
        watcher.loop_start()
        try:
            assert subscribed.wait(30)
            with pytest.raises(RuntimeError, match="boom"), \
                    MqttPool(load_config(None, []), broker.url, "run-1"):
                raise RuntimeError("boom\nand a second line")
            assert idle.wait(30), got
        finally:
            watcher.loop_stop()
            watcher.disconnect()
    controls = [Control.decode(p) for topic, p in got if topic == t.control]
    assert [(c.command, c.reason, c.run_id) for c in controls] == [("abort", "boom", "run-1")]
