"""SecAgg+ (common/secagg.py): Shamir's sharing against its definition, the fixed-point
encoding's error, the unmasked sum against the plain one, dropouts and junk at every stage, and a
masked input against uniform."""

from __future__ import annotations

import contextlib
import json
import math
import random

import numpy as np
import pytest

pytest.importorskip("cryptography")

from fedseq.common import secagg as S  # noqa: E402


def test_shamir_any_t_points_give_the_secret_and_the_points_are_the_polynomials():
    rng = random.Random(0)
    secret = rng.getrandbits(256)
    xs = list(range(1, 11))
    points = S.shamir_share(secret, 4, xs)
    for _ in range(20):
        subset = rng.sample(xs, 4)
        assert S.shamir_reconstruct({x: points[x] for x in subset}) == secret
    # the definition: f(x) = secret + a1 x + a2 x^2 + a3 x^3 over GF(p); four points fix it and
    # every other point lies on it
    some = {x: points[x] for x in xs[:4]}
    assert all(S.lagrange_at(some, x) == points[x] for x in xs[4:])
    assert S.lagrange_at(some, 0) == secret
    # three points say nothing: a polynomial through them takes any value at 0 (here the
    # interpolation of three points, a degree-2 curve, misses the secret)
    assert S.shamir_reconstruct({x: points[x] for x in xs[:3]}) != secret
    with pytest.raises(ValueError):
        S.shamir_share(secret, 11, xs)
    with pytest.raises(ValueError):
        S.shamir_share(S.PRIME, 2, xs)


def test_robust_reconstruction_finds_the_secret_past_a_wrong_share_and_names_it():
    secret = 12345
    points = S.shamir_share(secret, 3, [1, 2, 3, 4, 5, 6])
    points[2] = (points[2] + 1) % S.PRIME
    got, wrong = S.robust_reconstruct(points, 3, lambda s: s == secret)
    assert got == secret and wrong == [2]
    assert S.robust_reconstruct({1: points[1], 3: points[3]}, 3, lambda s: True) == (None, [])


@pytest.mark.parametrize("bits", [32, 16])
def test_the_encoding_error_is_within_half_a_step_and_the_sum_cannot_wrap(bits):
    m, weight, clip = 100, 1324.0, 1.0
    scale = S.scale_for(m, weight, clip, bits)
    rng = np.random.default_rng(1)
    values = rng.uniform(-1, 1, 10_000) * weight
    coded = S.encode(values, scale, bits)
    assert coded.dtype == S.RINGS[bits][0]
    back = S.decode(coded, scale)
    assert np.abs(back - values).max() <= 0.5 / scale + 1e-12
    # the step against the largest value: m clients share the ring's half
    assert 1 / scale == pytest.approx(m * weight * clip / ((1 << (bits - 1)) - 1 - m))
    # m clients at the extremes, +B x the largest weight each and -B: no wrap, whatever the
    # rounding (2 clients of weight 10 once rounded to exactly 2^31, read back as -2^31)
    for m, weight in ((100, 1324.0), (2, 10.0), (1, 1.0), (7, 3.0), (250, 2.0)):
        scale = S.scale_for(m, weight, clip, bits)
        for sign in (1, -1):
            one = S.encode(np.full(4, sign * weight * clip), scale, bits)
            total = sum((one for _ in range(m)), np.zeros(4, dtype=S.RINGS[bits][0]))
            # each client's value within half a step (the sign says nothing wrapped)
            err = np.abs(S.decode(total, scale) - sign * m * weight * clip)
            assert (err <= m * 0.5 / scale * (1 + 1e-9)).all()
    with pytest.raises(S.SecAggError, match="no room"):
        S.scale_for(40_000, 1.0, clip, 16)


