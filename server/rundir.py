"""The run directory every run writes: config.toml, metrics.jsonl, clients.csv, model.safetensors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from fedseq.common.config import ExperimentConfig, dump_config
from fedseq.common.models import Weights
from fedseq.common.protocol.tensors import encode_tensors


class RunDir:
    def __init__(self, path: Path, cfg: ExperimentConfig):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.toml").write_text(dump_config(cfg))
        self._metrics = (self.path / "metrics.jsonl").open("w")

    def log_round(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()

    def write_clients(self, rows: list[dict[str, Any]]) -> None:
        with (self.path / "clients.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)

    def write_model(self, weights: Weights, metadata: dict[str, str]) -> None:
        (self.path / "model.safetensors").write_bytes(encode_tensors(weights, metadata))

    def close(self) -> None:
        self._metrics.close()
