"""CPU milliseconds of client-level DP's clipping (`training.clip_update`, the step a device adds
under [privacy]) on one ConvNet-sized update (573,578 values), one torch thread; device-side code
only, so it runs on the device stack (bench/arm_cost.py runs it on the emulated aarch64 device).

    python bench/clip_probe.py
"""

import time

import torch

from fedseq.common.codecs import Codec
from fedseq.common.models import build_model, get_blocks
from fedseq.common.training import clip_update

torch.set_num_threads(1)
model = build_model("convnet", (1, 28, 28), 10)
g = torch.Generator().manual_seed(0)
deltas = {k: torch.randn(v.shape, generator=g) for k, v in get_blocks(model, model.spec.blocks).items()}
clip_update(deltas, 0.01, Codec())  # every update is above C: the scaling runs
t0 = time.process_time()
for _ in range(10):
    clip_update(deltas, 0.01, Codec())
ms = (time.process_time() - t0) / 10 * 1000
print(f"convnet {sum(v.numel() for v in deltas.values())} values: clip_update {ms:.2f} ms CPU")
