"""Data on the devices (data.placement = "device"): each device reads only its own folder, says
what its clients hold, and nobody derives a global partition.

A device's data folder (`fedseq-client --data-dir`) holds one client, `train` and `test` parts
directly in it, or several, one sub-folder each (`<client>/train`, `<client>/test`). A part is
what the run's dataset reads from one path (`Dataset.load_part`): a folder of class folders
(imagefolder), `train.npz` or `train.csv`, or whatever a plugin dataset reads there. The test part
may be missing (the client then has no local score). `fedseq-sim --devices-data DIR` simulates
the fleet: `DIR/<device>/` holds what that device's data folder would.

Client ids follow the devices' names, then each device's folder names (`roster`), so that the
same folders give the same run. What a device announces of a client is a `ClientData`: its
folder's name, its training and test rows (each at most data.max_rows_per_client, the first
ones in the reader's order) and its training rows per class (FedReG's rebalancing, the FLOP
count and the round contract read them on the coordinator).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from fedseq.common.config import DataConfig
from fedseq.common.data.datasets import dataset as registered_dataset
from fedseq.common.data.readers import RawDataset
from fedseq.common.errors import DatasetError
from fedseq.common.protocol.topics import DEVICE_NAME

#: the folder name announced for a data folder that is itself one client
SINGLE = "."
PARTS = ("train", "test")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientData:
    """One client of a device, as the device announces it (and the coordinator checks it)."""

    folder: str
    train: int
    test: int
    counts: Tuple[int, ...]  # training rows per class

    def to_dict(self) -> dict:
        """The entry as JSON holds it (the device's announcement)."""
        return {"folder": self.folder, "train": self.train, "test": self.test,
                "counts": list(self.counts)}

    @classmethod
    def of(cls, sizes) -> ClientData:
        """One client as a message holds it (protocol.ClientSizes or RosterClient)."""
        return cls(sizes.folder, sizes.train, sizes.test, tuple(sizes.counts))

    @classmethod
    def from_dict(cls, d: dict) -> ClientData:
        """An entry from `to_dict`'s JSON."""
        return cls(str(d["folder"]), int(d["train"]), int(d["test"]),
                   tuple(int(v) for v in d["counts"]))


def _part(folder: Path, name: str) -> Optional[Path]:
    """The entry of `folder` that is its part `name` (`train`, `train.npz`, `train.csv`...)."""
    found = [p for p in folder.iterdir() if p.name.split(".", 1)[0] == name]
    if len(found) > 1:
        raise DatasetError(f"{folder}: {len(found)} entries are its {name} part "
                           f"({', '.join(sorted(p.name for p in found))}); keep one")
    return found[0] if found else None


def client_parts(folder: Path) -> List[Tuple[str, Path]]:
    """A client folder's parts, (train, its path) first, then (test, its path) where it has
    one; each inside the folder, symbolic links resolved (a link out of the data folder is
    refused: a device reads only what its data folder holds)."""
    inside = folder.resolve()
    out: List[Tuple[str, Path]] = []
    for name in PARTS:
        where = _part(folder, name)
        if where is None:
            if name == "train":
                raise DatasetError(f"{folder}: no train part (train/, train.npz, train.csv)")
            continue
        for path in [where, *(where.rglob("*") if where.is_dir() else ())]:
            if inside not in path.resolve().parents:
                raise DatasetError(f"{path}: a link out of its data folder ({path.resolve()}); "
                                   "copy the file into the folder instead")
        out.append((name, where))
    return out


def client_folders(root: Path) -> List[Tuple[str, Path]]:
    """(name, folder) of every client in a device's data folder, by name: the folder itself
    (named ".") where it holds a train part, else each sub-folder that holds one."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetError(f"{root}: no such data folder (fedseq-client --data-dir; fedseq-server "
                           "start --local-devices N gives its devices data.devices_root/local01 "
                           "to localNN). It holds a train part (train/, train.npz or train.csv) "
                           "and a test part, or one <client>/ folder with them per client")
    if _part(root, "train") is not None:
        return [(SINGLE, root)]
    out = [(p.name, p) for p in sorted(root.iterdir())
           if p.is_dir() and not p.name.startswith(".") and _part(p, "train") is not None]
    inside = root.resolve()
    for _, p in out:
        if inside not in p.resolve().parents:
            raise DatasetError(f"{p}: a link out of the data folder ({p.resolve()}); move the "
                               "client's folder into it instead")
    if not out:
        raise DatasetError(f"{root}: no train part in it nor in any sub-folder (give a train "
                           "and a test part for one client, train/ and test/, train.npz and "
                           "test.npz or train.csv and test.csv, or <client>/ folders with them)")
    for name, _ in out:
        if not DEVICE_NAME.fullmatch(name):
            raise DatasetError(f"{root / name}: a client folder's name is letters, digits, _ and "
                               "- (at most 64); rename it")
    return out


def device_folders(root: Path) -> Dict[str, Path]:
    """`fedseq-sim --devices-data DIR`: device name -> its data folder, one sub-folder each."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetError(f"--devices-data {root}: no such folder (one sub-folder per device, "
                           "each as that device's fedseq-client --data-dir)")
    out = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    bad = [n for n in out if not DEVICE_NAME.fullmatch(n)]
    if bad:
        raise DatasetError(f"--devices-data {root}: {bad[0][:64]!r} is not a device name (letters, "
                           "digits, _ and -, at most 64)")
    if not out:
        raise DatasetError(f"--devices-data {root}: no device folder in it")
    return out


def _capped(raw: RawDataset, cap: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    if cap is None:
        return raw.images, raw.labels
    return raw.images[:cap], raw.labels[:cap]


def read_client(cfg: DataConfig, folder: Path) -> RawDataset:
    """One client's rows: its train part, then its test part, each capped at
    data.max_rows_per_client."""
    ds = registered_dataset(cfg.dataset)
    parts: List[Tuple[np.ndarray, np.ndarray]] = []
    for name, where in client_parts(folder):
        try:
            raw = ds.load_part(where, dict(cfg.options))
        except DatasetError:
            raise
        except Exception as exc:  # a plugin's reader, or a library under it: this file's fault
            raise DatasetError(f"{where}: the {cfg.dataset} dataset could not read it "
                               f"({type(exc).__name__}: {str(exc)[:200]})") from None
        parts.append(_capped(raw, cfg.max_rows_per_client))
        if name == "train" and not len(parts[0][1]):
            raise DatasetError(f"{where}: its training part holds no rows")
    num_classes = describe_classes(cfg)
    images = np.concatenate([x for x, _ in parts])
    labels = np.concatenate([y for _, y in parts]).astype(np.int64)
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise DatasetError(f"{folder}: labels outside 0..{num_classes - 1}")
    return RawDataset(images, labels, num_classes, len(parts[0][1]))


def read_validation(cfg: DataConfig) -> Optional[RawDataset]:
    """data.validation's rows (a part under the coordinator's data root), or None."""
    if cfg.validation is None:
        return None
    where = Path(cfg.validation).expanduser()
    where = where if where.is_absolute() else Path(cfg.root) / where
    if not where.exists():
        raise DatasetError(f"data.validation {where}: no such file or folder (under data.root "
                           "unless absolute; the same layout as a client's test part)")
    raw = registered_dataset(cfg.dataset).load_part(where, dict(cfg.options))
    return RawDataset(raw.images, raw.labels.astype(np.int64), describe_classes(cfg), 0)


def describe_classes(cfg: DataConfig) -> int:
    """The number of classes of the data config's dataset, from its description alone (no rows
    read)."""
    from fedseq.common.data.datasets import describe

    return describe(cfg.dataset, cfg.options)[1]


def announce(raw: RawDataset, folder: str) -> ClientData:
    """What a device says of a client whose rows are `raw`."""
    counts = np.bincount(raw.labels[: raw.num_train], minlength=raw.num_classes)
    return ClientData(folder, raw.num_train, len(raw.labels) - raw.num_train,
                      tuple(int(v) for v in counts))


def roster(devices: Dict[str, Sequence[ClientData]]) -> List[Tuple[str, ClientData]]:
    """(device, client) in client-id order: devices by name, then their folders by name."""
    return [(d, c) for d in sorted(devices) for c in sorted(devices[d], key=lambda c: c.folder)]


def influence_refusals(cfg: DataConfig, devices: Mapping[str, Sequence[ClientData]]
                       ) -> Dict[str, str]:
    """Bounded influence: the devices whose announced training rows exceed
    data.max_weight_ratio x the median (the lower one) of the other devices', each with a line
    saying why. A device's sizes are its own word and weigh its updates; the bound is the
    others', so no device can raise its own, and one device cannot move the median far."""
    totals = {d: sum(c.train for c in cs) for d, cs in devices.items()}
    out: Dict[str, str] = {}
    for d, n in sorted(totals.items()):
        others = [m for e, m in totals.items() if e != d]
        if not others:
            continue
        median = statistics.median_low(others)
        if n > cfg.max_weight_ratio * median:
            out[d] = (f"{d} announced {n} training rows, more than data.max_weight_ratio = "
                      f"{cfg.max_weight_ratio:g} x the other devices' median "
                      f"({median}): it is left out (bounded influence; "
                      "raise data.max_weight_ratio if its data really is that large)")
    return out


def bounded(cfg: DataConfig, devices: Dict[str, List[ClientData]]) -> Dict[str, List[ClientData]]:
    """The devices whose announcements are within the run's bound on influence
    (`influence_refusals`); each one left out is logged in its line."""
    refused = influence_refusals(cfg, devices)
    for why in refused.values():
        log.warning("%s", why)
    return {d: cs for d, cs in devices.items() if d not in refused}


def check_influence(cfg: DataConfig, clients: Sequence[ClientData], owners: Sequence[str],
                    where: str) -> None:
    """A DatasetError when the clients of `owners` (each client's device) break the bound on
    influence: a checkpoint's roster on resume, or the folders of fedseq-sim --devices-data
    (`where` says which)."""
    devices: Dict[str, List[ClientData]] = {}
    for d, c in zip(owners, clients):
        devices.setdefault(d, []).append(c)
    refused = influence_refusals(cfg, devices)
    if refused:
        raise DatasetError(f"{where}: {next(iter(refused.values()))}")


def announcement_problem(cfg: DataConfig, clients: Sequence[ClientData]) -> Optional[str]:
    """Why a device's announced clients cannot be true for this run's data config, or None."""
    num_classes = describe_classes(cfg)
    if not clients:
        return "it announced no client"
    names = [c.folder for c in clients]
    if len(set(names)) != len(names):
        return "it announced one client folder twice"
    for c in clients:
        if c.folder != SINGLE and not DEVICE_NAME.fullmatch(c.folder):
            return f"client folder {c.folder[:64]!r} is not a plain name"
        if c.train < 1 or c.test < 0:
            return f"client {c.folder}: {c.train} training and {c.test} test rows"
        cap = cfg.max_rows_per_client
        if cap is not None and (c.train > cap or c.test > cap):
            return (f"client {c.folder}: {c.train} training and {c.test} test rows, more than "
                    f"data.max_rows_per_client = {cap}")
        if len(c.counts) != num_classes or min(c.counts) < 0 or sum(c.counts) != c.train:
            return (f"client {c.folder}: its per-class counts are not {num_classes} counts "
                    f"summing to its {c.train} training rows")
    return None


def simulated_clients(cfg: DataConfig) -> List[Tuple[str, str, Path]]:
    """fedseq-sim with data.placement = "device": (device, client folder's name, folder) in
    client-id order, from data.devices_root (--devices-data)."""
    if cfg.devices_root is None:
        raise DatasetError("data.placement = \"device\" in fedseq-sim reads one data folder per "
                           "simulated device: give --devices-data DIR (DIR/<device>/ as that "
                           "device's fedseq-client --data-dir)")
    devices = device_folders(cfg.devices_root)
    found = {d: client_folders(root) for d, root in devices.items()}
    return [(d, name, folder) for d in sorted(found) for name, folder in found[d]]


def simulated_data(cfg: DataConfig, only: Optional[List[int]] = None):
    """A simulation's data.placement = "device": the rows of every simulated device's clients
    (or of the clients `only`), each client's as its own device would read them, and the
    validation rows."""
    from fedseq.common.data.federated import placed_data

    clients = simulated_clients(cfg)
    if len(clients) != cfg.num_clients:
        raise DatasetError(f"--devices-data {cfg.devices_root}: {len(clients)} client folders, "
                           f"but data.num_clients = {cfg.num_clients} (the run counts the "
                           "folders; start it again instead of resuming it)")
    parts = {i: read_client(cfg, folder) for i, (_, _, folder) in enumerate(clients)
             if only is None or i in only}
    if only is None:  # (a worker's share was checked whole by the simulation that started it)
        check_influence(cfg, [announce(parts[i], name) for i, (_, name, _) in enumerate(clients)],
                        [d for d, _, _ in clients], f"--devices-data {cfg.devices_root}")
    return placed_data(cfg, parts, len(clients), read_validation(cfg) if only is None else None,
                       owners=tuple(d for d, _, _ in clients))
