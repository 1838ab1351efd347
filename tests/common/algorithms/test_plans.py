"""Which blocks each algorithm trains, uploads and keeps personal."""

import pytest

from conftest import server_only
from fedseq.common.algorithms import ALGORITHMS, algorithm_class, make_algorithm, model_layout
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.config import load_config
from fedseq.common.models import build_model


def _alg(name):
    cfg = load_config(None, [f"algorithm.name={name}", "rounds=9"])
    alg = make_algorithm(cfg, build_model("cnn", (1, 28, 28), 10, **model_layout(name)).spec)
    if name == "fedreg":
        alg.prepare([100, 300])
    return alg


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_personal_blocks_never_uploaded(name):
    alg = _alg(name)
    for t in range(9):
        plan = alg.plan(t)
        assert not set(plan.upload) & set(plan.personal)
        # a state block (SCAFFOLD's conv1~c) goes with its trained block
        assert {b.split("~")[0] for b in plan.upload} <= set(plan.trainable)


@pytest.mark.parametrize(
    "name, upload, personal",
    [
        ("fedavg", ("conv1", "conv2", "fc1", "fc2"), ()),
        ("fedprox", ("conv1", "conv2", "fc1", "fc2"), ()),
        ("fedper", ("conv1", "conv2", "fc1"), ("fc2",)),
        ("fedrep", ("conv1", "conv2", "fc1"), ("fc2",)),
        ("lg-fedavg", ("fc2",), ("conv1", "conv2", "fc1")),
        ("fedbabu", ("conv1", "conv2", "fc1"), ()),
        ("gpfl", ("conv1", "conv2", "fc1", "cov", "gce"), ("fc2",)),
        ("fedrod", ("conv1", "conv2", "fc1", "fc2"), ("fc2_p",)),
        ("fedreg", ("conv1", "conv2", "fc1", "fc2"), ("fc2_p",)),
    ],
)
def test_upload_and_personal_sets(name, upload, personal):
    plan = _alg(name).plan(0)
    assert set(plan.upload) == set(upload) and plan.personal == personal


def test_fedrep_head_then_body():
    plan = _alg("fedrep").plan(0)
    assert [p.trainable for p in plan.phases] == [("fc2",), ("conv1", "conv2", "fc1")]


def test_fedprox_mu():
    assert _alg("fedprox").plan(0).params == {"mu": 0.001} and _alg("fedavg").plan(0).params == {}


def test_fedreg_phases_and_weights():
    alg = _alg("fedreg")
    plan = alg.plan(0)
    p1, p2 = plan.phases
    assert p1.data == "local" and p1.objectives[0].heads == ("fc2", "fc2_p")
    assert "fc2" not in p1.trainable and "fc2_p" in p1.trainable
    assert p2.data == "rebalanced" and p2.trainable == ("conv1", "conv2", "fc1", "fc2")
    assert plan.params["threshold"] == 200.0  # mean of the client training sizes
    up = ClientUpdate(0, 0, {"conv1.weight": None, "fc2.weight": None, "fc2.bias": None},
                      num_samples=120, effective_samples=45)
    assert alg.aggregation_weights(up) == {"conv1": 120.0, "fc2": 45.0}


def test_fedrod_balanced_generic_and_detached_personal():
    plan = _alg("fedrod").plan(0)
    generic, personal = plan.phases[0].objectives
    assert generic.loss == "balanced_ce" and generic.trainable == ("conv1", "conv2", "fc1", "fc2")
    assert personal.reuse_features and personal.trainable == ("fc2_p",)
    assert plan.class_counts_needed


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_fine_tuning_is_declared_and_off_with_zero_epochs(name):
    """`finetunes(cfg)` (what the CLI shows before any model exists) agrees with the plan the
    round loop runs, also with algorithm.finetune_epochs = 0."""
    for epochs in (0, 3):
        cfg = load_config(None, [f"algorithm.name={name}", f"algorithm.finetune_epochs={epochs}"])
        cls = algorithm_class(name)
        alg = make_algorithm(cfg, build_model("cnn", (1, 28, 28), 10, **model_layout(name)).spec)
        assert cls.finetunes(cfg) == (alg.finetune_plan() is not None)
        assert cls.finetunes(cfg) == (epochs > 0 and name in ("fedbabu", "fedseq-vanilla",
                                                              "fedseq-anti", "local"))


