"""Pickle-free tensor frames: safetensors bytes (header + raw little-endian data).

Used for everything that crosses the wire, and by the simulation to count the bytes a deployment
would move.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch
from safetensors.torch import save as st_save

from fedseq.common.errors import ProtocolError
from fedseq.common.models import Weights
from fedseq.common.text import printable


def encode_tensors(weights: Weights, metadata: dict[str, str] | None = None) -> bytes:
    """Serialize named tensors (made contiguous, CPU) to safetensors bytes."""
    return st_save(
        {k: v.detach().cpu().contiguous() for k, v in weights.items()}, metadata=metadata
    )


DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
# bytes per element (torch.dtype.itemsize exists only from torch 2.1; devices run 1.12)
ITEMSIZE = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in DTYPES.items()}


#: header bytes a frame may spend per tensor it may hold (a name and its dtype, shape, offsets)
HEADER_BYTES_PER_TENSOR = 512


def decode_tensors(
    buf: bytes | bytearray | memoryview, expected_sha256: str | None = None, copy: bool = True,
    check_finite: bool = True, max_tensors: int | None = None,
) -> Weights:
    """Parse a safetensors frame, reading straight from `buf`; checks the digest when given and
    rejects non-finite values. copy=False returns tensors that share `buf`'s memory (for a
    writable buffer nobody else reuses, e.g. a Reassembler's): no copy and no page faults.
    check_finite=False leaves the NaN/Inf check to a caller that validates values anyway (the
    coordinator's round contract), so it is not done twice on the hot path. `max_tensors`: a
    frame may hold at most that many tensors; its header's length is checked against it before
    the header is parsed and its count before any tensor is built (a frame of the run's size
    listing tens of thousands of empty tensors costs nothing then)."""
    view = memoryview(buf).cast("B")
    if expected_sha256 is not None and hashlib.sha256(view).hexdigest() != expected_sha256:
        raise ProtocolError("tensor frame sha256 mismatch: the payload was corrupted in transit")
    try:
        n = int.from_bytes(view[:8], "little")
        if len(view) < 8 or 8 + n > len(view):
            raise ValueError("header length exceeds the frame")
        if max_tensors is not None and n > (max_tensors + 1) * HEADER_BYTES_PER_TENSOR:
            raise ValueError(f"a header of {n} bytes, more than {max_tensors} tensors need")
        header = json.loads(bytes(view[8 : 8 + n]))
        if not isinstance(header, dict):
            raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
        if max_tensors is not None and len(header) - ("__metadata__" in header) > max_tensors:
            raise ValueError(f"{len(header)} tensors, more than the {max_tensors} an update holds")
        out = {}
        data = view[8 + n :]
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
            count = math.prod(shape)
            if not 0 <= begin <= end <= len(data) or end - begin != count * ITEMSIZE[info["dtype"]]:
                raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit its shape")
            raw = bytearray(data[begin:end]) if copy else data[begin:end]
            t = torch.frombuffer(raw, dtype=dtype) if count else torch.empty(0, dtype=dtype)
            out[name] = t.reshape(shape)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, RecursionError,
            OverflowError, UnicodeDecodeError) as exc:  # whatever a malformed header makes fail
        raise ProtocolError("tensor frame is not valid safetensors data "
                            f"({type(exc).__name__}: {printable(exc, 200)})") from exc
    for k, v in out.items() if check_finite else ():
        # one float64 sum is NaN or Inf exactly when an element is (float32 values cannot
        # overflow it): 0.3 ms for 2.3 MB, where isfinite().all() took 2 ms
        if v.is_floating_point() and v.numel() and not math.isfinite(float(v.sum(dtype=torch.float64))):
            raise ProtocolError(f"tensor {k!r} contains NaN or Inf")
    return out


# safetensors lays tensors out by dtype, in its Dtype enum's declaration order from the last
# (F64 before F32 ...), then by name; this is that order for the dtypes above
_LAYOUT_RANK = {name: i for i, name in enumerate(
    ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"))}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def frame_size(weights: Weights) -> int:
    """Bytes of the frame `encode_tensors(weights)` makes, computed from its header alone
    (names, dtypes, shapes) without encoding the data: 8 bytes of length, the JSON header as
    safetensors writes it (compact, tensors in its layout order, padded with spaces to a multiple
    of 8) and every tensor's raw bytes (tests/common/protocol: equal to the encoded length)."""
    named = sorted(((_NAMES[v.dtype], k, v) for k, v in weights.items()),
                   key=lambda t: (_LAYOUT_RANK[t[0]], t[1].encode()))
    entries, offset = [], 0
    for dtype, key, v in named:
        size = v.numel() * ITEMSIZE[dtype]
        info = {"dtype": dtype, "shape": list(v.shape), "data_offsets": [offset, offset + size]}
        entries.append(f"{json.dumps(key, ensure_ascii=False)}:"
                       f"{json.dumps(info, separators=(',', ':'))}")
        offset += size
    header = len(("{" + ",".join(entries) + "}").encode())
    return 8 + header + (-header) % 8 + offset
