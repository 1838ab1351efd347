"""Wire codecs: what a client's update (`wire.up`) and the global blocks (`wire.down`) become on
the wire, and back. One module for every transport: the simulation, `--workers` and a device
encode and decode with these functions, so a run is bitwise the same whichever carries it.

    none   float32 as today (the default; nothing is touched)
    fp16   half precision: 2 bytes an element           (up and down)
    bf16   bfloat16: 2 bytes, float32's range            (up and down)
    int8   1 byte an element and a float32 scale per output channel (dim 0) or per tensor:
           q = round(x / s) in [-127, 127], s = max|x| / 127; round to nearest (half to even), or
           stochastically from the run's seeded streams (up only)
    topk   the fraction `wire.topk` of each tensor's entries with the largest |x| (ties: the
           lower index), as int32 indices and float32 values, with error feedback: what is not
           sent is kept by the client (its personal state, `conv1~ef.weight`) and added to its
           next update of that tensor (up only)

Only floating-point parameters are coded; running statistics (BatchNorm) and integer tensors
travel as they are. A coded tensor `k` travels as `k` (fp16, bf16, int8 values), `k@scale`
(int8), or `k@idx` and `k@val` (topk). `decode` reads that form back to float32 (the model's
dtype) and needs the tensors' shapes only for topk. Runs on the device floor (Python 3.8,
torch 1.12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from fedseq.common.models import Weights, is_statistic

UP = ("none", "fp16", "bf16", "int8", "topk")
DOWN = ("none", "fp16", "bf16", "int8")
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
SCALE, IDX, VAL = "@scale", "@idx", "@val"
Q = 127  # int8 codes are in [-Q, Q]: symmetric, so 0 is exact
TINY = torch.finfo(torch.float32).tiny  # a smaller scale would be flushed to zero


#: Codec.norm_rounding of the codecs that keep a clipped norm within a known factor
NORM_ROUNDING = {"none": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


@dataclass(frozen=True)
class Codec:
    """One direction's codec and its settings; `spec` is its plain-text form (in a plan)."""

    name: str = "none"
    topk: float = 0.01  # topk: the fraction of each tensor's entries sent
    per_channel: bool = True  # int8: a scale per output channel, else one per tensor
    stochastic: bool = False  # int8: stochastic rounding (seeded), else to nearest

    @property
    def spec(self) -> str:
        """The codec as one string, as a plan carries it (`ClientPlan.codec`) and `parse` reads
        it back: "none", "fp16", "int8:channel", "int8:tensor:stochastic", "topk:0.01"."""
        if self.name == "topk":
            return f"topk:{self.topk!r}"
        if self.name == "int8":
            return ("int8:" + ("channel" if self.per_channel else "tensor")
                    + (":stochastic" if self.stochastic else ""))
        return self.name

    @property
    def norm_rounding(self) -> float | None:
        """The largest relative change of an update's L2 norm by this codec (half the unit in
        the last place of its mantissa: none, fp16, bf16), or None where the decoded norm is not
        bounded by the coded one (int8's scales, top-k's error-feedback residual)."""
        return NORM_ROUNDING.get(self.name)

    @classmethod
    def parse(cls, spec: str) -> Codec:
        """The inverse of `spec`; a ValueError names what is wrong."""
        name, *args = spec.split(":")
        if name not in UP:
            raise ValueError(f"unknown wire codec {spec!r}; one of {', '.join(UP)}")
        if name == "topk":
            fraction = float(args[0]) if args else 0.01
            if not 0 < fraction <= 1:
                raise ValueError(f"topk fraction {fraction} is not in (0, 1]")
            return cls(name, topk=fraction)
        if name == "int8":
            return cls(name, per_channel="tensor" not in args, stochastic="stochastic" in args)
        return cls(name)

    def kept(self, numel: int) -> int:
        """topk: how many of `numel` entries are sent (at least one)."""
        return min(numel, max(1, math.ceil(self.topk * numel)))


def coded(key: str, t: torch.Tensor) -> bool:
    """Whether a codec touches tensor `key`: floating-point parameters, not statistics."""
    return t.is_floating_point() and not is_statistic(key) and t.numel() > 0


def encode(weights: Weights, codec: Codec, residual: Optional[Weights] = None,
           generator: Optional[torch.Generator] = None) -> Tuple[Weights, Weights]:
    """(the wire form of `weights`, the new error-feedback residual of the tensors coded: topk
    only, else empty). `residual`: topk's residual from the last update, by tensor name;
    `generator`: int8's stochastic rounding."""
    if codec.name == "none":
        return weights, {}
    out: Weights = {}
    left: Weights = {}
    for k, t in weights.items():
        if not coded(k, t):
            out[k] = t
        elif codec.name in HALF:
            out[k] = t.to(HALF[codec.name])
        elif codec.name == "int8":
            out[k], out[k + SCALE] = _int8(t, codec, generator)
        else:
            acc = t.float() + residual[k] if residual is not None and k in residual else t.float()
            flat = acc.reshape(-1)
            order = torch.sort(flat.abs(), descending=True, stable=True).indices
            idx = order[: codec.kept(flat.numel())].sort().values
            out[k + IDX], out[k + VAL] = idx.to(torch.int32), flat[idx].clone()
            rest = flat.clone()
            rest[idx] = 0.0
            left[k] = rest.reshape(t.shape)
    return out, left