def test_fedreg_plans_only_after_prepare():
    from fedseq.common.errors import FedseqError

    cfg = load_config(None, ["algorithm.name=fedreg"])
    alg = make_algorithm(cfg, build_model("cnn", (1, 28, 28), 10, True).spec)
    with pytest.raises(FedseqError, match="prepare"):
        alg.plan(0)
    alg.prepare([100, 300])
    assert alg.plan(0).params["threshold"] == 200.0


def test_fedper_personal_layers_count_blocks_and_leave_a_base_federated():
    from fedseq.common.errors import ConfigError
    from fedseq.common.models import model_spec

    spec = model_spec("convnet", False)  # conv1 conv2 fc1 fc2 | fc3

    def fedper(k):
        cfg = load_config(None, ["algorithm.name=fedper", f"algorithm.fedper.personal_layers={k}"])
        return algorithm_class("fedper")(cfg, spec)

    for k, personal in ((1, ("fc3",)), (2, ("fc2", "fc3")), (4, ("conv2", "fc1", "fc2", "fc3"))):
        alg = fedper(k)
        assert alg.personal_blocks() == personal
        assert alg.plan(0).upload == tuple(b for b in spec.blocks if b not in personal)
    with pytest.raises(ConfigError, match="personal_layers = 5: the model's 4 base blocks"):
        fedper(5)


def test_fedregs_rebalanced_set_is_its_client_sides_data_source():
    """FedReG is written on the plugin API: the generic plan carries its threshold in its own
    params, its client side makes the rebalanced phase's rows (phase_rows) and says their number
    (phase_size, which the FLOP count reads), and its algorithm says the effective count the
    round contract checks. A phase of a data source no client side makes is refused in one line."""
    import torch

    from conftest import synthetic_data
    from fedseq.common.algorithms.hooks import ClientSide, UnknownAlgorithm, client_side
    from fedseq.common.algorithms.plan import ClientPlan, plan_from_dict, plan_to_dict
    from fedseq.common.data.rebalance import rebalanced_size
    from fedseq.common.training import phase_rows

    alg = _alg("fedreg")
    plan = alg.plan(0)
    data = synthetic_data()
    shard = data.clients[0]
    counts = shard.train_class_counts(data.y, data.num_classes)
    side = client_side(plan)
    rows = phase_rows(plan.phases[1], side, data, shard, 0, 0)
    assert len(rows.rows) == rebalanced_size(counts, 200.0)[0]
    assert rows.effective == rebalanced_size(counts, 200.0)[1] == alg.effective_samples(counts)
    assert set(plan_to_dict(plan)) >= {"params"} and "rebalance_threshold" not in plan_to_dict(plan)
    # a plan from a coordinator of before: its threshold is read into the params
    old = {**plan_to_dict(plan), "params": {}, "rebalance_threshold": 150.0, "rebalance_once": False}
    assert plan_from_dict(old).params == {"threshold": 150.0, "rebalance": "every-round"}
    fedavg = ClientPlan(phases=plan.phases, upload=("conv1",))  # FedAvg's side has no such source
    with pytest.raises(UnknownAlgorithm, match="'rebalanced', a data source"):
        phase_rows(fedavg.phases[1], ClientSide(), data, shard, 0, 0)
    assert torch.equal(phase_rows(plan.phases[0], side, data, shard, 0, 0).rows, shard.train)


@server_only
def test_the_flop_count_reads_fedregs_rebalanced_size():
    """The coordinator's FLOP count runs the rebalanced phase on the rows its client side makes."""
    from conftest import synthetic_data
    from fedseq.common.data.rebalance import rebalanced_size
    from fedseq.common.flops import phase_rows as flop_rows

    plan = _alg("fedreg").plan(0)
    data = synthetic_data()
    shard = data.clients[0]
    counts = shard.train_class_counts(data.y, data.num_classes)
    assert flop_rows(plan, data, shard)[1] == rebalanced_size(counts, 200.0)[0]
