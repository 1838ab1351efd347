"""Tensor frames on the wire: a safetensors frame split into chunks under the broker packet limit.

A chunk message is: 4-byte big-endian header length, the JSON header, then the chunk's bytes.
The header carries the whole frame's size and sha256, checked on reassembly.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TypeVar

from fedseq.common.errors import ProtocolError
from fedseq.common.protocol.messages import Message, UpdateHeader, WeightsHeader

CHUNK_BYTES = 1 << 20  # 1 MiB: below Mosquitto's 2,000,000-byte default and amqtt's limits

H = TypeVar("H", WeightsHeader, UpdateHeader)


def split_frame(frame: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    view = memoryview(frame)
    return [view[i : i + chunk_bytes] for i in range(0, max(1, len(frame)), chunk_bytes)]


def pack_chunk(header: Message, chunk: bytes | memoryview) -> bytes:
    head = header.encode()
    return b"".join((struct.pack(">I", len(head)), head, chunk))


def unpack_chunk(payload: bytes, header_type: type[H]) -> tuple[H, memoryview]:
    if len(payload) < 4:
        raise ProtocolError("chunk message shorter than its length prefix")
    (n,) = struct.unpack_from(">I", payload)
    if 4 + n > len(payload):
        raise ProtocolError(f"chunk header length {n} exceeds the message ({len(payload)} bytes)")
    header = header_type.decode(payload[4 : 4 + n])
    if header.chunk >= header.chunks:
        raise ProtocolError(f"chunk {header.chunk} of {header.chunks} is out of range")
    return header, memoryview(payload)[4 + n :]


class Reassembler:
    """Collects the chunks of one frame straight into one preallocated buffer (no per-chunk
    copies, no join); `add` returns the frame once complete and its sha256 verified."""

    def __init__(self, size: int, sha256: str, chunks: int, chunk_bytes: int = CHUNK_BYTES):
        if chunks != max(1, -(-size // chunk_bytes)):
            raise ProtocolError(f"{chunks} chunks cannot hold a {size}-byte frame")
        self.size = size
        self.sha256 = sha256
        self.chunks = chunks
        self.chunk_bytes = chunk_bytes
        self.buffer = bytearray(size)
        self.seen: set[int] = set()

    def add(self, index: int, data: memoryview | bytes) -> memoryview | None:
        start = index * self.chunk_bytes
        expected = min(self.chunk_bytes, self.size - start)
        if not 0 <= index < self.chunks or len(data) != expected:
            raise ProtocolError(f"chunk {index}: {len(data)} bytes, expected {expected}")
        self.buffer[start : start + expected] = data
        self.seen.add(index)
        if len(self.seen) < self.chunks:
            return None
        if hashlib.sha256(self.buffer).hexdigest() != self.sha256:
            raise ProtocolError("frame sha256 mismatch: a chunk was corrupted or mixed up")
        return memoryview(self.buffer)
