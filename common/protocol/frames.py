"""Tensor frames on the wire: a safetensors frame split into chunks under the broker packet limit.

A chunk message is: 4-byte big-endian header length, the JSON header, then the chunk's bytes.
The header carries the whole frame's size and sha256, checked on reassembly.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from fedseq.common.errors import ProtocolError
from fedseq.common.protocol.messages import (
    Message,
    SiteResultHeader,
    SiteTaskHeader,
    UpdateHeader,
    WeightsHeader,
)

CHUNK_BYTES = 1 << 20  # 1 MiB: below Mosquitto's 2,000,000-byte default and amqtt's limits
#: the largest JSON header a chunk may carry (an honest one is a few hundred bytes): a longer one
#: is refused before it is parsed
HEADER_BYTES = 8192
#: the largest chunk message: its length prefix, header and data
CHUNK_MESSAGE_BYTES = 4 + HEADER_BYTES + CHUNK_BYTES

H = TypeVar("H", WeightsHeader, UpdateHeader, SiteTaskHeader, SiteResultHeader)


def split_frame(frame: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    """A frame cut into chunks of at most `size` bytes."""
    view = memoryview(frame)
    return [view[i : i + chunk_bytes] for i in range(0, max(1, len(frame)), chunk_bytes)]


def pack_chunk(header: Message, chunk: bytes | memoryview) -> bytes:
    """[4-byte big-endian header length][JSON header][chunk bytes]."""
    head = header.encode()
    return b"".join((struct.pack(">I", len(head)), head, chunk))


def unpack_chunk(payload: bytes, header_type: type[H]) -> tuple[H, memoryview]:
    """(header, chunk bytes) of a packed chunk; ProtocolError when malformed."""
    if len(payload) < 4:
        raise ProtocolError("chunk message shorter than its length prefix")
    (n,) = struct.unpack_from(">I", payload)
    if n > HEADER_BYTES:
        raise ProtocolError(f"chunk header of {n} bytes, more than {HEADER_BYTES}")
    if 4 + n > len(payload):
        raise ProtocolError(f"chunk header length {n} exceeds the message ({len(payload)} bytes)")
    header = header_type.decode(payload[4 : 4 + n])
    if header.chunk >= header.chunks:
        raise ProtocolError(f"chunk {header.chunk} of {header.chunks} is out of range")
    return header, memoryview(payload)[4 + n :]


class Reassembler:
    """Collects the chunks of one frame: each is kept as it arrived (a view of its message) until
    the last one, then all are copied once into the frame's buffer; `add` returns the frame once
    complete and its sha256 verified. A frame partly arrived holds only what arrived: a
    coordinator receiving a burst of a hundred devices' 13 MB updates, interleaved chunk by
    chunk, holds their chunks, not a whole zero-filled buffer for each (bench/fleet.py). A chunk
    of the wrong length or index is refused; a repeated index (a QoS 1 re-delivery) is ignored."""

    def __init__(self, size: int, sha256: str, chunks: int, chunk_bytes: int = CHUNK_BYTES):
        if chunks != max(1, -(-size // chunk_bytes)):
            raise ProtocolError(f"{chunks} chunks cannot hold a {size}-byte frame")
        self.size = size
        self.sha256 = sha256
        self.chunks = chunks
        self.chunk_bytes = chunk_bytes
        self.parts: dict[int, memoryview | bytes | Spilled] = {}
        self.complete = False  # every chunk arrived (the frame was then checked)
        self.in_memory = 0  # bytes of the parts held in memory (not Spilled)

    def add(self, index: int, data: memoryview | bytes,
            keep: Callable[[memoryview | bytes], memoryview | bytes | Spilled] | None = None
            ) -> memoryview | None:
        """`keep`: what to hold of a chunk that is not the last (the chunk, or a Spilled)."""
        start = index * self.chunk_bytes
        expected = min(self.chunk_bytes, self.size - start)
        if not 0 <= index < self.chunks or len(data) != expected:
            raise ProtocolError(f"chunk {index}: {len(data)} bytes, expected {expected}")
        if index in self.parts:
            return None
        if len(self.parts) + 1 < self.chunks:
            kept = keep(data) if keep is not None else data
            self.parts[index] = kept
            if not isinstance(kept, Spilled):
                self.in_memory += len(kept)
            return None
        self.parts[index] = data
        self.complete = True
        # joined in index order (every index is there, each of its exact length): one copy,
        # without first zero-filling a buffer of the frame's size
        buffer = bytearray().join(
            p.load() if isinstance(p, Spilled) else p for _, p in sorted(self.parts.items()))
        self.discard()
        if hashlib.sha256(buffer).hexdigest() != self.sha256:
            raise ProtocolError("frame sha256 mismatch: a chunk was corrupted or mixed up")
        return memoryview(buffer)

    def discard(self) -> None:
        """Let go of every part held (spilled ones give their space back)."""
        for p in self.parts.values():
            if isinstance(p, Spilled):
                p.free()
        self.parts.clear()


@dataclass(frozen=True)
class Spilled:
    """A chunk kept outside memory until its frame is complete: `load()` gives its bytes back,
    `free()` the space it takes once it is no longer needed (joined or dropped)."""

    load: Callable[[], bytes | bytearray]
    size: int
    free: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return self.size


@dataclass
class _Partial:
    asm: Reassembler
    sender: str
    tag: Hashable
    born: float


class FramePool:
    """Frames being reassembled, from many senders, with bounded memory.

    Chunks are keyed by (sender, tag, size, sha256): chunks of different senders, attempts or
    digests never share a buffer, so a forged or truncated chunk fails only its own frame. A frame
    larger than `max_frame` (what the topic can legitimately carry) is refused before any
    allocation; one sender holds at most `per_sender` bytes of partial frames; partial frames
    expire after `ttl` seconds or when `expire(keep)` says their step is over. The bound on memory
    is therefore `per_sender` times the number of senders that can publish on the topic; with
    `spill` (a coordinator receiving hundreds of devices' frames at once, interleaved), chunks
    beyond `budget` bytes in memory go to `spill(chunk)`, which returns how to load them back
    and free their space; a dropped frame frees what it spilled.
    """

    def __init__(self, max_frame: int, per_sender: int, ttl: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 spill: Callable[[memoryview | bytes], Spilled] | None = None,
                 budget: int = 0):
        self.max_frame = max_frame
        self.per_sender = per_sender
        self.ttl = ttl
        self.clock = clock
        self.spill = spill
        self.budget = budget
        self.in_memory = 0  # bytes of partial frames' chunks held in memory
        self.partial: dict[tuple[str, Hashable, int, str], _Partial] = {}

    def _keep(self, chunk: memoryview | bytes) -> memoryview | bytes | Spilled:
        if self.spill is not None and self.in_memory + len(chunk) > self.budget:
            return self.spill(chunk)
        self.in_memory += len(chunk)
        return chunk

    def _drop(self, key: tuple[str, Hashable, int, str]) -> None:
        asm = self.partial.pop(key).asm
        self.in_memory -= asm.in_memory
        asm.discard()

    def held_bytes(self, sender: str | None = None) -> int:
        """Bytes of incomplete frames held, of one sender or (None) of all."""
        return sum(p.asm.size for p in self.partial.values() if sender in (None, p.sender))

    def add(self, sender: str, tag: Hashable,
            header: WeightsHeader | UpdateHeader | SiteTaskHeader | SiteResultHeader,
            data: memoryview | bytes) -> memoryview | None:
        """Add one chunk; the whole frame once complete and verified, else None. Raises
        ProtocolError for a chunk that cannot belong to a legitimate frame (its frame is dropped
        only if the chunk proved the frame itself corrupt)."""
        if header.size > self.max_frame:
            raise ProtocolError(f"frame of {header.size} bytes exceeds the {self.max_frame} bytes "
                                "this topic can carry")
        self._expire_old()
        key = (sender, tag, header.size, header.sha256)
        part = self.partial.get(key)
        if part is None:
            expected = min(CHUNK_BYTES, header.size - header.chunk * CHUNK_BYTES)
            if len(data) != expected:  # checked before anything is allocated for the frame
                raise ProtocolError(f"chunk {header.chunk}: {len(data)} bytes, expected {expected}")
            if header.chunks == 1:  # the common small frame: no buffer kept between chunks
                return Reassembler(header.size, header.sha256, 1).add(header.chunk, data)
            if self.held_bytes(sender) + header.size > self.per_sender:
                raise ProtocolError(f"{sender} already holds {self.held_bytes(sender)} bytes of "
                                    f"partial frames (limit {self.per_sender}); chunk dropped")
            part = _Partial(Reassembler(header.size, header.sha256, header.chunks), sender, tag,
                            self.clock())
            self.partial[key] = part
        try:
            frame = part.asm.add(header.chunk, data, self._keep)
        except ProtocolError:
            if part.asm.complete:  # complete but corrupt: give it up
                self._drop(key)
            raise
        if frame is not None:
            self._drop(key)
        return frame

    def expire(self, keep: Callable[[str, Hashable], bool]) -> None:
        """Drop the partial frames whose (sender, tag) is no longer wanted (their step ended)."""
        for key, p in list(self.partial.items()):
            if not keep(p.sender, p.tag):
                self._drop(key)

    def _expire_old(self) -> None:
        now = self.clock()
        for key, p in list(self.partial.items()):
            if now - p.born > self.ttl:
                self._drop(key)
