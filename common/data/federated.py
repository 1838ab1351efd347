"""The whole dataset as in-memory tensors plus each client's train/test indices."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedseq.common.config import DataConfig
from fedseq.common.data.datasets import dataset as registered_dataset
from fedseq.common.data.partition import (
    classes_partition,
    dirichlet_partition,
    iid_partition,
    shard_partition,
    train_test_split,
)
from fedseq.common.data.readers import RawDataset
from fedseq.common.errors import DatasetError
from fedseq.common.seeding import numpy_rng


@dataclass(frozen=True)
class ClientShard:
    """One logical client's share: indices into FederatedData.x / .y."""

    client: int
    train: torch.Tensor
    test: torch.Tensor
    #: data.placement = "device" on the coordinator: the (train, test) rows and the training
    #: rows per class its device announced, none of them held here (train, test: empty)
    announced: tuple[int, int] | None = None
    counts: torch.Tensor | None = None

    @property
    def num_train(self) -> int:
        """The client's training rows: as its device announced them (data on the devices), else as
        the partition gave them."""
        return self.announced[0] if self.announced is not None else len(self.train)

    @property
    def num_test(self) -> int:
        """The client's test rows: as its device announced them, else as the partition gave them."""
        return self.announced[1] if self.announced is not None else len(self.test)

    def train_class_counts(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        """Training rows per class: as announced (data on the devices), else counted from
        `labels`."""
        if self.counts is not None:
            return self.counts
        return torch.bincount(labels[self.train], minlength=num_classes)


@dataclass(frozen=True)
class FederatedData:
    """Every client's row indices and labels, and the images of the rows this process needs:
    uint8 as in the files (scaled to [-1, 1] per batch by `images`) or already float. A device
    holds its own clients' rows, the coordinator the test rows; `pos` maps a dataset row to its
    row in `x` (-1: not held), None when `x` holds every row."""

    x: torch.Tensor  # uint8 (M, C, H, W) as in the files, or float32
    y: torch.Tensor  # int64 (N,): every row's label
    num_classes: int
    clients: tuple[ClientShard, ...]
    pos: torch.Tensor | None = None  # int64 (N,)
    # data.normalize = "channel" or "stats": each channel's (mean, std) (each feature's, for
    # tabular rows), in [0, 1] pixel units or float rows' own; None: the [-1, 1] scaling of
    # pixels, float rows as they are
    channel_stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    #: data.validation's rows (data.placement = "device"): the global model's score; None: the
    #: union of the clients' test rows is
    validation: torch.Tensor | None = None
    #: data.placement = "device": the device holding each client, in client-id order (a site's
    #: clients are its devices', server/rounds/sites.py); None: clients are dealt to devices
    owners: tuple[str, ...] | None = None

    @functools.cached_property
    def _pixel_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        c, h, w = self.x.shape[1:]
        mean, std = self.channel_stats or ((0.5,) * c, (0.5,) * c)
        if len(mean) != c and not (c == h == 1 and len(mean) == w):
            raise DatasetError(f"data.mean has {len(mean)} values; the rows have {c} channels"
                               + (f" ({w} features)" if c == h == 1 else "") + ": give one each")
        shape = (1, 1, -1) if len(mean) != c else (-1, 1, 1)  # tabular rows: per feature
        return (torch.tensor(mean, dtype=torch.float32, device=self.x.device).view(shape),
                torch.tensor(std, dtype=torch.float32, device=self.x.device).view(shape))

    def pixel_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) per channel, shaped (C, 1, 1) (per feature of a tabular row: (1, 1, F)),
        on the images' device, that turn [0, 1] pixels or float rows into model inputs: 0.5 and
        0.5 for pixels' [-1, 1] scaling. Made once (`images` reads them for every batch)."""
        return self._pixel_stats

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image."""
        c, h, w = self.x.shape[1:]
        return int(c), int(h), int(w)

    def images(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 images of dataset `rows`, in [-1, 1]: the same values, bit for bit, as scaling
        the whole dataset once (the scaling is elementwise)."""
        if self.pos is not None:
            at = self.pos[rows]
            if len(at) and int(at.min()) < 0:
                raise DatasetError("a row this process does not hold was asked for: the dataset "
                                   "was loaded for other clients (a bug; please report it)")
            rows = at.to(self.x.device)
        x = self.x[rows]
        if x.is_floating_point():
            if self.channel_stats is None:
                return x
            mean, std = self.pixel_stats()
            return (x - mean).div_(std)
        if self.channel_stats is None:
            return x.float().div_(127.5).sub_(1.0)
        mean, std = self.pixel_stats()
        return x.float().div_(255.0).sub_(mean).div_(std)

    def all_test(self) -> torch.Tensor:
        """Every client's test rows, client after client."""
        return torch.cat([c.test for c in self.clients])


