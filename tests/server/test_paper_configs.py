"""The paper configs whose data is not on these machines (CIFAR-10, CIFAR-100), run for a few
rounds on tiny files in the datasets' exact on-disk format: each config, and each column its
header names with options of its own, gets through training, fine-tuning and evaluation with its
model, partition and training options (the settings themselves: tests/common/test_examples.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from fedseq.common.config import load_config
from fedseq.server.ops.simulation import run_simulation

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _cifar(root: Path, dataset: str, per_file: int, classes: int) -> None:
    """CIFAR's python pickles (cifar-10-batches-py / cifar-100-python), `per_file` images each."""
    rng = np.random.default_rng(0)
    if dataset == "cifar10":
        folder, names, key = root / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + [
            "test_batch"], "labels"
    else:
        folder, names, key = root / "cifar-100-python", ["train", "test"], "fine_labels"
    folder.mkdir(parents=True)
    for n in names:
        labels = [int(i % classes) for i in range(per_file)]
        data = rng.integers(0, 256, (per_file, 3 * 32 * 32), dtype=np.uint8)
        # class-dependent brightness, so that a model can learn something from the rows
        data = np.clip(data // 2 + (np.asarray(labels)[:, None] * 127 // classes), 0, 255).astype(np.uint8)
        with (folder / n).open("wb") as f:
            pickle.dump({"data": data, key: labels}, f)


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    _cifar(root, "cifar10", 40, 10)
    _cifar(root, "cifar100", 400, 100)
    return root


SHORT = ["rounds=2", "train.eval_every=1", "train.local_epochs=1", "algorithm.finetune_epochs=1",
         "train.threads=1"]
RUNS = [
    ("fedbabu-table4", ["data.num_clients=8", "data.shards_per_client=5", "train.join_ratio=0.5"]),
    ("fedbabu-table4", ["data.num_clients=8", "data.shards_per_client=5", "train.join_ratio=0.5",
                        "algorithm.name=fedavg", "algorithm.final_finetune=true"]),
    ("fedseq-table4", ["data.num_clients=8", "data.min_samples=5", "train.join_ratio=0.5",
                       "algorithm.unfreeze_rounds=[0,1,1]"]),
    ("fedreg-table2", ["data.num_clients=6", "data.min_samples=5"]),
    ("fedreg-table2", ["data.num_clients=6", "data.min_samples=5", "algorithm.name=fedbabu"]),
    ("fedreg-table2", ["data.num_clients=6", "data.min_samples=5", "algorithm.name=ditto",
                       "algorithm.ditto.epochs=1"]),
    ("fedreg-table3", ["data.num_clients=6", "data.min_samples=5", "algorithm.name=feddyn"]),
    ("fedreg-table3", ["data.num_clients=6", "data.min_samples=5", "algorithm.name=gpfl"]),
    ("fedreg-table4", ["data.num_clients=6", "data.min_samples=5", "algorithm.name=fedrep",
                       "algorithm.fedrep.head_epochs=1"]),
    ("fedper-figure2", ["data.num_clients=4", "train.batch_size=16"]),
]


@pytest.mark.slow("a paper's configuration trained on real data: 21 s on 2 cores")
@pytest.mark.parametrize("name, over", RUNS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(RUNS)])
def test_a_paper_config_runs_on_tiny_files_of_its_dataset(cifar_root, name, over):
    cfg = load_config(EXAMPLES / f"{name}.toml", [f"data.root={str(cifar_root)!r}", *SHORT, *over])
    result = run_simulation(cfg, out=None)
    assert [r["round"] for r in result.rows if r["phase"] == "train"] == [0, 1]
    last = result.rows[-1]
    assert 0 <= last["personal_acc"] <= 1 and last["global_acc"] is not None
    if cfg.algorithm.final_finetune or cfg.algorithm.name in ("fedbabu", "fedseq-anti"):
        assert last["phase"] == "finetune"
