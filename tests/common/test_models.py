import torch

from fedseq.common.models import block_keys, build_model, count_params, get_blocks, set_weights


def test_cnn_matches_fedseq_table3():
    m = build_model("cnn", (1, 28, 28), 10)
    sizes = {k: v.numel() for k, v in m.state_dict().items()}
    assert sizes == {
        "conv1.weight": 800, "conv1.bias": 32, "conv2.weight": 51200, "conv2.bias": 64,
        "fc1.weight": 524288, "fc1.bias": 512, "fc2.weight": 5120, "fc2.bias": 10,
    }
    assert sum(sizes.values()) == 582026
    assert m.spec.base == ("conv1", "conv2", "fc1") and m.spec.head == "fc2"
    assert block_keys(m, "fc1") == ["fc1.weight", "fc1.bias"]
    assert count_params(m, ["fc1"]) == 524800  # fc1 alone is 2,099,200 bytes in float32


def test_convnet_is_feddyn_fedrod_convnet():
    # FedReG section 4.1: two conv layers, a pooling layer after each, three fully connected layers.
    m = build_model("convnet", (1, 28, 28), 10)
    sizes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert sizes == {
        "conv1.weight": (64, 1, 5, 5), "conv1.bias": (64,), "conv2.weight": (64, 64, 5, 5),
        "conv2.bias": (64,), "fc1.weight": (384, 1024), "fc1.bias": (384,),
        "fc2.weight": (192, 384), "fc2.bias": (192,), "fc3.weight": (10, 192), "fc3.bias": (10,),
    }
    assert count_params(m, m.spec.blocks) == 573578
    assert m.spec.base == ("conv1", "conv2", "fc1", "fc2") and m.spec.head == "fc3"
    # pooling before the ReLU is the reference's relu-then-pool exactly
    x = torch.randn(3, 1, 28, 28)
    ref = torch.nn.functional.max_pool2d(torch.relu(m.conv2(torch.nn.functional.max_pool2d(
        torch.relu(m.conv1(x)), 2))), 2).flatten(1)
    ref = torch.relu(m.fc2(torch.relu(m.fc1(ref))))
    assert torch.allclose(m.features(x), ref, atol=1e-6)
    two = build_model("convnet", (3, 32, 32), 100, two_heads=True)
    assert two.spec.heads == ("fc3", "fc3_p") and two.fc1.in_features == 1600


def test_unknown_model_is_a_config_error():
    import pytest

    from fedseq.common.errors import ConfigError

    with pytest.raises(ConfigError, match="convnet"):
        build_model("resnet", (1, 28, 28), 10)


