"""Training augmentation of a batch (train.augment), in plain torch: no torchvision, so it runs on
the device floor (Python 3.8, torch 1.12) and gives a device the simulation's bits.

The batch arrives as model inputs (the dataset's normalization applied: `FederatedData.images`);
each operation works in the pixel units torchvision's transforms see, through the dataset's
per-channel (mean, std), so "black" padding is a black pixel whatever the normalization:

- crop: pad by `padding` pixels of black on every side, then cut a random window of the image's
  size (torchvision's RandomCrop(size, padding) with its default zero fill);
- flip: mirror left to right with probability 1/2 (RandomHorizontalFlip);
- jitter: brightness, contrast and (colour images only) saturation, each scaled by a factor
  drawn from [0.8, 1.2], in that order, pixels clipped to [0, 1] after each (ColorJitter(0.2,
  0.2, 0.2) with a fixed order).

Every draw comes from the generator given, in the order above, so a client's batches are the
same on any machine; an operation not asked for draws nothing.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

OPERATIONS = ("crop", "flip", "jitter")
JITTER = 0.2


def augment_batch(x: torch.Tensor, operations: Sequence[str], padding: int,
                  stats: Tuple[torch.Tensor, torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """A new batch: `operations` (of OPERATIONS, applied in that order) on each image of `x`
    (N, C, H, W model inputs); `stats`: the dataset's (mean, std) per channel, (C, 1, 1)."""
    mean, std = (s.to(x.device) for s in stats)
    n, c, h, w = x.shape
    if "crop" in operations:
        black = (-mean / std).view(1, c, 1, 1)
        padded = black.expand(n, c, h + 2 * padding, w + 2 * padding).clone()
        padded[:, :, padding:padding + h, padding:padding + w] = x
        at = torch.randint(0, 2 * padding + 1, (n, 2), generator=gen).to(x.device)
        rows = (at[:, 0:1] + torch.arange(h, device=x.device)).view(n, 1, h, 1)
        cols = (at[:, 1:2] + torch.arange(w, device=x.device)).view(n, 1, 1, w)
        image = torch.arange(n, device=x.device).view(n, 1, 1, 1)
        channel = torch.arange(c, device=x.device).view(1, c, 1, 1)
        x = padded[image, channel, rows, cols]
    if "flip" in operations:
        flip = (torch.rand(n, generator=gen) < 0.5).to(x.device)
        x = torch.where(flip.view(n, 1, 1, 1), x.flip(-1), x)
    if "jitter" in operations:
        f = (1 - JITTER + 2 * JITTER * torch.rand(n, 3, generator=gen)).to(x.device)
        p = x * std + mean  # pixels in [0, 1]
        p = (p * f[:, 0].view(n, 1, 1, 1)).clamp_(0, 1)
        gray = _gray(p)
        m = gray.mean(dim=(1, 2, 3), keepdim=True)
        p = ((p - m) * f[:, 1].view(n, 1, 1, 1) + m).clamp_(0, 1)
        if c == 3:
            g = _gray(p)
            p = ((p - g) * f[:, 2].view(n, 1, 1, 1) + g).clamp_(0, 1)
        x = (p - mean) / std
    return x


def _gray(p: torch.Tensor) -> torch.Tensor:
    """Luma (ITU-R 601, as torchvision's rgb_to_grayscale), (N, 1, H, W); a gray image itself."""
    if p.shape[1] != 3:
        return p
    return (0.299 * p[:, 0:1] + 0.587 * p[:, 1:2] + 0.114 * p[:, 2:3])
