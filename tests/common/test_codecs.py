"""The wire codecs on hand-made tensors: what each sends, what comes back, error feedback, and the
round contract's checks of a compressed update before it is decoded (whole runs and parity:
tests/server/test_wire.py)."""

import math

import pytest
import torch

from conftest import server_only
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.codecs import Codec, decode, encode, expected, wire_problem
from fedseq.common.protocol.tensors import decode_tensors, encode_tensors

W = {"fc.weight": torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]),
     "fc.bias": torch.tensor([3.0, -0.75]),
     "bn.running_var": torch.tensor([1.0, 2.0]),
     "bn.num_batches_tracked": torch.tensor(5)}


def _shapes(w):
    return {k: v.shape for k, v in w.items()}


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precisions_cast_parameters_only(name, dtype):
    wire, left = encode(W, Codec(name))
    assert left == {}
    assert wire["fc.weight"].dtype == dtype and wire["fc.bias"].dtype == dtype
    assert wire["bn.running_var"] is W["bn.running_var"]  # statistics travel as they are
    assert wire["bn.num_batches_tracked"] is W["bn.num_batches_tracked"]
    back = decode(wire)
    assert all(back[k].dtype == W[k].dtype for k in W)
    assert torch.equal(back["fc.weight"], W["fc.weight"])  # these values are exact in both


def test_int8_per_channel_scales_and_exact_zeros():
    wire, _ = encode(W, Codec("int8"))
    q, s = wire["fc.weight"], wire["fc.weight@scale"]
    assert q.dtype == torch.int8 and s.shape == (2,)
    assert s[0].item() == pytest.approx(1.0 / 127)  # max |row 0| / 127
    assert q[0].tolist() == [64, -127, 32]  # 63.5 rounds half to even: 64; 31.75 -> 32
    assert q[1].tolist() == [0, 0, 0] and s[1].item() == torch.finfo(torch.float32).tiny
    assert wire["fc.bias@scale"].shape == (1,)  # a vector: one scale
    back = decode(wire)
    assert torch.allclose(back["fc.weight"], W["fc.weight"], atol=0.5 / 127)
    assert torch.equal(back["fc.weight"][1], torch.zeros(3))
    per_tensor, _ = encode(W, Codec("int8", per_channel=False))
    assert per_tensor["fc.weight@scale"].shape == (1,)


def test_int8_of_denormals_stays_finite_and_tiny():
    tiny = torch.tensor([1e-40, -3e-39, 0.0])  # below float32's normal range
    wire, _ = encode({"fc.bias": tiny}, Codec("int8"))
    assert math.isfinite(wire["fc.bias@scale"].item()) and wire["fc.bias@scale"].item() > 0
    back = decode(wire)["fc.bias"]
    assert torch.isfinite(back).all() and back.abs().max() < 1e-35


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = {"fc.bias": torch.full((20000,), 0.3)}
    x["fc.bias"][0] = 1.0  # the scale: 1/127; 0.3 * 127 = 38.1 lies between codes 38 and 39
    a, _ = encode(x, Codec("int8", stochastic=True), generator=torch.Generator().manual_seed(1))
    b, _ = encode(x, Codec("int8", stochastic=True), generator=torch.Generator().manual_seed(1))
    assert torch.equal(a["fc.bias"], b["fc.bias"])
    codes = a["fc.bias"][1:].float()
    assert set(codes.unique().tolist()) == {38.0, 39.0}
    assert codes.mean().item() == pytest.approx(38.1, abs=0.02)


def test_topk_sends_the_largest_magnitudes_lower_index_first_on_ties():
    x = {"fc.weight": torch.tensor([[0.1, -2.0, 0.5], [2.0, 0.0, -0.5]])}
    wire, left = encode(x, Codec("topk", topk=0.5))  # 3 of 6 entries
    assert wire["fc.weight@idx"].dtype == torch.int32
    # |-2| and |2| first, then the tie of 0.5 and -0.5: the lower index (2) wins
    assert wire["fc.weight@idx"].tolist() == [1, 2, 3]
    assert wire["fc.weight@val"].tolist() == [-2.0, 0.5, 2.0]
    assert torch.equal(left["fc.weight"], torch.tensor([[0.1, 0.0, 0.0], [0.0, 0.0, -0.5]]))
    back = decode(wire, _shapes(x))["fc.weight"]
    assert torch.equal(back + left["fc.weight"], x["fc.weight"])  # nothing lost: sent + kept


