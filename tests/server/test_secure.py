"""[secagg] in a round (server/privacy/secure_sum.py): the unmasked sum against the plain aggregate, a client
that never counted, junk that would corrupt the model, what cannot combine with it, and secure
runs bitwise whatever the keys, across --workers and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import quick_config, resumed_after, same_run
from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.config import load_config
from fedseq.common.errors import AggregationError, ConfigError
from fedseq.common.secagg import scale_for
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.privacy.dp import NoisedSum
from fedseq.server.privacy.secure_sum import SecureSum, layout_of, round_setup

pytest.importorskip("cryptography")


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"conv1.weight": torch.randn(8, 1, 3, 3, generator=g),
            "conv1.bias": torch.randn(8, generator=g),
            "fc1.weight": torch.randn(10, 32, generator=g)}


def _updates(clients, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for c in clients:
        deltas = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in _weights().items()}
        if c % 4 == 3:  # a client that trained only some blocks
            deltas.pop("fc1.weight")
        out[c] = (deltas, {"conv1": float(20 + 7 * c), "fc1": float(20 + 7 * c)})
    return out


def _secure(inner, clients, heaviest, **over):
    cfg = load_config(None, ["secagg.enabled=true", *[f"{k}={v}" for k, v in over.items()]])
    layout = layout_of(_weights())
    return SecureSum(inner, round_setup(cfg, 4, clients, layout, heaviest), layout)


@pytest.mark.parametrize("up, bits", [("none", 32), ("int8", 16)])
def test_the_unmasked_mean_is_the_plain_mean_within_the_encoding_error(up, bits):
    clients = list(range(10))
    updates = _updates(clients)
    plain = WeightedDeltaSum()
    secure = _secure(WeightedDeltaSum(), clients, 20 + 7 * 9, **{"wire.up": repr(up)})
    for c, (d, w) in updates.items():
        plain.add(d, w, c)
        secure.add(d, w, c)
    g = _weights()
    a, b = plain.apply(g), secure.apply(g)
    assert secure.moved() == plain.moved() and secure.count() == 10
    # the mean delta's error: m updates' rounding, 0.5 / S each, over the tensor's weight sum
    scale = scale_for(10, 20 + 7 * 9, 4.0, bits)  # secagg.clip_range's default
    assert secure.setup.ring_bits == bits and secure.setup.scale == scale
    for k in g:
        weight = plain.weights[k]
        assert abs(secure.inner.weights[k] - weight) <= 10 * 0.5 / scale
        mean, got = plain.sums[k] / weight, secure.inner.sums[k] / secure.inner.weights[k]
        bound = 10 * 0.5 / scale / weight * 1.01 + abs(secure.inner.weights[k] - weight) * (
            float(got.abs().max()) / weight)  # the weights' rounding too
        assert 0 < (mean - got).abs().max() <= bound, k
        # float32 at 32 bits: an ulp or two
        assert torch.allclose(a[k], b[k], rtol=0, atol=4e-7 if bits == 32 else bound * 1.01)
    values = sum(v.numel() + 1 for v in g.values())  # a weight per tensor
    assert secure.recovered == [] and secure.bytes_up() > bits // 8 * 10 * values


def test_a_client_that_never_counted_is_recovered_and_left_out():
    clients = list(range(8))
    updates = _updates(clients)
    plain, secure = WeightedDeltaSum(), _secure(WeightedDeltaSum(), clients, 80)
    for c, (d, w) in updates.items():
        if c in (2, 5):  # refused by the round contract, or never came
            continue
        plain.add(d, w, c)
        secure.add(d, w, c)
    a, b = plain.apply(_weights()), secure.apply(_weights())
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert secure.recovered == [2, 5] and secure.clients_added() == [0, 1, 3, 4, 6, 7]


def test_dp_noise_goes_on_the_unmasked_sum_as_on_the_plain_one():
    clients = list(range(6))
    updates = {c: ({k: v * 0.5 for k, v in d.items()}, w)  # within C, as the contract checked
               for c, (d, w) in _updates(clients).items()}

    def noised():
        return NoisedSum(clip=1.0, noise=0.5, expected=6.0, seed=3, round=4)

    plain, secure = noised(), _secure(noised(), clients, 1)
    for c, (d, w) in updates.items():
        plain.add(d, w, c)
        secure.add(d, w, c)
    a, b = plain.apply(_weights()), secure.apply(_weights())
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_junk_masked_input_refuses_the_round_and_leaves_the_model():
    clients = list(range(6))
    updates = _updates(clients)
    secure = _secure(WeightedDeltaSum(), clients, 60)
    junk = secure.clients[3]
    honest = junk.masked_input
    junk.masked_input = lambda x, shares, checks=None: honest(  # type: ignore[method-assign]
        np.random.default_rng(0).integers(0, 2**32, x.size, dtype=np.uint32), shares, checks)
    for c, (d, w) in updates.items():
        secure.add(d, w, c)
    g = _weights()
    with pytest.raises(AggregationError, match="outside what clamped updates"):
        secure.apply(g)
    assert all(torch.equal(g[k], v) for k, v in _weights().items())


def test_too_few_shares_fail_the_round_cleanly():
    clients = list(range(6))
    updates = _updates(clients)
    secure = _secure(WeightedDeltaSum(), clients, 60)
    for c, (d, w) in updates.items():
        if c < 3:
            secure.add(d, w, c)
    for c in (0, 1):  # two of the three survivors' devices go silent in the unmasking stage
        secure.clients[c].unmask = lambda alive, gone: None  # type: ignore[method-assign]
    with pytest.raises(AggregationError, match="cannot be unmasked"):
        secure.apply(_weights())


@pytest.mark.parametrize("over, words", [
    ("aggregation.rule=median", "needs every update on its own"),
    ("train.mode=async", "one by one"),
    ("wire.up=fp16", "cannot code"),
    ("wire.up=topk", "cannot code"),
])
def test_what_cannot_combine_with_it_is_refused_in_one_line(over, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["secagg.enabled=true", over])
    assert words in str(err.value) and "\n" not in str(err.value)


SECURE = ("algorithm.name=fedavg", "rounds=2", "train.threads=1", "secagg.enabled=true",
          "train.join_ratio=0.8")


@pytest.mark.slow("secure aggregation rounds (key agreement, masks, recovery): 11 s on 2 cores")
def test_a_secure_run_is_bitwise_whatever_the_keys_across_workers_and_resume(
        data_root, tmp_path, one_thread):
    """Every round draws fresh keys and masks, yet the unmasked sum, decoded, is the same
    arithmetic: two runs, a --workers run and a resumed one are bitwise one run."""
    cfg = quick_config(data_root, *SECURE)
    alone = run_simulation(cfg, tmp_path / "full")
    same_run(run_simulation(cfg, None), alone)
    same_run(run_simulation(cfg, None, workers=2), alone)

    resumed = resumed_after(cfg, tmp_path / "part", 0)
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in alone.global_weights.items())
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("secure_recovered") for r in rows if r["phase"] == "train"] == [[], []]
    # close to the plain run: the same rounds, sums within the encoding's error
    plain = run_simulation(quick_config(data_root, *SECURE[:-2], "train.join_ratio=0.8"), None)
    for k, v in plain.global_weights.items():
        if v.is_floating_point():
            assert torch.allclose(alone.global_weights[k], v, atol=1e-4), k


@pytest.mark.slow("secure aggregation rounds (key agreement, masks, recovery): 8 s on 2 cores")
def test_int8_masks_in_a_16_bit_ring_half_the_bytes_and_bitwise_across_workers(
        data_root, one_thread):
    """wire.up = "int8" under [secagg]: the clients' updates go unquantized into a 16-bit ring
    (2 bytes a value), so a round's masked inputs are half the 32-bit ring's; the run is still
    one arithmetic whatever the keys (--workers), and near the plain run (its step: n B x the
    largest weight / 2^15 per weighted value)."""
    cfg = quick_config(data_root, *SECURE)
    wide = run_simulation(cfg, None)
    narrow_cfg = quick_config(data_root, *SECURE, "wire.up='int8'")
    narrow = run_simulation(narrow_cfg, None)
    same_run(run_simulation(narrow_cfg, None, workers=2), narrow)
    for w, n in zip(wide.rows, narrow.rows, strict=True):
        if w["phase"] == "train":
            assert n["clients"] == w["clients"] and n["reported"] == w["reported"]
            assert 0.49 < n["bytes_up"] / w["bytes_up"] < 0.51
    plain = run_simulation(quick_config(data_root, *SECURE[:-2], "train.join_ratio=0.8"), None)
    diff = max(float((narrow.global_weights[k] - v).abs().max())
               for k, v in plain.global_weights.items() if v.is_floating_point())
    assert 0 < diff < 5e-3  # 1.6e-3 measured (B = 4; 3.7e-8 in the 32-bit ring)


@pytest.mark.slow("a secure deployment on two daemons over amqtt beside its simulation")
@pytest.mark.parametrize("more", [(), ("privacy.enabled=true", "privacy.clip_norm=2",
                                       "privacy.noise_multiplier=0.5", "wire.up='int8'",
                                       "seeds.noise=3")])
def test_a_secure_deployment_gives_the_simulations_run(data_root, tmp_path, one_thread, more):
    """The four stages over MQTT (an embedded broker, two local devices): the devices mask (with
    DP: clip, then mask with weight 1, in the 16-bit ring of wire.up = "int8"), the coordinator
    relays and unmasks (and adds the noise, its seed pinned: unpinned, each run draws its own);
    bitwise the simulation's weights and rows (the unmasked sum does not depend on the keys)."""
    from fedseq.server.ops.deployment import run_deployment

    cfg = quick_config(data_root, *SECURE, "deploy.port=0", *more)
    assert "secagg" not in cfg.for_devices()
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=lambda *a, **k: None)
    sim = run_simulation(cfg, out=None)
    for d, s in zip(dep.rows, sim.rows, strict=True):
        assert d["clients"] == s["clients"] and d["reported"] == s["reported"]
        assert d["global_acc"] == s["global_acc"]
        assert d.get("secure_recovered") == s.get("secure_recovered")
    assert all(torch.equal(dep.global_weights[k], v) for k, v in sim.global_weights.items())
    # what the coordinator received of each client: its masked input and the stages, a little
    # more than the plain update
    if not more:
        plain = run_simulation(quick_config(data_root, *SECURE[:-2], "train.join_ratio=0.8"),
                               None)
        assert 1.0 < dep.rows[0]["bytes_up"] / plain.rows[0]["bytes_up"] < 1.3


