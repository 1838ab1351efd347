"""Sensor series and tabular rows (issue 94, finding 2): the own-code tutorial's section 7 run as
written on real measurements that scikit-learn ships (wine), normalization by the training rows'
statistics (`fedseq data stats`, data.normalize = "stats"), per channel for a series."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_plugins import lab_package  # noqa: F401  (the fixture: examples/plugin installed)

from conftest import server_only
from fedseq.common.config import load_config
from fedseq.common.data.federated import load_federated, training_stats
from fedseq.common.errors import DatasetError

pytestmark = server_only
TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "own-code.md"


def _section_commands() -> str:
    """The bash block of the tutorial's section 7, as written."""
    text = TUTORIAL.read_text()
    section = text[text.index("## 7. Sensor and tabular data"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow("the tutorial's commands: pip-installed plugin, two short runs: ~25 s")
def test_the_tutorials_wine_commands_run_as_written_and_the_statistics_matter(
        lab_package, tmp_path):  # noqa: F811
    pytest.importorskip("sklearn")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", _section_commands()], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    cfg = (tmp_path / "wine.toml").read_text()
    assert 'normalize = "stats"' in cfg and "# [data] keys: per feature, from the" in cfg
    recorded = (tmp_path / "runs" / "wine" / "config.toml").read_text()
    assert 'normalize = "stats"' in recorded and "mean = [" in recorded
    rows = [json.loads(r) for r in (tmp_path / "runs" / "wine" / "metrics.jsonl").open()]
    with_stats = rows[-1]["global_acc"]
    # the same run on the rows as they are
    raw = cfg[: cfg.index("# [data] keys")]
    (tmp_path / "raw.toml").write_text(raw)
    done = subprocess.run(["fedseq-sim", "-q", "--config", "raw.toml", "--out", "runs/raw"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(r) for r in (tmp_path / "runs" / "raw" / "metrics.jsonl").open()]
    assert with_stats > 0.85 and with_stats > rows[-1]["global_acc"] + 0.3, (with_stats, rows[-1])


def test_a_series_is_normalized_per_channel_by_its_training_rows(tmp_path):
    """Three channels on scales 1, 100 and 1e4: `training_stats` gives each channel's mean and
    deviation over every client's training rows (not the test rows), and the rows the model gets
    are then standardized; a mean of another length is one line."""
    rng = np.random.default_rng(1)
    scale = np.array([1.0, 100.0, 1e4]).reshape(1, 3, 1)
    x = (rng.standard_normal((300, 3, 20)) * scale + 5 * scale).astype(np.float32)
    np.savez(tmp_path / "series.npz", x=x, y=rng.integers(0, 2, 300))
    base = [f"data.root={str(tmp_path)!r}", "data.dataset='npz'", "data.options.path='series.npz'",
            "data.options.classes=2", "data.options.shape=[3, 20]", "data.num_clients=3",
            "data.partition='iid'"]
    cfg = load_config(None, base)
    mean, std, rows, per = training_stats(cfg.data, 0)
    data = load_federated(cfg.data, 0)
    train = torch.cat([c.train for c in data.clients])
    assert per == "channel" and rows == len(train) < 300
    want = data.x[train].double()
    assert np.allclose(mean, want.mean(dim=(0, 2, 3)), rtol=1e-9)
    assert np.allclose(std, want.std(dim=(0, 2, 3), unbiased=False), rtol=1e-9)
    cfg = load_config(None, [*base, "data.normalize='stats'", f"data.mean={mean}",
                             f"data.std={std}"])
    inputs = load_federated(cfg.data, 0).images(train)
    assert inputs.shape == (len(train), 3, 1, 20)
    assert torch.allclose(inputs.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-3)
    assert torch.allclose(inputs.std(dim=(0, 2, 3), unbiased=False), torch.ones(3), atol=1e-3)
    cfg = load_config(None, [*base, "data.normalize='stats'", "data.mean=[0.0, 1.0]",
                             "data.std=[1.0, 1.0]"])
    with pytest.raises(DatasetError, match="data.mean has 2 values; the rows have 3 channels"):
        load_federated(cfg.data, 0)
