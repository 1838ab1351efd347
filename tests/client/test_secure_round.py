"""A device's side of a secure round (client/secure.py), on the device stack's Python: two devices'
rounds answer each stage in wire form, the coordinator's SecAggServer routes them, and the
unmasked sum is the plain weighted sum; junk in a stage stops only its client."""

import numpy as np
import pytest
import torch

from fedseq.client.secure import SecureRound
from fedseq.common.secagg import (
    SecAggError,
    SecAggServer,
    Setup,
    answer_from_wire,
    decode,
    keys_from_wire,
    neighbours,
    scale_for,
    setup_from_dict,
    setup_to_dict,
    shares_from_wire,
    split_sum,
    to_text,
    vector_length,
)

pytest.importorskip("cryptography")

LAYOUT = [("a.weight", 6), ("b.bias", 3)]


def _setup(clients, threshold=2):
    graph = neighbours(clients, len(clients) - 1, 7)
    return Setup(round=3, graph=graph, threshold=threshold, length=vector_length(LAYOUT),
                 scale=scale_for(len(clients), 50.0, 1.0), clip_range=1.0)


def _deltas(c):
    g = torch.Generator().manual_seed(c)
    return {"a.weight": torch.rand(6, generator=g) - 0.5, "b.bias": torch.rand(3, generator=g) - 0.5}


def test_two_devices_rounds_unmask_to_the_weighted_sum():
    clients = [0, 1, 2, 3]
    setup = _setup(clients)
    raw = setup_to_dict(setup, LAYOUT, False)
    devices = [SecureRound(9, raw, [0, 2]), SecureRound(9, raw, [1, 3])]
    server = SecAggServer(setup_from_dict(raw)[0])
    keys = {c: keys_from_wire(v) for d in devices for c, v in d.keys().items()}
    theirs = server.advertised(keys)
    down = {c: {str(v): [to_text(k) for k in pair]
                for v, pair in nbrs.items()} for c, nbrs in theirs.items()}
    sent = {c: shares_from_wire(v) for d in devices
            for c, v in d.share({c: down[c] for c in d.parties}).items()}
    routed = server.shared(sent)
    for d in devices:
        d.take_shares({c: {str(v): to_text(b)
                           for v, b in routed[c].items()} for c in d.parties})
    weights = {0: 10.0, 1: 20.0, 2: 30.0}  # client 3 trains but never sends: it dropped
    for d in devices:
        for c in d.parties:
            assert d.ready(c)
            if c in weights:
                y = d.masked(c, _deltas(c), {"a": weights[c], "b": weights[c]})
                server.add_masked(c, y)
    answers = {}
    for d in devices:
        asked = {c: list(v) for c, v in server.unmask_requests().items() if c in d.parties}
        answers.update({c: answer_from_wire(v) for c, v in d.unmask(asked).items()})
    sums, w = split_sum(server.unmasked(answers), LAYOUT, setup.scale, setup.clip_range)
    for name, _ in LAYOUT:
        plain = sum(weights[c] * _deltas(c)[name].double().numpy() for c in weights)
        assert w[name] == pytest.approx(sum(weights.values()))
        assert np.abs(sums[name] - plain).max() < 4 * len(clients) / setup.scale
    assert server.dropped.keys() == {3}


def test_junk_in_a_stage_stops_only_its_client():
    setup = _setup([0, 1, 2])
    raw = setup_to_dict(setup, LAYOUT, True)
    d = SecureRound(1, raw, [0, 1])
    d.keys()
    out = d.share({0: {"1": ["x", "y"]}, 1: "junk"})
    assert out == {} and set(d.stopped) == {0, 1}
    assert d.masked(0, _deltas(0), {}) is None
    with pytest.raises(SecAggError, match="malformed"):
        SecureRound(1, {**raw, "layout": [["a.weight", 5]]}, [0])
    assert decode(np.zeros(2, dtype=np.uint32), 1.0).tolist() == [0.0, 0.0]