def test_the_example_is_the_testbed_plus_its_section():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples"
    secure = load_config(root / "secagg-testbed.toml")
    plain = load_config(root / "fmnist-testbed.toml")
    assert secure.secagg.enabled and not plain.secagg.enabled
    assert secure.model_copy(update={"secagg": plain.secagg}) == plain


def test_a_coordinate_beyond_the_clip_range_is_clamped_and_said(caplog):
    clients = [0, 1]
    secure = _secure(WeightedDeltaSum(), clients, 10, **{"secagg.clip_range": 1})
    big = {k: torch.zeros_like(v) for k, v in _weights().items()}
    big["conv1.bias"][0] = 3.0
    with caplog.at_level("WARNING"):
        secure.add(big, {"conv1": 10.0, "fc1": 10.0}, 0)
        secure.add({k: torch.zeros_like(v) for k, v in _weights().items()},
                   {"conv1": 10.0, "fc1": 10.0}, 1)
    assert "client 0 clamped 1 coordinates to +-1" in caplog.text
    new = secure.apply(_weights())
    assert abs(float(new["conv1.bias"][0] - _weights()["conv1.bias"][0]) - 0.5) < 1e-6


def test_a_dp_round_encodes_at_weight_one_within_c():
    """Client-level DP weighs every update 1 and clips it to C: the round's scale is set for
    weight 1 and coordinates within C (no coordinate of a clipped update exceeds it), the finest
    the ring allows, and the values are truncated so that no update grows past C."""
    cfg = load_config(None, ["secagg.enabled=true", "privacy.enabled=true",
                             "privacy.clip_norm=0.5", "secagg.clip_range=4"])
    layout = layout_of(_weights())
    setup = round_setup(cfg, 4, list(range(6)), layout, 1.0)
    assert setup.clip_range == 0.5 and setup.scale == scale_for(6, 1.0, 0.5)
    plain = load_config(None, ["secagg.enabled=true", "secagg.clip_range=4"])
    assert round_setup(plain, 4, list(range(6)), layout, 80.0).clip_range == 4.0