def _round(m=12, n=5000, degree=None, fraction=0.5, seed=0, bits=32, checked=False, opens=False,
           paired=False):
    clients = list(range(3, 3 + m))
    k = S.degree_for(m, degree)
    setup = S.Setup(round=7, graph=S.neighbours(clients, k, seed),
                    threshold=S.threshold_for(k, fraction), length=n,
                    scale=S.scale_for(m, 1.0, 1.0, bits), clip_range=1.0, ring_bits=bits,
                    checked=checked, opens=opens, paired=paired)
    rng = np.random.default_rng(seed)
    inputs = {c: S.encode(rng.uniform(-1, 1, n), setup.scale, bits) for c in clients}
    return setup, inputs, {c: S.SecAggClient(c, setup) for c in clients}, S.SecAggServer(setup)


def _run(setup, inputs, clients, server, silent=(), late=(), quiet=(), tamper=None):
    """One round: `silent` send nothing from stage 1, `late` share keys and send no masked
    input, `quiet` send no unmasking shares; `tamper(stage, client, message)` may replace a
    message."""
    tamper = tamper or (lambda stage, c, msg: msg)
    keys = server.advertised({c: tamper(1, c, x.advertise()) for c, x in clients.items()
                              if c not in silent})
    sent = {}
    for c, theirs in keys.items():
        with contextlib.suppress(S.SecAggError):
            sent[c] = tamper(2, c, clients[c].share_keys(theirs))
    routed = server.shared(sent)
    for c in routed:
        if c in late:
            continue
        with contextlib.suppress(S.SecAggError):
            server.add_masked(c, tamper(3, c, clients[c].masked_input(
                inputs[c], routed[c], server.checks_for(c))))
    shares = {c: tamper(4, c, clients[c].unmask(*asked))
              for c, asked in server.unmask_requests().items() if c not in quiet}
    return server.unmasked(shares)


def _plain(inputs, who):
    return sum((inputs[c] for c in who), np.zeros_like(next(iter(inputs.values()))))


@pytest.mark.parametrize("bits", [32, 16])
def test_the_unmasked_sum_is_the_plain_sum_exactly(bits):
    setup, inputs, clients, server = _round(bits=bits)
    total = _run(setup, inputs, clients, server)
    assert total.dtype == setup.dtype and np.array_equal(total, _plain(inputs, inputs))
    assert server.dropped == {} and server.masked == sorted(inputs)
    assert 1 < setup.threshold <= len(setup.graph[3]) < len(inputs) - 1  # a sparse graph


def test_the_graph_is_regular_symmetric_and_logarithmic():
    for m in (2, 5, 10, 30, 101, 300):
        clients = list(range(m))
        k = S.degree_for(m)
        g = S.neighbours(clients, k, 3)
        assert all(c not in g[c] and all(c in g[v] for v in g[c]) for c in clients)
        degrees = {len(v) for v in g.values()}
        assert max(degrees) <= k + 1 and min(degrees) >= min(k, m - 1)
        assert k <= 2 * math.ceil(math.log2(m))


@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("stage", ["advertise", "share keys", "masked input"])
def test_a_client_that_drops_at_any_stage_leaves_the_others_sum(stage, bits):
    setup, inputs, clients, server = _round(bits=bits)
    gone = [4, 9]
    kwargs = {"advertise": {"silent": gone}, "share keys": {},
              "masked input": {"late": gone}}[stage]
    if stage == "share keys":  # keys advertised, then nothing
        kwargs = {"tamper": lambda st, c, msg: None if st == 2 and c in gone else msg}
    total = _run(setup, inputs, clients, server, **kwargs)
    assert np.array_equal(total, _plain(inputs, [c for c in inputs if c not in gone]))
    assert set(server.dropped) == set(gone)


def test_unmasking_survives_silent_clients_down_to_the_threshold_and_fails_below():
    setup, inputs, clients, server = _round(m=8, degree=7, fraction=0.5)  # k 7, t 4
    assert setup.threshold == 4
    quiet = [3, 4, 5]  # 4 of each client's 7 neighbours still answer
    total = _run(setup, inputs, clients, server, quiet=quiet)
    assert np.array_equal(total, _plain(inputs, inputs))
    setup, inputs, clients, server = _round(m=8, degree=7, fraction=0.5)
    with pytest.raises(S.SecAggError, match="cannot be unmasked"):
        _run(setup, inputs, clients, server, quiet=[3, 4, 5, 6])


