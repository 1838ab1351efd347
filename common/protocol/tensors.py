"""Pickle-free tensor frames: safetensors bytes (header + raw little-endian data).

Used for everything that crosses the wire, and by the simulation to count the bytes a deployment
would move.
"""

from __future__ import annotations

import hashlib

import torch
from fedseq.common.errors import ProtocolError
from fedseq.common.models import Weights
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def encode_tensors(weights: Weights, metadata: dict[str, str] | None = None) -> bytes:
    """Serialize named tensors (made contiguous, CPU) to safetensors bytes."""
    return st_save(
        {k: v.detach().cpu().contiguous() for k, v in weights.items()}, metadata=metadata
    )


def decode_tensors(buf: bytes, expected_sha256: str | None = None) -> Weights:
    """Parse safetensors bytes; checks the digest when given, rejects non-finite values."""
    if expected_sha256 is not None and hashlib.sha256(buf).hexdigest() != expected_sha256:
        raise ProtocolError("tensor frame sha256 mismatch: the payload was corrupted in transit")
    try:
        out = st_load(bytes(buf))
    except (SafetensorError, ValueError) as exc:
        raise ProtocolError(f"tensor frame is not valid safetensors data ({exc})") from exc
    for k, v in out.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ProtocolError(f"tensor {k!r} contains NaN or Inf")
    return out


def frame_size(weights: Weights) -> int:
    """Bytes of the encoded frame for these tensors."""
    return len(encode_tensors(weights))