def _junk_round(inner, junk_weights, junk_value, **over):
    """A secure round of 10 clients in which client 0's masked input is made from `junk_value`
    in every coordinate with `junk_weights` (tensor -> weight) in its weight slots, as a hostile
    device could mask anything; the other nine add honest updates. The sum, unmasked."""
    from fedseq.common.secagg import client_vector

    clients = list(range(10))
    secure = _secure(inner, clients, 1.0 if isinstance(inner, NoisedSum) else 90.0, **over)
    for c, (d, w) in _updates(clients).items():
        if c == 0:
            bad = {k: torch.full_like(v, junk_value) for k, v in _weights().items()}
            x, _ = client_vector(bad, junk_weights, secure.layout, secure.setup)
            secure.server.add_masked(0, secure.clients[0].masked_input(x, secure.routed.get(0, {})))
        else:
            secure.add(d, w, c)
    return secure


def test_a_junk_masked_input_under_dp_is_refused_by_the_sums_norm_and_weights():
    """Hardening VI, finding 6: under DP + SecAgg nothing checked a device's clipping: one of 10
    clients masking B in every coordinate was accepted (the sum's L2 norm far above n x C), and
    inflated weight slots that wrap the weights' sum below zero made every tensor skipped with
    the round counted. Now the unmasked sum is refused, in one line, when its L2 norm exceeds
    masked clients x C, when a tensor's weight is not a whole count of them, or when it has no
    weight at all; an honest DP round still applies."""
    dp = {"privacy.enabled": "true", "privacy.clip_norm": 0.5}
    names = [k for k, _ in layout_of(_weights())]
    noised = lambda: NoisedSum(0.5, 0.0, 10, 0, 4)  # noqa: E731 (no noise: the sum is exact)
    for weights, value, why in [
            (dict.fromkeys(names, 1.0), 0.5, "L2 norm of .* more than its 10 masked clients"),
            (dict.fromkeys(names, -9.0), 0.0, "has weight"),
            (dict.fromkeys(names, 0.5), 0.0, "has weight 9.5: under DP each"),
    ]:
        secure = _junk_round(noised(), weights, value, **dp)
        with pytest.raises(AggregationError, match=why) as err:
            secure.apply(_weights())
        assert "\n" not in str(err.value) and "junk" in str(err.value)
    honest = _secure(noised(), list(range(10)), 1.0, **dp)
    for c, (d, w) in _updates(list(range(10))).items():
        honest.add({k: v * 0.1 for k, v in d.items()}, w, c)  # within C = 0.5
    assert honest.apply(_weights()).keys() == _weights().keys()