def _junk(stage, victim, kind):
    def tamper(st, c, msg):
        if st != stage or c != victim:
            return msg
        if stage == 1:
            return (b"\0" * 31, msg[1]) if kind == "short" else (msg[0], msg[0])
        if stage == 2:
            blobs, commitment, checks = msg
            return ({v: b[:-1] for v, b in blobs.items()}, commitment, checks) \
                if kind == "short" else (blobs, b"x", checks)
        if stage == 3:  # "wrong": the other ring's width
            return msg[:-1] if kind == "short" else msg.astype(
                np.uint16 if msg.dtype == np.uint32 else np.uint32)
        one = next(iter(msg))
        return {**msg, one: (msg[one][0], (msg[one][1] + 1) % S.PRIME)} if kind == "short" else {
            **msg, one: ("s" if msg[one][0] == "b" else "b", msg[one][1])}
    return tamper


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("stage", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["short", "wrong"])
def test_junk_at_any_stage_drops_its_sender_and_the_sum_stays_right(stage, kind, bits, checked):
    setup, inputs, clients, server = _round(bits=bits, checked=checked)
    victim = 6
    total = _run(setup, inputs, clients, server, tamper=_junk(stage, victim, kind))
    if stage == 4:  # its masked input counted; its wrong share is found and named
        assert np.array_equal(total, _plain(inputs, inputs))
        assert victim in server.blamed and victim not in server.dropped
    else:
        assert np.array_equal(total, _plain(inputs, [c for c in inputs if c != victim]))
        assert victim in server.dropped and server.dropped[victim]


@pytest.mark.parametrize("checked", [False, True])
def test_a_tampered_share_is_disputed_where_checked_and_stops_its_receiver_where_not(checked):
    """A sender's share that does not decrypt: an unchecked round drops its receiver (as a
    device of an older fedseq does); a checked one keeps it, the share disputed, nobody
    blamed."""
    setup, inputs, clients, server = _round(checked=checked)
    sender = 5
    receiver = setup.graph[sender][0]  # the receiver is one of the sender's neighbours

    def tamper(st, c, msg):
        if st == 2 and c == sender:
            blobs, commitment, checks = msg
            bad = bytearray(blobs[receiver])
            bad[-1] ^= 1
            return ({**blobs, receiver: bytes(bad)}, commitment, checks)
        return msg

    total = _run(setup, inputs, clients, server, tamper=tamper)
    if checked:
        assert np.array_equal(total, _plain(inputs, inputs))
        assert clients[receiver].disputed == {sender: f"the share from {sender} does not decrypt"}
        assert server.blamed == {} and server.dropped == {}
    else:
        assert np.array_equal(total, _plain(inputs, [c for c in inputs if c != receiver]))


def test_a_client_never_reveals_both_secrets_of_a_neighbour():
    setup, inputs, clients, server = _round()
    keys = server.advertised({c: x.advertise() for c, x in clients.items()})
    routed = server.shared({c: clients[c].share_keys(k) for c, k in keys.items()})
    c = 3
    clients[c].masked_input(inputs[c], routed[c], server.checks_for(c))
    v = clients[c].partners[0]
    others = [p for p in clients[c].partners if p != v]
    clients[c].unmask([c, v, *others], [])
    with pytest.raises(S.SecAggError, match="both secrets"):
        clients[c].unmask([c, *others], [v])
    with pytest.raises(S.SecAggError, match="disjoint"):
        clients[c].unmask([c, v], [v])