def test_error_feedback_carries_the_residual_exactly():
    """Two rounds: what round 0 did not send is added to round 1's delta before ranking."""
    codec = Codec("topk", topk=0.25)  # 1 of 4
    d0 = {"fc.bias": torch.tensor([4.0, 1.0, -3.0, 0.5])}
    sent0, r0 = encode(d0, codec)
    assert decode(sent0, _shapes(d0))["fc.bias"].tolist() == [4.0, 0.0, 0.0, 0.0]
    d1 = {"fc.bias": torch.tensor([0.0, 1.5, -0.5, 0.0])}
    sent1, r1 = encode(d1, codec, r0)
    # accumulated: [0, 2.5, -3.5, 0.5]: -3.5 goes now, the rest waits
    assert decode(sent1, _shapes(d1))["fc.bias"].tolist() == [0.0, 0.0, -3.5, 0.0]
    assert r1["fc.bias"].tolist() == [0.0, 2.5, 0.0, 0.5]
    total = decode(sent0, _shapes(d0))["fc.bias"] + decode(sent1, _shapes(d1))["fc.bias"] + r1["fc.bias"]
    assert torch.equal(total, d0["fc.bias"] + d1["fc.bias"])


def test_wire_forms_survive_a_frame():
    for codec in (Codec("fp16"), Codec("bf16"), Codec("int8"), Codec("topk", topk=0.5)):
        wire, _ = encode(W, codec)
        again = decode_tensors(encode_tensors(wire))
        assert {k: (v.dtype, v.shape) for k, v in again.items()} == \
            {k: (v.dtype, v.shape) for k, v in wire.items()}
        assert all(torch.equal(decode(again, _shapes(W))[k], decode(wire, _shapes(W))[k]) for k in W)


def test_codec_specs_round_trip_and_bad_ones_say_why():
    for c in (Codec(), Codec("fp16"), Codec("int8", per_channel=False, stochastic=True),
              Codec("topk", topk=0.05)):
        assert Codec.parse(c.spec) == c
    with pytest.raises(ValueError, match="unknown wire codec"):
        Codec.parse("zstd")
    with pytest.raises(ValueError, match=r"not in \(0, 1\]"):
        Codec.parse("topk:0")


def _contract(codec, bound=10.0):
    from fedseq.server.rounds.contract import RoundContract  # the coordinator's

    ref = {"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)}
    return RoundContract(0, frozenset({0}), ref, {0: 5}, None, bound, {0: 3}, codec=codec)


def _update(wire):
    return ClientUpdate(client=0, round=0, deltas=wire, num_samples=5)


@server_only
def test_the_contract_decodes_a_valid_compressed_update():
    for codec in (Codec("fp16"), Codec("int8"), Codec("topk", topk=0.5)):
        delta = {"fc.weight": torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.25, 3.0]]),
                 "fc.bias": torch.tensor([0.5, -0.5])}
        wire, _ = encode(delta, codec)
        up = _update(dict(wire))
        assert _contract(codec).admit(up) is None, codec
        assert set(up.deltas) == {"fc.weight", "fc.bias"}
        assert all(v.dtype == torch.float32 for v in up.deltas.values())
        assert up.upload_bytes is not None and up.upload_bytes > 0


@server_only
@pytest.mark.parametrize("spoil,code,words", [
    (lambda w: w.__setitem__("fc.weight@idx", torch.tensor([0, 1, 6], dtype=torch.int32)),
     "bad-encoding", "leave its 6 entries"),
    (lambda w: w.__setitem__("fc.weight@idx", torch.tensor([2, 1, 0], dtype=torch.int32)),
     "bad-encoding", "strictly increasing"),
    (lambda w: w.__setitem__("fc.weight@idx", torch.tensor([1, 1, 2], dtype=torch.int32)),
     "bad-encoding", "strictly increasing"),
    (lambda w: w.__setitem__("fc.weight@idx", torch.tensor([-1, 1, 2], dtype=torch.int32)),
     "bad-encoding", "leave its"),
    (lambda w: w.__setitem__("fc.weight@idx", torch.tensor([0, 1, 2, 3], dtype=torch.int32)),
     "wrong-shape", "expected int32[3]"),
    (lambda w: w.__setitem__("fc.weight@val", torch.zeros(3, dtype=torch.float64)),
     "wrong-shape", "expected float32[3]"),
    (lambda w: w.pop("fc.bias@val"), "wrong-tensors", "missing"),
    (lambda w: w.__setitem__("fc.weight", torch.zeros(2, 3)), "wrong-tensors", "not uploadable"),
])
def test_the_contract_refuses_a_malformed_topk_update_before_decoding(spoil, code, words):
    wire, _ = encode({"fc.weight": torch.ones(2, 3), "fc.bias": torch.ones(2)}, Codec("topk", 0.5))
    wire = dict(wire)
    spoil(wire)
    got = _contract(Codec("topk", topk=0.5)).admit(_update(wire))
    assert got is not None and got.code == code and words in got.text, got