def _int8(t: torch.Tensor, codec: Codec, g: Optional[torch.Generator]
          ) -> Tuple[torch.Tensor, torch.Tensor]:
    x = t.float()
    rows = x.reshape(x.shape[0], -1) if codec.per_channel and x.dim() >= 2 else x.reshape(1, -1)
    top = rows.abs().amax(dim=1)
    # a channel of zeros (or of values below what a float32 scale resolves) gets the smallest
    # normal scale: its codes are 0 (or saturate at a value that small)
    scale = torch.where(top / Q >= TINY, top / Q, torch.full_like(top, TINY))
    y = rows / scale[:, None]
    y = torch.floor(y + torch.rand(y.shape, generator=g)) if codec.stochastic else torch.round(y)
    q = y.clamp(-Q, Q).to(torch.int8).reshape(t.shape)
    return q, scale


def decode(wire: Weights, shapes: Optional[Dict[str, torch.Size]] = None,
           sparse: bool = False) -> Weights:
    """float32 tensors from their wire form (anything not coded as it is). `shapes`: topk's
    tensors' shapes by name (the round's reference). `sparse`: a topk tensor stays sparse (a
    coalesced torch COO tensor of its entries sent), for the coordinator's fold, which then adds
    only those entries; its dense form is bitwise what `sparse=False` gives."""
    if not any(t.dtype in (torch.float16, torch.bfloat16, torch.int8) or k.endswith(IDX)
               for k, t in wire.items()):
        return wire  # nothing coded (wire.* = none): the very tensors
    out: Weights = {}
    for k, t in wire.items():
        if k.endswith((SCALE, VAL)):
            continue
        if k.endswith(IDX):
            name = k[: -len(IDX)]
            if shapes is None or name not in shapes:
                raise ValueError(f"{name}: a top-k tensor needs its shape")
            shape = shapes[name]
            if sparse and len(shape):
                out[name] = _sparse(t.to(torch.int64), wire[name + VAL].float(), torch.Size(shape))
                continue
            flat = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
            flat[t.to(torch.int64)] = wire[name + VAL].float()
            out[name] = flat.reshape(shape)
        elif t.dtype == torch.int8 and k + SCALE in wire:
            scale = wire[k + SCALE].float()
            rows = t.float().reshape(scale.numel(), -1) * scale[:, None]
            out[k] = rows.reshape(t.shape)
        elif t.dtype in (torch.float16, torch.bfloat16):
            out[k] = t.float()
        else:
            out[k] = t
    return out


def _sparse(flat: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A coalesced COO tensor of `shape` (at least one dimension) holding `values` at the flat,
    row-major positions `flat` (distinct: coalescing keeps every value as it is)."""
    coords = []
    rest = flat
    for size in reversed(shape):
        coords.append(rest % size)
        rest = torch.div(rest, size, rounding_mode="floor")
    # the positions were checked (codecs.wire_problem); torch checks them again where it can
    checks: Dict[str, Any] = ({"check_invariants": True}
                              if hasattr(torch.sparse, "check_sparse_tensor_invariants") else {})
    return torch.sparse_coo_tensor(torch.stack(coords[::-1]), values, shape, **checks).coalesce()


def expected(reference: Weights, codec: Codec) -> Dict[str, Tuple[torch.dtype, torch.Size]]:
    """The wire form's tensors that an update of `reference`'s tensors must have: name ->
    (dtype, shape)."""
    out: Dict[str, Tuple[torch.dtype, torch.Size]] = {}
    for k, ref in reference.items():
        if codec.name == "none" or not coded(k, ref):
            out[k] = (ref.dtype, ref.shape)
        elif codec.name in HALF:
            out[k] = (HALF[codec.name], ref.shape)
        elif codec.name == "int8":
            channels = ref.shape[0] if codec.per_channel and ref.dim() >= 2 else 1
            out[k] = (torch.int8, ref.shape)
            out[k + SCALE] = (torch.float32, torch.Size([channels]))
        else:
            n = codec.kept(ref.numel())
            out[k + IDX] = (torch.int32, torch.Size([n]))
            out[k + VAL] = (torch.float32, torch.Size([n]))
    return out


def wire_problem(wire: Weights, reference: Weights, codec: Codec,
                 bound: Callable[[str], float]) -> Optional[str]:
    """Why a wire form of `reference`'s tensors cannot be decoded safely, or None: an int8
    scale not finite, not positive, or above the tensor's bound / 127 (`bound(name)`: no element
    could then exceed it); top-k indices outside the tensor or not strictly increasing (each entry once).
    Names, dtypes and shapes are checked before (`expected`)."""
    for k, ref in reference.items():
        if codec.name == "int8" and k + SCALE in wire:
            s = wire[k + SCALE]
            low, high = (float(v) for v in torch.aminmax(s))
            if not (math.isfinite(low) and math.isfinite(high)) or low <= 0:
                return f"tensor {k}'s int8 scale is not a positive finite number"
            if high > max(bound(k) / Q, TINY):
                return (f"tensor {k}'s int8 scale {high:.3g} lets an element exceed the round's "
                        f"bound {bound(k):.3g}")
        if codec.name == "topk" and k + IDX in wire:
            idx = wire[k + IDX].to(torch.int64)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= ref.numel()):
                return f"tensor {k}'s top-k indices leave its {ref.numel()} entries"
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                return f"tensor {k}'s top-k indices are not strictly increasing"
    return None
