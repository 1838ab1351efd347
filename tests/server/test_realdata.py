"""Each algorithm on real Fashion-MNIST (5% of it, 5 clients, 3 rounds) must clearly beat chance."""

import pytest

from conftest import quick_config
from fedseq.common.algorithms import ALGORITHMS
from fedseq.server.ops.simulation import run_simulation

TRAINED_GLOBAL = {"fedavg", "fedavgm", "fedadam", "fedyogi", "scaffold", "fedprox", "fedrod",
                  "fedreg", "moon", "fednova"}


@pytest.mark.slow("training on the real Fashion-MNIST: 16 s on 2 cores")
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_beats_chance(name, data_root):
    own = ("algorithm.ditto.epochs=2",) if name == "ditto" else ()  # 5 by default: 35 s more
    cfg = quick_config(data_root, f"algorithm.name={name}", *own)
    result = run_simulation(cfg, out=None)
    final = result.rows[-1]
    assert final["personal_acc"] > 0.5, final  # chance is 0.10
    if name in TRAINED_GLOBAL:
        assert final["global_acc"] > 0.3, final
    if name in ("fedbabu", "fedseq-vanilla", "fedseq-anti"):
        assert final["phase"] == "finetune"


@pytest.mark.slow("training on the real Fashion-MNIST: 6 s on 2 cores")
def test_same_seed_same_result(data_root):
    a = run_simulation(quick_config(data_root, "algorithm.name=fedreg", "rounds=2"), out=None)
    b = run_simulation(quick_config(data_root, "algorithm.name=fedreg", "rounds=2"), out=None)
    assert a.rows[-1]["global_acc"] == b.rows[-1]["global_acc"]
    assert all((a.global_weights[k] == b.global_weights[k]).all() for k in a.global_weights)


@pytest.mark.slow("training on the real Fashion-MNIST: 63 s on 2 cores")
@pytest.mark.parametrize("model,over", [("4convnet", ()), ("mobilenet", ()),
                                        ("resnet18", ("rounds=1", "data.num_clients=3"))])
def test_the_papers_models_learn(model, over, data_root):
    """FedBABU's 4convNet and MobileNet and the CIFAR ResNet-18 on real Fashion-MNIST as it is
    (1x28x28): FedAvg beats chance clearly (ResNet-18 for one round only: it is slow on a CPU)."""
    cfg = quick_config(data_root, "algorithm.name=fedavg", f"model.name={model}", *over)
    final = run_simulation(cfg, out=None).rows[-1]
    assert final["global_acc"] > 0.3 and final["personal_acc"] > 0.3, final  # chance is 0.10