@pytest.mark.parametrize("bits", [32, 16])
def test_a_masked_input_looks_uniform_and_uncorrelated_with_the_update(bits):
    """What the coordinator's broker login captures of one client: its masked input. A chi-square
    test of its bytes against uniform (fixed seed; it fails where the masks are not uniform,
    e.g. with no masks at all), and its correlation with the true update."""
    setup, inputs, clients, server = _round(m=10, n=65_536, bits=bits)
    c = 3
    ramp = S.encode(np.linspace(-0.001, 0.001, setup.length), setup.scale, bits)  # structured
    keys = server.advertised({k: x.advertise() for k, x in clients.items()})
    routed = server.shared({k: clients[k].share_keys(v) for k, v in keys.items()})
    y = clients[c].masked_input(ramp, routed[c])
    for data, uniform in ((y, True), (ramp, False)):
        counts = np.bincount(data.view(np.uint8), minlength=256)
        expected = data.nbytes / 256
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        # 255 degrees of freedom: 400 is past the 1 - 1e-8 quantile (a uniform input fails
        # once in a hundred million runs); the unmasked ramp's is in the hundreds of thousands
        assert (chi2 < 400) == uniform, chi2
    signed = S.decode(y, setup.scale)
    assert abs(np.corrcoef(signed, S.decode(ramp, setup.scale))[0, 1]) < 0.03


@pytest.mark.parametrize("bits", [32, 16])
def test_truncation_keeps_a_clipped_update_within_its_norm_where_rounding_does_not(bits):
    """DP's sensitivity is the clip norm C: an update clipped to C must not leave the device
    longer. Rounding to nearest can lengthen it (each coordinate by up to half a step);
    truncation toward zero, what a DP round encodes with, never does."""
    import torch

    n, clip = 20_000, 1.0
    layout = [("w", n)]
    # every coordinate +-C / sqrt(n) (norm exactly C), 3.6 steps of the ring's scale: rounding
    # to nearest takes each to 4 steps
    c = clip / np.sqrt(n)
    setup = S.Setup(round=0, graph=S.neighbours(list(range(6)), 5, 0), threshold=3,
                    length=S.vector_length(layout), scale=3.6 / c, clip_range=clip,
                    ring_bits=bits)
    x = np.where(np.random.default_rng(2).random(n) < 0.5, -c, c)
    update = {"w": torch.from_numpy(x)}
    for toward_zero, longer in ((False, True), (True, False)):
        coded, _ = S.client_vector(update, {"w": 1.0}, layout, setup, toward_zero)
        back = S.decode(coded, setup.scale)[:n]
        assert (np.linalg.norm(back) > clip) == longer


# -- checked shares (Hardening VI, finding 5) -----------------------------------------------------
def _junk_shares(attackers):
    """Stage 4 from `attackers`: a random share of the right kind for every neighbour asked."""
    rng = random.Random(0)

    def tamper(st, c, msg):
        if st != 4 or c not in attackers:
            return msg
        return {v: (kind, rng.randrange(S.PRIME)) for v, (kind, _) in msg.items()}
    return tamper


@pytest.mark.parametrize("m, attackers", [(6, [3]), (6, [3, 4]), (100, [3]), (100, [3, 4, 5]),
                                          (300, [3])])
def test_junk_shares_from_the_lowest_ids_cost_the_round_nothing_and_blame_their_senders(
        m, attackers):
    """The audit's attack: random shares of the right kind from the lowest client ids (6: a
    testbed round, k 5 and t 3, so at most 2 junk holders leave t honest ones). With checks
    every junk share fails its owner's check, its sender is blamed, and any t others unmask
    at once."""
    setup, inputs, clients, server = _round(m=m, n=50, checked=True)
    total = _run(setup, inputs, clients, server, tamper=_junk_shares(attackers))
    assert np.array_equal(total, _plain(inputs, inputs))
    assert sorted(server.blamed) == attackers and server.dropped == {}
    assert all("fails its owner's check" in server.blamed[a] for a in attackers)


def test_unchecked_junk_shares_fail_the_round_that_checks_survive():
    """The same attack where the shares carry no checks (devices of an older fedseq), in a
    300-client round (k 18, t 10): the 5,000 subsets the search may try all hold the junk
    share of the lowest id, and the round fails; checked, it is right (the test above)."""
    setup, inputs, clients, server = _round(m=300, n=50)
    with pytest.raises(S.SecAggError, match="cannot be unmasked"):
        _run(setup, inputs, clients, server, tamper=_junk_shares([3]))