@functools.lru_cache(maxsize=2)
def _load_raw(root: str, dataset: str) -> RawDataset:
    return registered_dataset(dataset).load(Path(root), {})


def _read(cfg: DataConfig, rows: np.ndarray | None = None) -> RawDataset:
    """The configured dataset's rows (every row, or the images of `rows` alone), from its
    registered entry (common/data/datasets.py); a catalog dataset read whole is cached."""
    if rows is None and not cfg.options:
        return _load_raw(str(cfg.root), cfg.dataset)
    return registered_dataset(cfg.dataset).load(Path(cfg.root), dict(cfg.options), rows)


def _images_tensor(images: np.ndarray) -> torch.Tensor:
    """The images as a tensor with one stride layout whatever numpy left on a size-1 channel
    axis: that stride addresses nothing, but oneDNN picks its convolution kernel from it, and two
    copies of the same rows with different strides trained to different last bits."""
    x = torch.from_numpy(np.ascontiguousarray(images))
    n, c, h, w = x.shape
    return x.as_strided(x.shape, (c * h * w, 1, w, 1)) if c == 1 else x.contiguous()


def _checked(data: FederatedData) -> FederatedData:
    """`data`, its normalization's statistics checked against its rows' shape now (a mean of
    another length than the channels is one DatasetError line before any training)."""
    if data.channel_stats is not None:
        data.pixel_stats()
    return data


def client_indices(labels: np.ndarray, cfg: DataConfig, seed: int) -> list[np.ndarray]:
    """All clients' sample indices (train and test merged, as in PFLlib) for this config."""
    if cfg.partition == "dirichlet":
        return dirichlet_partition(labels, cfg.num_clients, cfg.alpha, cfg.min_samples, seed)
    if cfg.partition == "shards":
        return shard_partition(labels, cfg.num_clients, cfg.shards_per_client, seed)
    if cfg.partition == "classes":
        return classes_partition(labels, cfg.num_clients, cfg.classes_per_client, seed)
    return iid_partition(len(labels), cfg.num_clients, seed)


def placed_data(cfg: DataConfig, parts: dict[int, RawDataset], num_clients: int,
                validation: RawDataset | None = None, shape: tuple[int, int, int] | None = None,
                owners: tuple[str, ...] | None = None) -> FederatedData:
    """data.placement = "device": the rows of the clients in `parts` (client -> its train then
    test rows), each client's rows together, in client order, then the validation rows; every
    other client of the run's `num_clients` holds none here. `owners`: each client's device."""
    from fedseq.common.data.datasets import describe

    held = [parts[c] for c in sorted(parts)] + ([validation] if validation is not None else [])
    in_shape, num_classes = describe(cfg.dataset, cfg.options)
    images = [r.images for r in held if len(r.labels)]
    x = np.concatenate(images) if images else np.empty((0, *(shape or in_shape)), np.uint8)
    y = np.concatenate([r.labels for r in held]) if held else np.empty(0, np.int64)
    shards, at = [], 0
    empty = torch.empty(0, dtype=torch.int64)
    for c in range(num_clients):
        r = parts.get(c)
        if r is None:
            shards.append(ClientShard(c, empty, empty))
            continue
        n = len(r.labels)
        shards.append(ClientShard(c, torch.arange(at, at + r.num_train),
                                  torch.arange(at + r.num_train, at + n)))
        at += n
    rows = None if validation is None else torch.arange(at, at + len(validation.labels))
    stats = cfg.stats()
    return _checked(FederatedData(_images_tensor(x), torch.from_numpy(y.astype(np.int64)),
                                  num_classes, tuple(shards), channel_stats=stats, validation=rows,
                                  owners=owners))