def test_seeded_init_is_reproducible_and_isolated():
    torch.manual_seed(123)
    before = torch.rand(1)
    a = build_model("cnn", (1, 28, 28), 10, generator_seed=7)
    torch.manual_seed(123)
    b = build_model("cnn", (1, 28, 28), 10, generator_seed=7)
    assert torch.rand(1) == before  # global RNG untouched by the seeded build
    assert len(a.state_dict()) == len(b.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_two_heads_and_cifar_shape():
    m = build_model("cnn", (3, 32, 32), 100, two_heads=True)
    assert m.spec.heads == ("fc2", "fc2_p")
    assert m.fc1.in_features == 1600
    out = m.logits(m.features(torch.zeros(2, 3, 32, 32)), m.spec.heads)
    assert out.shape == (2, 100)


def test_get_set_weights_roundtrip():
    a = build_model("cnn", (1, 28, 28), 10, generator_seed=1)
    b = build_model("cnn", (1, 28, 28), 10, generator_seed=2)
    w = get_blocks(a, ["conv1", "fc2"])
    assert set(w) == {"conv1.weight", "conv1.bias", "fc2.weight", "fc2.bias"}
    assert all(v.is_contiguous() for v in w.values())
    set_weights(b, w)
    assert torch.equal(b.conv1.weight, a.conv1.weight)
    assert not torch.equal(b.conv2.weight, a.conv2.weight)


def test_orthogonal_head_init_changes_only_the_head_weights():
    """model.head_init = "orthogonal": each head's weight has orthonormal rows, the same for the
    same seed; every other tensor (head biases included) is the default init's, bit for bit."""
    plain = build_model("convnet", (1, 28, 28), 10, True, generator_seed=7)
    ortho = build_model("convnet", (1, 28, 28), 10, True, generator_seed=7, head_init="orthogonal")
    again = build_model("convnet", (1, 28, 28), 10, True, generator_seed=7, head_init="orthogonal")
    heads = {f"{h}.weight" for h in ortho.spec.heads}
    assert len(heads) == 2
    for key, value in ortho.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
        assert torch.equal(value, plain.state_dict()[key]) == (key not in heads), key
    for key in heads:
        w = ortho.state_dict()[key]
        assert torch.allclose(w @ w.T, torch.eye(w.shape[0]), atol=1e-5)


def test_the_papers_models_blocks_and_parameter_counts():
    """FedBABU's 4convNet and MobileNet, the CIFAR ResNets of FedPer and FedBABU's appendix:
    blocks at the papers' granularity and the parameter counts docs/models.md gives (ResNet-18
    and -34 on CIFAR-10: the standard 11,173,962 and 21,282,122)."""
    counts = {("4convnet", 10): 115658, ("mobilenet", 100): 3309476, ("resnet18", 10): 11173962,
              ("resnet34", 10): 21282122}
    for (name, classes), n in counts.items():
        m = build_model(name, (3, 32, 32), classes)
        assert count_params(m, m.spec.blocks) == n, name
        assert len(m.state_dict()) == len(list(m.parameters()))  # no running statistics: no state
        assert m.batch_stats and m.spec.head == "fc"
    assert build_model("4convnet", (3, 32, 32), 10).spec.base == ("conv1", "conv2", "conv3", "conv4")
    assert len(build_model("mobilenet", (3, 32, 32), 10).spec.base) == 14  # stem + 13 blocks
    assert len(build_model("resnet34", (3, 32, 32), 10).spec.base) == 17  # stem + FedPer's 16
    # every model takes every input of the zoo as it is; the features flatten to what the head takes
    for name in ("4convnet", "mobilenet", "resnet18"):
        for shape in ((1, 28, 28), (3, 32, 32), (3, 64, 64)):
            m = build_model(name, shape, 200, two_heads=True)
            out = m.logits(m.features(torch.rand(2, *shape)), m.spec.heads)
            assert out.shape == (2, 200), (name, shape)


def test_batch_statistics_models_train_blocks_alone():
    """One SGD step with conv1 alone trainable (FedSeq's first stage): every other tensor, the
    normalization's scale and shift included, is unchanged; no running state exists to drift."""
    from fedseq.common.training import Sgd, set_trainable

    m = build_model("4convnet", (1, 28, 28), 10, generator_seed=3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = Sgd(set_trainable(m, ("conv1",)), lr=0.1, momentum=0.9)
    loss = torch.nn.functional.cross_entropy(m.logits(m.features(torch.rand(8, 1, 28, 28)), ("fc",)),
                                             torch.arange(8))
    loss.backward()
    opt.step()
    changed = {k for k, v in m.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("conv1.") for k in changed)
    assert "conv1.1.weight" in changed  # conv1's BatchNorm scale trains with its block


def test_running_statistics_are_block_state_and_frozen_blocks_keep_them():
    """model.norm = "running": each BatchNorm layer's running mean and variance are tensors of its
    block (no batch counter); a step with conv1 alone trainable moves conv1's statistics with its
    weights and leaves every frozen block's statistics exactly as they were (they normalize)."""
    from fedseq.common.training import Sgd, set_trainable

    m = build_model("4convnet", (1, 28, 28), 10, generator_seed=3, norm="running")
    assert block_keys(m, "conv2") == ["conv2.0.weight", "conv2.0.bias", "conv2.1.weight",
                                      "conv2.1.bias", "conv2.1.running_mean", "conv2.1.running_var"]
    assert not any("num_batches_tracked" in k for k in m.state_dict())
    batch = build_model("4convnet", (1, 28, 28), 10, norm="batch")
    assert not m.batch_stats and count_params(m, m.spec.blocks) == count_params(batch, batch.spec.blocks)
    assert len(m.state_dict()) == len(batch.state_dict()) + 2 * 4  # mean and variance, 4 layers
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = Sgd(set_trainable(m, ("conv1",)), lr=0.1, momentum=0.9)
    assert m.conv1.training and not m.conv2.training and not m.fc.training
    loss = torch.nn.functional.cross_entropy(m.logits(m.features(torch.rand(8, 1, 28, 28)), ("fc",)),
                                             torch.arange(8))
    loss.backward()
    opt.step()
    changed = {k for k, v in m.state_dict().items() if not torch.equal(v, before[k])}
    assert {"conv1.1.running_mean", "conv1.1.running_var", "conv1.1.weight"} <= changed
    assert all(k.startswith("conv1.") for k in changed)
    # evaluation normalizes by the statistics: a row's score does not depend on its batch
    from fedseq.common.evaluation import features

    set_trainable(m, ())
    x = torch.rand(6, 1, 28, 28)
    assert torch.allclose(features(m, x, 6)[:2], features(m, x[:2], 2), atol=1e-6)


def test_fedbn_keeps_every_normalization_layer_personal():
    from fedseq.common.models import personal_tensors, shared_tensors

    for name in ("4convnet", "mobilenet", "resnet18"):
        m = build_model(name, (3, 32, 32), 10, norm="fedbn")
        bn = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.BatchNorm2d)]
        assert m.norm_layers() == bn and bn
        keys = m.personal_keys()
        assert keys == {k for k in m.state_dict() if any(k.startswith(n + ".") for n in bn)}
        assert {k.rsplit(".", 1)[1] for k in keys} == {"weight", "bias", "running_mean",
                                                       "running_var"}
        shared = shared_tensors(m, m.spec.blocks)
        assert set(shared) == set(m.state_dict()) - keys
        assert set(personal_tensors(m, ())) == keys  # FedAvg + FedBN
        assert set(personal_tensors(m, ("fc",))) == keys | {"fc.weight", "fc.bias"}  # + FedPer
    for norm in ("batch", "running"):
        m = build_model("mobilenet", (3, 32, 32), 10, norm=norm)
        assert not m.personal_keys() and personal_tensors(m, ()) == {}


def test_model_norm_is_refused_where_it_cannot_apply():
    import pytest

    from fedseq.common.errors import ConfigError
    from fedseq.common.models import model_spec

    for name in ("cnn", "convnet"):
        with pytest.raises(ConfigError, match="needs normalization layers, and .* has none"):
            build_model(name, (1, 28, 28), 10, norm="running")
        with pytest.raises(ConfigError, match="4convnet, mobilenet, resnet18, resnet34"):
            model_spec(name, False, "fedbn")
    with pytest.raises(ConfigError, match="model.norm 'group' is unknown"):
        build_model("4convnet", (1, 28, 28), 10, norm="group")
