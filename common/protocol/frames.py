"""Tensor frames on the wire: a safetensors frame split into chunks under the broker packet limit.

A chunk message is: 4-byte big-endian header length, the JSON header, then the chunk's bytes.
The header carries the whole frame's size and sha256, checked on reassembly.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
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


@dataclass
class Reassembler:
    """Collects the chunks of one frame; `add` returns the frame once complete and verified."""

    size: int
    sha256: str
    chunks: int
    parts: dict[int, bytes] = field(default_factory=dict)

    def add(self, index: int, data: memoryview) -> bytes | None:
        self.parts[index] = bytes(data)
        if len(self.parts) < self.chunks:
            return None
        frame = b"".join(self.parts[i] for i in range(self.chunks))
        if len(frame) != self.size:
            raise ProtocolError(f"frame is {len(frame)} bytes, header says {self.size}")
        if hashlib.sha256(frame).hexdigest() != self.sha256:
            raise ProtocolError("frame sha256 mismatch: a chunk was corrupted or mixed up")
        return frame
