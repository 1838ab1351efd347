"""Every random stream is derived from (run seed, purpose, round, client), never a shared sequence.

That makes a client's batches independent of which process trains it or in which order, which is
what lets a deployment reproduce a simulation exactly.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

PURPOSES = ("partition", "init", "select", "batches", "rebalance", "finetune", "split",
            "batches-augment", "finetune-augment", "personal", "personal-augment")


def derive_seed(seed: int, purpose: str, *keys: int) -> int:
    """A 63-bit seed for one stream; stable across processes, platforms and Python versions."""
    tag = zlib.crc32(purpose.encode())
    ss = np.random.SeedSequence(entropy=[seed & 0xFFFFFFFF, seed >> 32, tag, *keys])
    return int(ss.generate_state(2, dtype=np.uint32).view(np.uint64)[0]) >> 1


def numpy_rng(seed: int, purpose: str, *keys: int) -> np.random.Generator:
    """A numpy generator of its own for (seed, purpose, keys...): the same arguments give the
    same stream on every machine and in every process; a new purpose never shifts another's."""
    return np.random.default_rng(derive_seed(seed, purpose, *keys))


def torch_rng(seed: int, purpose: str, *keys: int) -> torch.Generator:
    """A CPU torch generator of its own for (seed, purpose, keys...), e.g. (training seed,
    "batches", round, client): what a client draws does not depend on who runs it or on what
    was drawn before."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, purpose, *keys))
    return g