def announced_data(cfg: DataConfig, clients: list, validation: RawDataset | None,
                   owners: tuple[str, ...] | None = None) -> FederatedData:
    """The coordinator's view of data.placement = "device": every client's announced sizes and
    class counts (`clients`: ClientData in client-id order, common/data/placed.py; `owners`:
    the device announcing each) and the validation rows, the only rows it holds."""
    from fedseq.common.data.placed import check_influence

    if owners is not None:  # (a fresh roster is within it: the devices beyond were left out)
        check_influence(cfg, clients, owners, "the run's roster")
    data = placed_data(cfg, {}, 0, validation)
    empty = torch.empty(0, dtype=torch.int64)
    shards = tuple(ClientShard(i, empty, empty, (c.train, c.test),
                               torch.tensor(c.counts, dtype=torch.int64))
                   for i, c in enumerate(clients))
    return FederatedData(data.x, data.y, data.num_classes, shards,
                         channel_stats=data.channel_stats, validation=data.validation,
                         owners=owners)


def load_federated(cfg: DataConfig, seed: int, only: list[int] | None = None,
                   test_images_only: bool = False) -> FederatedData:
    """Read the dataset files and split them over the clients; pure function of (cfg, seed).

    The partition always comes from every label. `only`: keep the images of these clients alone
    (a device); `test_images_only`: keep only the test rows' images (the coordinator, whose global
    evaluation reads nothing else). Rows not kept are never materialized: the files are read one
    at a time and only the wanted rows copied out."""
    if cfg.placement == "device":
        from fedseq.common.data.placed import simulated_data

        return simulated_data(cfg, only)
    lean = only is not None or test_images_only
    # lean: labels first (small); images after the partition says which rows are needed
    raw = _read(cfg, rows=np.empty(0, np.int64) if lean else None)
    labels, num_classes = raw.labels, raw.num_classes
    keep = None
    if cfg.fraction < 1.0:
        keep = np.sort(numpy_rng(seed, "subset").permutation(len(labels))[: int(len(labels) * cfg.fraction)])
        labels = labels[keep]
    splits = [train_test_split(idx, cfg.train_fraction, seed, cid)
              for cid, idx in enumerate(client_indices(labels, cfg, seed))]
    shards = tuple(ClientShard(c, torch.from_numpy(tr), torch.from_numpy(te))
                   for c, (tr, te) in enumerate(splits))
    y = torch.from_numpy(labels)
    stats = cfg.stats()
    if not lean:
        images = raw.images if keep is None else raw.images[keep]
        return _checked(FederatedData(_images_tensor(images), y, num_classes, shards,
                                      channel_stats=stats))
    wanted = [te for _, te in splits] if only is None else [
        r for c in sorted(set(only)) for r in splits[c]]
    rows = np.unique(np.concatenate(wanted)) if wanted else np.empty(0, np.int64)
    images = _read(cfg, rows=rows if keep is None else keep[rows]).images
    pos = torch.full((len(labels),), -1, dtype=torch.int64)
    pos[torch.from_numpy(rows)] = torch.arange(len(rows))
    return _checked(FederatedData(_images_tensor(images), y, num_classes, shards, pos, stats))


def training_stats(cfg: DataConfig, seed: int) -> tuple[list[float], list[float], int, str]:
    """data.normalize = "stats"' numbers from the run's training rows (every client's, as the run
    splits them; with data.placement = "device" the simulated devices' folders): each channel's
    mean and standard deviation, or each feature's for tabular rows (one channel, height 1), in
    the rows' own units (pixels in [0, 1]); a constant one's deviation is 1. Also the rows counted
    and what a value is per ("channel" or "feature")."""
    data = load_federated(cfg.model_copy(update={"normalize": "half", "mean": [], "std": []}),
                          seed)
    rows = torch.cat([c.train for c in data.clients])
    x = data.x[rows].double()
    if not data.x.is_floating_point():
        x = x / 255.0
    per = "feature" if x.shape[1] == x.shape[2] == 1 else "channel"
    dims = (0, 1, 2) if per == "feature" else (0, 2, 3)
    mean, std = x.mean(dim=dims), x.std(dim=dims, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return mean.tolist(), std.tolist(), len(rows), per