def test_a_holder_is_never_blamed_for_a_share_that_failed_its_check_on_arrival():
    """An owner whose check of one holder's share is wrong (to frame it): the holder disputes
    the share in stage 3, reveals nothing of it, and is not blamed; the sum is right."""
    setup, inputs, clients, server = _round(checked=True)
    owner = 5
    holder = setup.graph[owner][0]

    def tamper(st, c, msg):
        if st == 2 and c == owner:
            blobs, commitment, checks = msg
            return blobs, commitment, {**checks, holder: (b"\1" * 32, b"\1" * 32)}
        return msg

    total = _run(setup, inputs, clients, server, tamper=tamper)
    assert np.array_equal(total, _plain(inputs, inputs))
    assert clients[holder].disputed == {owner: f"the share from {owner} fails its check"}
    assert server.blamed == {}


def test_an_owner_whose_checked_shares_contradict_each_other_is_blamed():
    """Shares that each pass their checks but lie on no polynomial through the owner's seed:
    the owner's own messages prove it bad; its masked input cannot be unmasked."""
    setup, inputs, clients, server = _round(checked=True)
    owner = 5
    real = S.shamir_share

    def lying(secret, threshold, xs):
        return {x: random.Random(x).randrange(S.PRIME) for x in xs}

    keys = server.advertised({c: x.advertise() for c, x in clients.items()})
    sent = {}
    for c, theirs in keys.items():
        S.shamir_share = lying if c == owner else real
        try:
            sent[c] = clients[c].share_keys(theirs)
        finally:
            S.shamir_share = real
    routed = server.shared(sent)
    for c in routed:
        server.add_masked(c, clients[c].masked_input(inputs[c], routed[c], server.checks_for(c)))
    shares = {c: clients[c].unmask(*asked) for c, asked in server.unmask_requests().items()}
    with pytest.raises(S.SecAggError, match=f"client {owner}'s self-mask"):
        server.unmasked(shares)
    assert list(server.blamed) == [owner] and "do not open its commitment" in server.blamed[owner]


def test_a_round_with_older_devices_mixes_checked_and_unchecked_shares():
    """Clients that send no checks (an older fedseq): their shares are reconstructed by the
    search, the others' at once; a junk share is found either way."""
    setup, inputs, clients, server = _round(checked=True)
    old = {4, 8, 11}

    def tamper(st, c, msg):
        if st == 2 and c in old:
            return msg[0], msg[1], None
        return msg

    both = _junk_shares([6])
    total = _run(setup, inputs, clients, server, tamper=lambda st, c, m: both(st, c, tamper(
        st, c, m)))
    assert np.array_equal(total, _plain(inputs, inputs))
    assert set(server.checks) == set(inputs) - old and list(server.blamed) == [6]
    assert all(server.checks_for(c) is None for c in old)


def test_the_search_tries_subsets_without_a_blamed_holder_first():
    secret = 777
    points = S.shamir_share(secret, 3, [1, 2, 3, 4, 5, 6])
    points[1] = (points[1] + 1) % S.PRIME
    points[2] = (points[2] + 1) % S.PRIME
    tried = []

    def valid(s):
        tried.append(s)
        return s == secret
    got, wrong = S.robust_reconstruct(points, 3, valid, suspect={1, 2})
    assert got == secret and sorted(wrong) == [1, 2] and len(tried) == 1


