"""The seam between an algorithm and the generic client code: the trainer, executor, evaluation
and FLOP counter call hooks and import no algorithm; a plan names its algorithm and carries its
parameters; a device without the algorithm refuses the plan in one line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedseq.common.algorithms import ALGORITHMS, make_algorithm
from fedseq.common.algorithms.base import Algorithm
from fedseq.common.algorithms.hooks import ClientSide, UnknownAlgorithm, client_side
from fedseq.common.algorithms.plan import plan_from_dict, plan_to_dict
from fedseq.common.config import load_config
from fedseq.common.errors import ProtocolError
from fedseq.common.models import build_model

ROOT = Path(__file__).resolve().parents[3]
GENERIC = ("common/training.py", "common/execution.py", "common/evaluation.py", "common/flops.py",
           "client/executor.py")
# what the generic code may use of common/algorithms: the seam, the plan, the update's type
SEAM = {"fedseq.common.algorithms.hooks", "fedseq.common.algorithms.plan",
        "fedseq.common.algorithms.aggregate",
        "fedseq.common.algorithms"}  # the registry (the device's model_layout), no module of one


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("path", GENERIC)
def test_the_generic_client_code_imports_no_algorithm(path):
    used = {m for m in _imports(ROOT / path) if m.startswith("fedseq.common.algorithms")}
    assert used <= SEAM, sorted(used - SEAM)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_plan_names_its_algorithm_and_crosses_the_wire(name):
    cfg = load_config(None, [f"algorithm.name={name}"])
    from fedseq.common.algorithms import model_layout

    model = build_model("cnn", (1, 28, 28), 10, **model_layout(name))
    alg = make_algorithm(cfg, model.spec)
    alg.prepare([60] * cfg.data.num_clients)
    plan = alg.plan(0)
    assert plan.algorithm == name
    assert plan_from_dict(plan_to_dict(plan)) == plan
    side = client_side(plan)
    assert isinstance(side, ALGORITHMS[name].client_class) and side.params == plan.params


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_an_algorithm_with_its_own_server_step_says_so(name):
    """The buffered-asynchronous loop scales FedAvg's step by algorithm.server_lr; an algorithm
    that steps the model itself declares it (`own_server_step`), it is not guessed."""
    cls = ALGORITHMS[name]
    overrides = cls.server_update is not Algorithm.server_update
    assert cls.own_server_step == overrides


def test_a_plan_of_an_algorithm_this_fedseq_lacks_is_refused_in_one_line():
    from fedseq.client.executor import _plan
    from fedseq.common.protocol.messages import Step

    cfg = load_config(None, ["algorithm.name=fedavg"])
    plan = make_algorithm(cfg, build_model("cnn", (1, 28, 28), 10).spec).plan(0)
    wire = {**plan_to_dict(plan), "algorithm": "fedfuture", "params": {"beta": 2}}
    with pytest.raises(UnknownAlgorithm, match="fedfuture"):
        client_side(plan_from_dict(wire))
    step = Step(run_id="r", seq=4, kind="train", round=0, clients=[1], plan=wire)
    with pytest.raises(ProtocolError) as err:
        _plan(step)
    message = str(err.value)
    assert "\n" not in message and "fedfuture" in message and "step 4" in message


def test_the_default_client_side_does_nothing():
    side = ClientSide()
    assert side.loss(None, None, None, None) is None and side.penalty(None, None, None) is None
    assert side.view({"conv1.weight": 1, "conv1~ci.weight": 2}) == {"conv1.weight": 1}
