"""The global model's blocks on the wire: retained, versioned, chunked frames.

A block gets a new version when its content changes (sha256 of its frame); a device fetches a
block only when the step needs a newer version than it holds. An unchanged block is not even
encoded again: the publisher remembers the very tensors (and their in-place edit counters) it
last encoded.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import torch

from fedseq.common.models import Weights, block_of, in_blocks
from fedseq.common.protocol.frames import split_frame
from fedseq.common.protocol.link import Link
from fedseq.common.protocol.messages import WeightsHeader
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.common.protocol.topics import Topics


class BlockPublisher:
    """Publishes the blocks whose content changed and keeps the current frames for re-publishing
    after a reconnect."""

    def __init__(self, link: Link, topics: Topics, run_id: str):
        self.link = link
        self.topics = topics
        self.run_id = run_id
        self.published: dict[str, tuple[int, str]] = {}  # block -> (version, sha256)
        self._lock = threading.Lock()
        self._frames: dict[str, tuple[int, bytes, str]] = {}  # block -> version, frame, sha256
        self._encoded: dict[str, list[tuple[torch.Tensor, int]]] = {}

    def sync(self, weights: Weights, force: bool = False) -> dict[str, int]:
        """Publish the blocks whose content changed (all of them with force, same versions where
        unchanged); return {block: version} for all of them."""
        versions = {}
        for block in dict.fromkeys(block_of(k) for k in weights):
            tensors = in_blocks(weights, block)
            seen = [(v, v._version) for v in tensors.values()]
            old = self.published.get(block)
            last = self._encoded.get(block, [])
            if old is not None and not force and len(seen) == len(last) and all(
                    a is b and n == m for (a, n), (b, m) in zip(seen, last, strict=True)):
                versions[block] = old[0]  # the very tensors published last time, unmodified
                continue
            frame = encode_tensors(tensors)
            digest = hashlib.sha256(frame).hexdigest()
            self._encoded[block] = seen
            if old is None or old[1] != digest or force:
                version = 0 if old is None else old[0] + (old[1] != digest)
                with self._lock:
                    self._frames[block] = (version, frame, digest)
                self._publish(block, version, frame, digest)
                self.published[block] = (version, digest)
            versions[block] = self.published[block][0]
        return versions

    def republish(self) -> int:
        """Network thread, after a reconnect: the current version of every block; returns how
        many."""
        with self._lock:
            frames = dict(self._frames)
        for block, (version, frame, digest) in frames.items():
            self._publish(block, version, frame, digest)
        return len(frames)

    def _publish(self, block: str, version: int, frame: bytes, digest: str) -> None:
        self.link.publish_frame(
            lambda i: self.topics.weights(block, i),
            lambda **kw: WeightsHeader(run_id=self.run_id, block=block, version=version, **kw),
            frame, retain=True, digest=digest)

    def clear(self) -> None:
        """The run is over: remove every block's retained chunks from the broker (a daemon
        started later must not take a finished run's weights for its current ones)."""
        with self._lock:
            frames = dict(self._frames)
            self._frames.clear()
        for block, (_, frame, _) in frames.items():
            for i in range(len(split_frame(frame))):
                self.link.publish(self.topics.weights(block, i), b"", retain=True)

    def state(self) -> dict[str, Any]:
        """The published versions, for the checkpoint."""
        return {b: list(v) for b, v in self.published.items()}

    def restore(self, state: dict[str, Any], gap: int) -> None:
        """A resumed run: every block's version jumps `gap` past the checkpoint's. The crashed
        coordinator may have published a newer aggregate after its last checkpoint; a device
        holding that one would take the checkpoint's (re-published) block for stale and skip
        every step. With the jump, the checkpoint's blocks are the newest a device has seen."""
        self.published = {b: (int(v[0]) + gap, str(v[1])) for b, v in state.items()}
