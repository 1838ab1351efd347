"""Training options the papers' code uses: augmentation (common/augment.py), a step decay of the
learning rate, per-channel normalization and the final fine-tuning of any one-head algorithm."""

import pytest
import torch

from conftest import quick_config, server_only
from fedseq.common.algorithms import algorithm_class, make_algorithm
from fedseq.common.algorithms.plan import plan_from_dict, plan_to_dict
from fedseq.common.augment import augment_batch
from fedseq.common.config import load_config
from fedseq.common.errors import ConfigError
from fedseq.common.models import build_model

HALF = (torch.full((3, 1, 1), 0.5), torch.full((3, 1, 1), 0.5))


def _batch(n=16, c=3, h=8, w=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, c, h, w, generator=g) * 2 - 1  # inputs in [-1, 1]: pixels in [0, 1]


def test_crop_is_a_window_of_the_black_padded_image():
    x = _batch()
    out = augment_batch(x, ["crop"], 2, HALF, torch.Generator().manual_seed(1))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), value=-1.0)  # black is -1 in [-1, 1]
    moved = 0
    for i in range(len(x)):
        hits = [(r, c) for r in range(5) for c in range(5)
                if torch.equal(padded[i, :, r:r + 8, c:c + 8], out[i])]
        assert hits, f"image {i} is no window of its padded self"
        moved += hits[0] != (2, 2)
    assert moved > len(x) // 2  # the offsets are drawn, not all centred


def test_flip_mirrors_about_half_the_images_and_jitter_keeps_pixels_valid():
    x = _batch(n=200)
    out = augment_batch(x, ["flip"], 4, HALF, torch.Generator().manual_seed(2))
    flipped = sum(torch.equal(out[i], x[i].flip(-1)) for i in range(len(x)))
    kept = sum(torch.equal(out[i], x[i]) for i in range(len(x)))
    assert flipped + kept == len(x) and 70 < flipped < 130
    j = augment_batch(x, ["jitter"], 4, HALF, torch.Generator().manual_seed(3))
    assert j.shape == x.shape and not torch.equal(j, x)
    assert j.min() >= -1 - 1e-6 and j.max() <= 1 + 1e-6  # pixels clipped to [0, 1]


def test_augmentation_is_a_function_of_its_generator():
    x = _batch()
    ops = ["crop", "flip", "jitter"]
    a = augment_batch(x, ops, 4, HALF, torch.Generator().manual_seed(5))
    b = augment_batch(x, ops, 4, HALF, torch.Generator().manual_seed(5))
    c = augment_batch(x, ops, 4, HALF, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    gray = augment_batch(x[:, :1], ops, 4, (HALF[0][:1], HALF[1][:1]),
                         torch.Generator().manual_seed(5))
    assert gray.shape == x[:, :1].shape


def test_step_decay_of_the_learning_rate(data_root):
    cfg = quick_config(data_root, "rounds=8", "train.lr=0.1", "train.lr_milestones=[0.5, 0.75]",
                       "algorithm.name=fedavg")
    assert [cfg.lr_at(r) for r in range(8)] == [0.1] * 4 + [0.1 * 0.1] * 2 + [0.1 * 0.1 ** 2] * 2
    model = build_model("cnn", (1, 28, 28), 10)
    alg = make_algorithm(cfg, model.spec)
    assert alg.plan(5).lr == cfg.lr_at(5) and alg.finetune_plan() is None
    for bad in ("[0.75, 0.5]", "[0.0]", "[1.0]"):
        with pytest.raises(ConfigError, match="lr_milestones"):
            quick_config(data_root, f"train.lr_milestones={bad}")


def test_plans_carry_augmentation_and_leave_the_crop_off_the_wire_when_unused(data_root):
    model = build_model("cnn", (1, 28, 28), 10)
    plain = make_algorithm(quick_config(data_root, "algorithm.name=fedavg"), model.spec).plan(0)
    assert plain.augment == () and "crop_padding" not in plan_to_dict(plain)
    cfg = quick_config(data_root, "algorithm.name=fedavg", "train.augment=['flip', 'crop']",
                       "train.crop_padding=2")
    plan = make_algorithm(cfg, model.spec).plan(0)
    assert plan_from_dict(plan_to_dict(plan)) == plan and plan.augment == ("flip", "crop")
    with pytest.raises(ConfigError, match="augment"):
        quick_config(data_root, "train.augment=['rotate']")
    assert cfg.for_devices()["train"]["augment"] == ["flip", "crop"]


@pytest.mark.slow("real models trained: 5 s on 2 cores")
@server_only
def test_fedavg_fine_tuned_is_fedbabus_fedavg_column(data_root):
    """final_finetune = true: FedAvg ends with every client's fine-tuning, its rounds unchanged
    (the same global model); a two-head algorithm is refused in one line."""
    from fedseq.server.ops.simulation import run_simulation

    over = ["algorithm.name=fedavg", "rounds=2"]
    plain = run_simulation(quick_config(data_root, *over), out=None)
    tuned = run_simulation(quick_config(data_root, *over, "algorithm.final_finetune=true"), out=None)
    assert plain.rows[-1]["phase"] != "finetune" and tuned.rows[-1]["phase"] == "finetune"
    for k, v in plain.global_weights.items():
        assert torch.equal(tuned.global_weights[k], v), k
    assert tuned.rows[-1]["personal_acc"] > plain.rows[-1]["personal_acc"]
    off = quick_config(data_root, "algorithm.name=fedbabu", "algorithm.final_finetune=false")
    assert not algorithm_class("fedbabu").finetunes(off)
    with pytest.raises(ConfigError, match="two heads") as err:
        algorithm_class("fedrod").finetunes(
            quick_config(data_root, "algorithm.name=fedrod", "algorithm.final_finetune=true"))
    assert "\n" not in str(err.value)


def test_channel_normalization_uses_the_papers_statistics(data_root):
    from fedseq.common.data.federated import load_federated

    half = load_federated(quick_config(data_root).data, 0)
    chan = load_federated(quick_config(data_root, "data.normalize='channel'").data, 0)
    rows = half.clients[0].train[:50]
    pixels = (half.images(rows) + 1) / 2
    expected = (pixels - 0.2860) / 0.3530
    assert torch.allclose(chan.images(rows), expected, atol=1e-5)
    with pytest.raises(ConfigError, match="no statistics for emnist-letters"):
        load_config(None, ["data.dataset='emnist-letters'", "data.normalize='channel'"])


def test_fedregs_simple_augmentation_jitters_colour_images_only():
    """FedReG's 'Simple' augmentation has a colour jitter, which it omits for grayscale data."""
    from fedseq.common.data.rebalance import simple_augment

    colour = _batch(n=8)
    plain = simple_augment(colour, torch.Generator().manual_seed(1))
    jittered = simple_augment(colour, torch.Generator().manual_seed(1), HALF)
    assert jittered.shape == colour.shape and not torch.equal(plain, jittered)
    gray = colour[:, :1]
    g_stats = (HALF[0][:1], HALF[1][:1])
    assert torch.equal(simple_augment(gray, torch.Generator().manual_seed(1)),
                       simple_augment(gray, torch.Generator().manual_seed(1), g_stats))