def test_a_weightless_junk_sum_is_refused_not_skipped():
    """A tensor whose weights sum to zero (or below) under a non-zero sum was skipped before,
    the round counted with that tensor unmoved: now it is refused."""
    names = [k for k, _ in layout_of(_weights())]
    secure = _junk_round(WeightedDeltaSum(), dict.fromkeys(names, -600.0), 0.01)
    with pytest.raises(AggregationError, match="has weight"):
        secure.apply(_weights())


@pytest.mark.slow("three secure rounds, twice (one interrupted and resumed): 8 s on 2 cores")
def test_a_client_whose_shares_are_proven_bad_is_left_out_of_the_rest_of_the_run(
        data_root, tmp_path, one_thread, monkeypatch):
    """Client 1 reveals junk shares in stage 4 (each off by one): every one fails its owner's
    check, the round still unmasks from the others, client 1 is blamed, recorded and never
    selected again, and a resumed run keeps it out."""
    from fedseq.common import secagg as S

    honest = S.SecAggClient.unmask

    def junk(self, survivors, dropped):
        out = honest(self, survivors, dropped)
        return {v: (k, (x + 1) % S.PRIME if k != S.OWN else x)  # (its own seed: as it is)
                for v, (k, x) in out.items()} if self.me == 1 else out

    monkeypatch.setattr(S.SecAggClient, "unmask", junk)
    cfg = quick_config(data_root, "secagg.enabled=true", "rounds=3", "train.join_ratio=1.0")
    rows = run_simulation(cfg, tmp_path / "full").rows
    train = [r for r in rows if r["phase"] == "train"]
    assert train[0]["clients"] == [0, 1, 2, 3, 4] and train[0]["reported"] == [0, 1, 2, 3, 4]
    why = train[0]["excluded"]["1"]  # as metrics.jsonl holds it
    assert list(train[0]["excluded"]) == ["1"] and why.startswith("round 0: unmask: its share of")
    assert "fails its owner's check" in why
    assert [r["clients"] for r in train[1:]] == [[0, 2, 3, 4]] * 2
    assert all("excluded" not in r for r in train[1:])
    resumed = resumed_after(cfg, tmp_path / "part", 0)
    assert [r["clients"] for r in resumed.rows if r["phase"] == "train"] == [[0, 2, 3, 4]] * 2


def test_a_device_proven_bad_has_all_its_clients_left_out():
    """Over MQTT the pool knows each client's device: one client's bad shares exclude every
    client that device holds, each saying why, and nothing twice."""
    from types import SimpleNamespace

    from fedseq.server.rounds.ledger import Ledger

    book = SimpleNamespace(pool=SimpleNamespace(owner={0: "nano1", 1: "nano2", 2: "nano2",
                                                       3: "nano3", 4: "nano2"}), excluded={})
    new = Ledger.exclude(book, {2: "unmask: junk"}, 4)  # type: ignore[arg-type]
    assert new == {1: "round 4: client 2 of its device nano2: unmask: junk",
                   2: "round 4: unmask: junk",
                   4: "round 4: client 2 of its device nano2: unmask: junk"}
    assert book.excluded == new and Ledger.exclude(book, {1: "again"}, 5) == {}  # type: ignore