@server_only
@pytest.mark.parametrize("scale,words", [(float("nan"), "positive finite"),
                                         (0.0, "positive finite"), (-1.0, "positive finite"),
                                         (float("inf"), "positive finite"),
                                         (1.0, "exceed the round's bound")])
def test_the_contract_refuses_int8_scales_it_cannot_trust(scale, words):
    wire, _ = encode({"fc.weight": torch.ones(2, 3), "fc.bias": torch.ones(2)}, Codec("int8"))
    wire = dict(wire)
    wire["fc.weight@scale"] = torch.tensor([scale, 0.01])
    got = _contract(Codec("int8")).admit(_update(wire))
    assert got is not None and got.code == "bad-encoding" and words in got.text, got


@server_only
def test_a_half_precision_overflow_is_refused_as_non_finite():
    wire, _ = encode({"fc.weight": torch.full((2, 3), 1e5), "fc.bias": torch.ones(2)},
                     Codec("fp16"))  # fp16 tops out at 65504: inf
    got = _contract(Codec("fp16"), bound=1e6).admit(_update(dict(wire)))
    assert got is not None and got.code == "non-finite"


def test_expected_names_every_wire_tensor():
    form = expected(W, Codec("topk", topk=0.5))
    assert form["fc.weight@idx"] == (torch.int32, torch.Size([3]))
    assert form["bn.running_var"] == (torch.float32, torch.Size([2]))
    assert "fc.weight" not in form
    assert wire_problem(encode(W, Codec("topk", 0.5))[0], W, Codec("topk", 0.5),
                        lambda k: 1.0) is None


def test_a_sparse_topk_decode_is_the_dense_one_bitwise():
    g = torch.Generator().manual_seed(3)
    delta = {"conv.weight": torch.randn(4, 3, 5, 5, generator=g), "fc.weight": torch.randn(7, 9, generator=g),
             "fc.bias": torch.randn(7, generator=g)}
    wire, _ = encode(delta, Codec("topk", topk=0.1))
    dense, sparse = decode(dict(wire), _shapes(delta)), decode(dict(wire), _shapes(delta), sparse=True)
    for k in delta:
        assert sparse[k].is_sparse and sparse[k].shape == delta[k].shape
        assert torch.equal(sparse[k].to_dense(), dense[k]), k


def test_topk_updates_fold_entry_by_entry_to_the_dense_fold_bitwise():
    """The coordinator folds a top-k update's entries only (codecs.decode(sparse=True)); the
    aggregate is bitwise the one of its dense form, scaled (async staleness) or not."""
    from fedseq.common.algorithms.aggregate import WeightedDeltaSum
    from fedseq.common.algorithms.robust import update_norm

    g = torch.Generator().manual_seed(5)
    shapes = {"conv.weight": torch.Size([8, 3, 3, 3]), "fc.weight": torch.Size([10, 30]),
              "fc.bias": torch.Size([10])}
    glob = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    sparse_sum, dense_sum = WeightedDeltaSum(), WeightedDeltaSum()
    for c, (w, scale) in enumerate([(37.0, 1.0), (12.0, 0.5), (101.0, 1.0), (3.0, 0.70710678)]):
        wire, _ = encode({k: torch.randn(s, generator=g) * 0.01 for k, s in shapes.items()},
                         Codec("topk", topk=0.05))
        sparse, dense = decode(dict(wire), shapes, sparse=True), decode(dict(wire), shapes)
        if scale != 1.0:
            sparse = {k: v * scale for k, v in sparse.items()}
            dense = {k: v * scale for k, v in dense.items()}
        weights = {"conv": w, "fc": w}
        sparse_sum.add(sparse, weights, c)
        dense_sum.add(dense, weights, c)
        assert math.isclose(update_norm(sparse), update_norm(dense), rel_tol=1e-12)
    a, b = sparse_sum.apply(glob), dense_sum.apply(glob)
    assert all(torch.equal(a[k], b[k]) for k in shapes)


@server_only
def test_the_contract_bounds_a_sparse_topk_update_by_its_entries():
    wire, _ = encode({"fc.weight": torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.25, 3.0]]),
                      "fc.bias": torch.tensor([0.5, -0.5])}, Codec("topk", topk=0.5))
    up = _update(dict(wire))
    assert _contract(Codec("topk", topk=0.5)).admit(up) is None
    assert up.deltas["fc.weight"].is_sparse
    for value, code in ((1e6, "too-large"), (math.nan, "non-finite"), (-math.inf, "non-finite")):
        spoilt = dict(wire)
        spoilt["fc.weight@val"] = spoilt["fc.weight@val"].clone()
        spoilt["fc.weight@val"][1] = value
        reason = _contract(Codec("topk", topk=0.5)).admit(_update(spoilt))
        assert reason is not None and reason.code == code, (value, reason)
