"""The dataset catalog: every fact about a dataset that is known without reading its files, in
one place for the readers (readers.py), the store (store.py: download, import, verify) and the
CLIs. Standard library only, so a device can use it too.

Per dataset: its files with their md5 sums and sizes and the mirrors that serve them
(`DATASETS`, by archive: the EMNIST splits share one), the folder under the data root its
files are in (`IDX_LAYOUT`, `EXTRACTED`), its classes (`NUM_CLASSES`) and its images' shape
(`INPUT_SHAPES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedseq.common.errors import DatasetError


@dataclass(frozen=True)
class DataFile:
    name: str
    md5: str
    size: int


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset's files on disk and where to download them: one entry of the catalog per
    dataset (a new dataset: its DatasetSpec here and its reader in readers.py)."""

    folder: str  # where the files go, under the data root
    files: tuple[DataFile, ...]
    mirrors: tuple[str, ...]  # base URLs, tried in order
    extract: str | None = None  # an archive whose content goes into the data root after its check


IDX_NAMES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
             "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def _idx_files(*md5_size: tuple[str, int]) -> tuple[DataFile, ...]:
    assert len(md5_size) == len(IDX_NAMES)
    return tuple(DataFile(n, md5, size) for n, (md5, size) in zip(IDX_NAMES, md5_size))


# md5 sums and sizes as torchvision checks them
DATASETS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec(
        "MNIST/raw",
        _idx_files(("f68b3c2dcbeaaa9fbdd348bbdeb94873", 9912422),
                   ("d53e105ee54ea40749a09fcbcd1e9432", 28881),
                   ("9fb629c4189551a2d022fa330f9573f3", 1648877),
                   ("ec29112dd5afa0611ce80d1b7f02629c", 4542)),
        ("https://ossci-datasets.s3.amazonaws.com/mnist/",
         "https://storage.googleapis.com/cvdf-datasets/mnist/",
         "http://yann.lecun.com/exdb/mnist/"),
    ),
    "fmnist": DatasetSpec(
        "FashionMNIST/raw",
        _idx_files(("8d4fb7e6c68d591d4c3dfef9ec88bf0d", 26421880),
                   ("25c81989df183df01b3e8a0aad5dffbe", 29515),
                   ("bef4ecab320f06d8554ea6380940ec79", 4422102),
                   ("bb300cfdad3c16e7a12a480ee83cd310", 5148)),
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
         "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/"),
    ),
    "cifar10": DatasetSpec(
        "", (DataFile("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a", 170498071),),
        ("https://www.cs.toronto.edu/~kriz/",), extract="cifar-10-python.tar.gz",
    ),
    "cifar100": DatasetSpec(
        "", (DataFile("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85", 169001437),),
        ("https://www.cs.toronto.edu/~kriz/",), extract="cifar-100-python.tar.gz",
    ),
    # NIST's one archive of all six EMNIST splits (md5 as torchvision checks it); its gzip/*.gz
    # members are extracted into EMNIST/raw, the archive removed
    "emnist": DatasetSpec(
        "EMNIST/raw", (DataFile("gzip.zip", "58c8d27c78d21e728a6bc7b3cc06412e", 561753746),),
        ("https://biometrics.nist.gov/cs_links/EMNIST/",), extract="gzip.zip",
    ),
    # Stanford CS231n's Tiny-ImageNet (md5 and size as its loaders check them): 200 classes of
    # 64x64 JPEGs, 500 training and 50 validation images each; extracted, then decoded once into
    # tiny-imagenet-200/fedseq/ (readers.py), which is what every command reads
    "tiny-imagenet": DatasetSpec(
        "", (DataFile("tiny-imagenet-200.zip", "90528d7ca1a48142e341f4ef8d21d0de", 248100043),),
        ("https://cs231n.stanford.edu/",), extract="tiny-imagenet-200.zip",
    ),
}
EXTRACTED = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python",
             "emnist": "EMNIST/raw", "tiny-imagenet": "tiny-imagenet-200"}


#: the folder of each IDX dataset's files under the data root (its DATASETS entry's)
IDX_LAYOUT = {name: DATASETS[name].folder for name in ("mnist", "fmnist")}
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR_DIRS = {name: EXTRACTED[name] for name in ("cifar10", "cifar100")}
NUM_CLASSES = {"mnist": 10, "fmnist": 10, "cifar10": 10, "cifar100": 100}
#: (channels, height, width) of each dataset's images, known without reading the files
INPUT_SHAPES = {"mnist": (1, 28, 28), "fmnist": (1, 28, 28), "cifar10": (3, 32, 32),
                "cifar100": (3, 32, 32)}
#: EMNIST's six splits (Cohen et al. 2017), each a dataset `emnist-<split>` of its own, with its
#: classes; all are IDX files of one NIST archive, named emnist-<split>-train-images-idx3-ubyte.
#: The images are stored as NIST wrote them (transposed against MNIST's), as torchvision reads
#: them. `letters` labels 1-26 in the files; they are read as 0-25.
EMNIST_SPLITS = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10,
                 "mnist": 10}
for _split, _classes in EMNIST_SPLITS.items():
    IDX_LAYOUT[f"emnist-{_split}"] = DATASETS["emnist"].folder
    NUM_CLASSES[f"emnist-{_split}"] = _classes
    INPUT_SHAPES[f"emnist-{_split}"] = (1, 28, 28)


NUM_CLASSES["tiny-imagenet"] = 200

#: data.normalize = "channel": each channel's (mean, standard deviation) in [0, 1] pixel units, as
#: the papers' code normalizes: FedBABU's (utils/train_utils.py, after LG-FedAvg) for MNIST and
#: the two CIFARs, ImageNet's for Tiny-ImageNet, the usual Fashion-MNIST figures
CHANNEL_STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar100": ((0.507, 0.487, 0.441), (0.267, 0.256, 0.276)),
    "tiny-imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
INPUT_SHAPES["tiny-imagenet"] = (3, 64, 64)


def idx_stems(dataset: str, split: str) -> tuple[str, str]:
    """The (images, labels) file names of a split ("train", "test") of an IDX dataset."""
    if dataset.startswith("emnist-"):
        kind = dataset[len("emnist-"):]
        return (f"emnist-{kind}-{split}-images-idx3-ubyte",
                f"emnist-{kind}-{split}-labels-idx1-ubyte")
    return IDX_FILES[split]


def archive_of(dataset: str) -> str:
    """The DATASETS entry that holds `dataset`'s files: emnist-letters is in emnist's archive."""
    return "emnist" if dataset.startswith("emnist-") else dataset


def spec_of(dataset: str) -> DatasetSpec:
    """The catalogued dataset's spec (its files, shapes, classes); an unknown name is a DatasetError
    naming the known ones."""
    if archive_of(dataset) not in DATASETS:
        raise DatasetError(f"unknown dataset {dataset!r}; use one of {', '.join(DATASETS)} "
                           "(EMNIST as emnist-letters, -digits, -balanced, -byclass, -bymerge "
                           "or -mnist)")
    return DATASETS[archive_of(dataset)]