def test_checks_and_disputes_travel_and_older_forms_still_read():
    blobs = {4: b"\7" * S.CIPHER_BYTES, 9: b"\x08" * S.CIPHER_BYTES}
    checks = {4: (b"\1" * 32, b"\2" * 32), 9: (b"\3" * 32, b"\4" * 32)}
    wire = json.loads(json.dumps(S.shares_to_wire(blobs, b"\5" * 32, checks)))
    assert S.shares_from_wire(wire) == (blobs, b"\5" * 32, checks)
    old = json.loads(json.dumps(S.shares_to_wire(blobs, b"\5" * 32, None)))
    assert set(old) == {"to", "commit"} and S.shares_from_wire(old) == (blobs, b"\5" * 32, None)
    # the relay: with checks to a holder that reads them; as before to one that does not
    relay = json.loads(json.dumps(S.relay_to_wire(blobs, {4: checks[4]})))
    assert S.relay_from_wire(relay) == (blobs, {4: checks[4]})
    assert all(isinstance(v, str) for v in S.relay_to_wire(blobs, None).values())
    assert S.relay_from_wire(S.relay_to_wire(blobs, None)) == (blobs, {})
    answer = {4: ("b", 12345), 9: (S.DISPUTED, 0)}
    assert S.answer_from_wire(json.loads(json.dumps(S.answer_to_wire(answer)))) == answer
    for bad in ({"4": ["x", "AAAA"]}, {"4": ["c", ""]}):
        with pytest.raises(S.SecAggError, match="unmask"):
            S.answer_from_wire(bad)
    with pytest.raises(S.SecAggError, match="shares"):
        S.relay_from_wire({"4": ["a", "b"]})
    setup = S.Setup(round=1, graph={0: [1], 1: [0]}, threshold=1, length=2, scale=1.0,
                    clip_range=1.0, checked=True)
    raw = S.setup_to_dict(setup, [("w", 1)], False)
    assert S.setup_from_dict(raw)[0].checked
    assert not S.setup_from_dict({k: v for k, v in raw.items() if k != "checked"})[0].checked


@pytest.mark.parametrize("how", ["dispute", "silent"])
def test_holders_that_dispute_or_withhold_every_share_fail_no_round(how):
    """Hardening VII, finding 6: 3 of a 6-client round (k 5, t 3) answering every stage-4 share
    as disputed, or not answering, left each honest survivor 2 shares of its seed, below t: the
    round failed, nobody was blamed, and they could fail every round. Each survivor now opens
    its own seed (checked against its stage-2 commitment), so 5 rounds of the attack fail none;
    the attackers' own seeds come from their 3 honest holders. A coordinator from before
    (`opens` off) fails every one of them."""
    attackers = [3, 4, 5]

    def tamper(st, c, msg):
        if st == 4 and c in attackers:
            return {v: (S.DISPUTED, 0) for v, (kind, _) in msg.items() if kind != S.OWN}
        return msg

    for opens in (True, False):
        failed = 0
        for seed in range(5):
            setup, inputs, clients, server = _round(m=6, n=50, checked=True, opens=opens,
                                                    seed=seed)
            assert (setup.threshold, len(setup.graph[3])) == (3, 5)
            try:
                total = _run(setup, inputs, clients, server,
                             **({"tamper": tamper} if how == "dispute" else {"quiet": attackers}))
            except S.SecAggError:
                failed += 1
                continue
            assert np.array_equal(total, _plain(inputs, inputs))
            assert sorted(server.opened) == ([6, 7, 8] if opens else [])
        assert failed == (0 if opens else 5), (opens, failed)


def test_a_survivor_that_opens_another_seed_is_blamed_and_its_shares_unmask_it():
    """The seed a survivor opens must be the one it committed to: another is refused, its
    sender blamed, and its self-mask recovered from its holders' shares as before."""
    setup, inputs, clients, server = _round(m=6, n=50, checked=True, opens=True)

    def tamper(st, c, msg):
        if st == 4 and c == 3:
            return {**msg, 3: (S.OWN, (msg[3][1] + 1) % (1 << 256))}
        return msg

    total = _run(setup, inputs, clients, server, tamper=tamper)
    assert np.array_equal(total, _plain(inputs, inputs))
    assert server.blamed == {3: "unmask: the seed it opened is not the one it committed to"}
    assert 3 not in server.opened and sorted(server.opened) == [4, 5, 6, 7, 8]


def test_an_opened_seed_travels_and_a_setup_says_so():
    layout = [("w", 50)]
    setup, _, _, _ = _round(m=6, n=S.vector_length(layout), checked=True, opens=True)
    back, _, _ = S.setup_from_dict(S.setup_to_dict(setup, layout, False))
    assert back.opens and not S.setup_from_dict(S.setup_to_dict(
        S.Setup(**{**setup.__dict__, "opens": False}), layout, False))[0].opens
    answer = {3: (S.OWN, 12345), 4: ("b", 7), 5: (S.DISPUTED, 0)}
    assert S.answer_from_wire(S.answer_to_wire(answer)) == answer


