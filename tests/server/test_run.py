"""run_experiment: one set-up and tear-down for every transport, in a fixed order, undone in
reverse whatever ends the run (server/run.py)."""

import contextlib

import pytest

from conftest import quick_config
from fedseq.common.errors import TransportError
from fedseq.server.coordinator import Coordinator
from fedseq.server.pool import InProcessPool
from fedseq.server.run import run_experiment


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
                                                 exp.algorithm.personal_blocks(), 0))

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

    class Counting(Coordinator):
        rounds = 0

        def run_round(self, t):
            Counting.rounds += 1
            return super().run_round(t)

    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=2")
    run_experiment(cfg, None, Recording(), driver=Counting)
    assert Counting.rounds == 2
