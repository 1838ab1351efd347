"""Record-level DP-SGD (Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning
with Differential Privacy", CCS 2016) in a client's local training: every step clips each
example's gradient (all the step's trainable parameters as one vector) to an L2 norm C, sums
them, adds Gaussian noise of standard deviation z C and divides by the batch size. The
per-example gradients come from Opacus (`GradSampleModule`'s hooks on the model's layers); the
clipping and the noise are here, so they run in the project's own optimizer loop and the noise
comes from the client's seeded stream (simulation, `--workers` and a device train alike).

[privacy] level = "record" (docs/how-to/privacy.md): what it protects is each training example
of a client, against whoever sees what the client sends; the coordinator accounts each client's
epsilon (server/privacy/dp.py `record_epsilon`). It needs torch >= 2.0 and opacus: a device on the
floor (torch 1.12, JetPack 4 and 5) refuses the plan in one line (`unavailable`). Runs on the
device floor's Python (3.8): opacus is imported only where DP-SGD runs.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from fedseq.common.models import BlockModel


def unavailable() -> Optional[str]:
    """Why this machine cannot run DP-SGD (None: it can)."""
    major = int(torch.__version__.split(".")[0])
    if major < 2:
        return (f"record-level DP-SGD needs torch >= 2.0 and opacus; this device has torch "
                f"{torch.__version__}: run it where the stack allows (JetPack 6, the simulation) "
                "or use privacy.level = \"client\"")
    try:
        import opacus  # noqa: F401
    except ImportError:
        return ("record-level DP-SGD needs opacus on the machine that trains: pip install "
                "opacus (or fedseq[dp]), or use privacy.level = \"client\"")
    return None


def batch_norm_in(model: torch.nn.Module) -> Optional[str]:
    """The first batch-normalization layer of `model` (it mixes a batch's examples, so no
    example has a gradient of its own), or None."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            return name
    return None


class DpSgd:
    """DP-SGD's step for one client's training: `follow` before every step's forward pass
    (Opacus's hooks on the layers that train), `privatize` after its backward pass, `close` at
    the end."""

    def __init__(self, model: BlockModel, clip: float, noise: float, batch_size: int,
                 generator: torch.Generator):
        why = unavailable()
        if why is not None:
            raise RuntimeError(why)
        layer = batch_norm_in(model)
        if layer is not None:
            raise ValueError(f"record-level DP-SGD: layer {layer} is batch normalization, which "
                             "mixes a batch's examples; use a model without it")
        import warnings

        # the first layer's input needs no gradient: torch says its backward hook fires anyway
        warnings.filterwarnings("ignore", message="Full backward hook is firing")

        self.clip, self.noise, self.batch_size, self.generator = clip, noise, batch_size, generator
        self.model = model
        self.wrapped = None
        self._trainable: Optional[tuple] = None

    def follow(self) -> None:
        """Hook exactly the layers that train now, before a step's forward pass: Opacus hooks
        the layers with a trainable parameter when it wraps, and the hook of a frozen layer
        whose output needs a gradient (FedSeq's and FedBABU's head behind a trained base)
        would find no activations. Wraps again only where the trainable set changed."""
        now = tuple(p.requires_grad for p in self.model.parameters())
        if now == self._trainable:
            return
        from opacus import GradSampleModule

        if self.wrapped is not None:
            self.wrapped._close()
        self.wrapped = GradSampleModule(self.model, batch_first=True, loss_reduction="mean",
                                        strict=False)
        self._trainable = now

    @torch.no_grad()
    def privatize(self, params: List[torch.nn.Parameter]) -> None:
        """Replace every trained parameter's gradient by the clipped per-example gradients'
        sum plus N(0, (z C)^2), over the batch size."""
        trained = [p for p in params if p.requires_grad and p.grad is not None]
        missing = [p for p in trained if getattr(p, "grad_sample", None) is None]
        if missing:
            raise ValueError("record-level DP-SGD: a trained layer has no per-example gradient "
                             "(a layer opacus does not support); use privacy.level = \"client\"")
        samples = [p.grad_sample for p in trained]  # type: ignore[attr-defined]
        norms = torch.stack([g.reshape(g.shape[0], -1).norm(2, dim=1) for g in samples],
                            dim=1).norm(2, dim=1)
        factor = (self.clip / (norms + 1e-6)).clamp(max=1.0)
        for p, g in zip(trained, samples):
            summed = torch.einsum("i,i...->...", factor.to(g.dtype), g)
            noise = torch.randn(summed.shape, generator=self.generator, dtype=torch.float32)
            p.grad = (summed + noise.to(summed.device, summed.dtype) * (self.noise * self.clip)
                      ) / self.batch_size
            p.grad_sample = None  # type: ignore[attr-defined]

    def close(self) -> None:
        """Take Opacus's hooks off the model (it trains on without them)."""
        if self.wrapped is not None:
            self.wrapped._close()
            self.wrapped = None