def _false_disputes(attackers, clients, reveal=True):
    """Stage 4 from `attackers`: every share asked for disputed, with (`reveal`) or without the
    pair's channel key a paired setup asks for."""
    def tamper(st, c, msg):
        if st != 4 or c not in attackers:
            return msg
        return {v: (S.DISPUTED, int.from_bytes(clients[c].channels[v][0], "big") if reveal else 0)
                for v, (kind, _) in msg.items() if kind != S.OWN}
    return tamper


@pytest.mark.parametrize("reveal", [True, False])
def test_false_disputes_are_blamed_on_their_senders_and_fail_no_round(reveal):
    """Hardening VII, finding 6: disputes blamed nobody. With a channel key per pair of
    neighbours, a holder that disputes reveals that pair's key; the coordinator decrypts that
    one share, which passes its owner's check: the dispute was false, its sender is blamed
    (and excluded by the run), and the share counts. A dispute without the key is blamed too.
    3 of 6 clients disputing every share for 5 rounds: no round fails, and they are blamed in
    each."""
    attackers = [3, 4, 5]
    for seed in range(5):
        setup, inputs, clients, server = _round(m=6, n=50, checked=True, opens=True,
                                                paired=True, seed=seed)
        total = _run(setup, inputs, clients, server,
                     tamper=_false_disputes(attackers, clients, reveal))
        assert np.array_equal(total, _plain(inputs, inputs))
        assert sorted(server.blamed) == attackers
        words = "which decrypts and passes its check" if reveal else "does not reveal the key"
        assert all(words in server.blamed[a] for a in attackers), server.blamed


@pytest.mark.parametrize("how", ["junk", "frame"])
def test_a_dispute_shown_with_its_key_blames_an_owner_whose_share_is_junk(how):
    """The other side: an owner whose share to one holder does not decrypt, or fails the check
    it sent itself (to frame the holder). The holder disputes in stage 3 and shows the pair's
    key in stage 4: the owner is blamed, never the holder, and the sum is right."""
    setup, inputs, clients, server = _round(checked=True, opens=True, paired=True)
    owner = 5
    holder = setup.graph[owner][0]

    def tamper(st, c, msg):
        if st == 2 and c == owner:
            blobs, commitment, checks = msg
            if how == "junk":
                return {**blobs, holder: b"\0" * S.CIPHER_BYTES}, commitment, checks
            return blobs, commitment, {**checks, holder: (b"\1" * 32, b"\1" * 32)}
        return msg

    total = _run(setup, inputs, clients, server, tamper=tamper)
    assert np.array_equal(total, _plain(inputs, inputs))
    assert owner in clients[holder].disputed
    assert list(server.blamed) == [owner], server.blamed
    assert "does not decrypt or fails its own check" in server.blamed[owner]


def test_paired_keys_travel_and_an_unpaired_client_still_takes_part():
    """Stage 1's paired form on the wire, and a client of an older fedseq (one channel key)
    in a paired round: its shares work, and its disputes blame nobody, as before."""
    keys = ({4: b"\1" * 32, 9: b"\2" * 32}, b"\3" * 32)
    assert S.keys_from_wire(json.loads(json.dumps(S.keys_to_wire(keys)))) == keys
    assert S.keys_from_wire(S.keys_to_wire((b"\1" * 32, b"\3" * 32))) == (b"\1" * 32, b"\3" * 32)
    setup, inputs, clients, server = _round(m=6, n=50, checked=True, opens=True, paired=True)
    older = S.SecAggClient(3, S.Setup(**{**setup.__dict__, "paired": False}))
    clients[3] = older
    total = _run(setup, inputs, clients, server, tamper=_false_disputes([], clients))
    assert np.array_equal(total, _plain(inputs, inputs)) and server.blamed == {}
