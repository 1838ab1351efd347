"""Frame reassembly cannot be poisoned or used to exhaust memory."""

import hashlib
import random

import pytest

from fedseq.common.errors import ProtocolError
from fedseq.common.protocol.frames import CHUNK_BYTES, FramePool, split_frame
from fedseq.common.protocol.messages import UpdateHeader

FRAME = bytes(range(256)) * ((2 * CHUNK_BYTES + 5000) // 256)


def _headers(frame, **over):
    digest = hashlib.sha256(frame).hexdigest()
    parts = split_frame(frame)
    base = dict(run_id="r", seq=1, round=0, client=0, device="d1", num_samples=1,
                chunks=len(parts), size=len(frame), sha256=digest)
    base.update(over)
    return [(UpdateHeader(chunk=i, **base), p) for i, p in enumerate(parts)]


def test_truncated_forged_chunk_fails_only_itself():
    pool = FramePool(max_frame=len(FRAME), per_sender=4 * len(FRAME))
    honest = _headers(FRAME)
    with pytest.raises(ProtocolError, match="bytes, expected"):
        pool.add("d1", (0, 1), honest[1][0], b"x" * 250)  # truncated, same key as the honest frame
    forged = _headers(b"z" * 300, chunks=3, size=len(FRAME))  # another digest: its own buffer
    with pytest.raises(ProtocolError):
        pool.add("d1", (0, 1), forged[0][0], forged[0][1])
    out = [pool.add("d1", (0, 1), h, p) for h, p in honest]
    assert out[:-1] == [None, None] and bytes(out[-1]) == FRAME
    assert pool.held_bytes() == 0


def test_oversized_frame_refused_before_allocation():
    pool = FramePool(max_frame=1000, per_sender=10_000)
    (h, p), *_ = _headers(FRAME)
    huge = h.model_copy(update={"size": 1 << 30, "chunks": 1024})
    with pytest.raises(ProtocolError, match="exceeds"):
        pool.add("d1", (0, 1), huge, p)
    assert pool.held_bytes() == 0


def test_per_sender_budget_and_expiry():
    now = [0.0]
    pool = FramePool(max_frame=len(FRAME), per_sender=len(FRAME) + 10, ttl=60, clock=lambda: now[0])
    first = _headers(FRAME)
    pool.add("d1", (0, 1), *first[0])
    other = _headers(FRAME[::-1], client=1)
    with pytest.raises(ProtocolError, match="limit"):
        pool.add("d1", (1, 1), *other[0])  # d1 is over its budget ...
    assert pool.add("d2", (1, 1), *other[0]) is None  # ... other senders are not affected
    pool.expire(lambda sender, tag: sender != "d2")
    assert pool.held_bytes("d2") == 0 and pool.held_bytes("d1") == len(FRAME)
    now[0] = 61.0
    pool.add("d2", (1, 1), *other[0])  # any call sweeps frames older than the ttl
    assert pool.held_bytes("d1") == 0


def test_corrupt_complete_frame_is_dropped():
    pool = FramePool(max_frame=len(FRAME), per_sender=4 * len(FRAME))
    hs = _headers(FRAME)
    pool.add("d1", (0, 1), *hs[0])
    pool.add("d1", (0, 1), *hs[1])
    with pytest.raises(ProtocolError, match="sha256"):
        pool.add("d1", (0, 1), hs[2][0], b"\0" * len(hs[2][1]))
    assert pool.held_bytes() == 0


def test_chunks_beyond_the_budget_wait_outside_memory_and_make_the_same_frame():
    """A pool with `spill` keeps at most `budget` bytes of partial frames' chunks in memory (a
    coordinator receiving hundreds of interleaved frames); the others come back from where they
    were spilled when their frame completes, and the frame is the same."""
    import hashlib

    from fedseq.common.protocol.frames import CHUNK_BYTES, FramePool, Spilled
    from fedseq.common.protocol.messages import WeightsHeader

    away: list[bytes] = []
    freed: list[int] = []

    def spill(chunk):
        away.append(bytes(chunk))
        at = len(away) - 1
        return Spilled(lambda: away[at], len(chunk), lambda: freed.append(at))

    frames = {s: bytes([s]) * (2 * CHUNK_BYTES + 7) for s in range(3)}
    pool = FramePool(max_frame=3 * CHUNK_BYTES, per_sender=4 * CHUNK_BYTES, spill=spill,
                     budget=CHUNK_BYTES)
    done = {}
    for i in range(3):  # interleaved: chunk i of every sender, then the next
        for s, f in frames.items():
            head = WeightsHeader(run_id="r", block="b", version=1, chunk=i, chunks=3, size=len(f),
                                 sha256=hashlib.sha256(f).hexdigest())
            got = pool.add(f"dev{s}", 1, head, f[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
            assert pool.in_memory <= CHUNK_BYTES
            if got is not None:
                done[s] = bytes(got)
    assert done == frames and pool.in_memory == 0 and len(away) == 5  # 6 kept, 1 in memory
    assert sorted(freed) == [0, 1, 2, 3, 4]  # every spilled chunk gave its space back


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0], [2, 0, 1]])
def test_chunks_in_any_order_give_the_frame(order):
    # not FRAME: it repeats itself, so chunks in the wrong order would still look right
    frame = random.Random(0).getrandbits(8 * len(FRAME)).to_bytes(len(FRAME), "little")
    pool = FramePool(max_frame=len(frame), per_sender=len(frame))
    parts = _headers(frame)
    out = [pool.add("d1", (0, 1), *parts[i]) for i in order]
    assert out[:-1] == [None, None] and bytes(out[-1]) == frame
    assert isinstance(out[-1].obj, bytearray)  # writable: decode_tensors(copy=False) wraps it
