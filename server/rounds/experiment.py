"""What every run starts from, simulated or deployed: the data, the seed-derived model and the
algorithm, built the same way by fedseq-sim and fedseq-server."""

from __future__ import annotations

from dataclasses import dataclass

from fedseq.common.algorithms import Algorithm, make_algorithm, run_model, run_model_spec
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData, announced_data, load_federated
from fedseq.common.data.placed import ClientData, read_validation
from fedseq.common.models import BlockModel


@dataclass
class Experiment:
    """The run's partitioned data, its initial model (a pure function of the seed) and its
    algorithm (the round loop prepares it with the partition's sizes)."""

    data: FederatedData
    model: BlockModel
    algorithm: Algorithm


def load_experiment(cfg: ExperimentConfig, test_images_only: bool = False,
                    announced: list[tuple[str, ClientData]] | None = None) -> Experiment:
    """Load and partition the dataset, build the model and the algorithm. `test_images_only`:
    the coordinator of a deployment needs the test rows' images (its global evaluation) and the
    partition's sizes, never a training image. `announced` (data.placement = "device" on a
    fleet): (device, client) as the devices announced them, in client-id order; the coordinator
    then holds data.validation's rows and nothing else."""
    # the algorithm first: its checks against the model's blocks fail before the data loads
    algorithm = make_algorithm(cfg, run_model_spec(cfg))
    if announced is not None:
        data = announced_data(cfg.data, [c for _, c in announced], read_validation(cfg.data),
                              tuple(d for d, _ in announced))
    else:
        data = load_federated(cfg.data, cfg.seed_for("data"), test_images_only=test_images_only)
    model = run_model(cfg, data.input_shape, data.num_classes)
    assert model.spec == algorithm.spec
    return Experiment(data, model, algorithm)
