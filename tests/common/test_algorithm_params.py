"""Each algorithm's own parameters: [algorithm.<name>] tables, validated with the config, the
former flat keys mapped, none of them broadcast to devices."""

import pytest

from fedseq.common.algorithms import ALGORITHMS, make_algorithm
from fedseq.common.config import FORMER_KEYS, AlgorithmParams, ExperimentConfig, load_config
from fedseq.common.errors import ConfigError
from fedseq.common.models import ModelSpec

SPEC = ModelSpec(("conv1", "conv2"), "fc", None)


def test_a_table_is_validated_against_its_algorithms_parameter_model():
    cfg = load_config(None, ["algorithm.name=fedprox", "algorithm.fedprox.mu=0.05"])
    assert cfg.algorithm.fedprox.mu == 0.05
    assert make_algorithm(cfg, SPEC).client_params() == {"mu": 0.05}
    with pytest.raises(ConfigError, match="fedprox.*mu"):
        load_config(None, ["algorithm.fedprox.mu=-1"])
    with pytest.raises(ConfigError, match="fedprox.*nu"):
        load_config(None, ["algorithm.fedprox.nu=1"])
    with pytest.raises(ConfigError, match=r"algorithm\.fedavg.*has no parameters"):
        load_config(None, ["algorithm.fedavg.mu=1"])
    with pytest.raises(ConfigError, match="unknown key algorithm.lambda"):
        load_config(None, ["algorithm.lambda=1"])


def test_the_selected_algorithm_records_its_whole_table():
    """A run's config.toml holds every parameter of its algorithm, defaults filled in."""
    dumped = load_config(None, ["algorithm.name=ditto"]).model_dump(mode="json")["algorithm"]
    assert dumped["ditto"] == {"lam": 0.1, "epochs": 5}
    assert ExperimentConfig.model_validate(
        load_config(None, ["algorithm.name=ditto"]).model_dump(mode="json")
    ).algorithm.ditto.lam == 0.1


@pytest.mark.parametrize("old", sorted(FORMER_KEYS))
def test_every_former_flat_key_still_works_and_moves_to_its_table(old):
    """A config file or --set of before the tables keeps working: the value lands in every
    table the former key names, and the run's config records it there."""
    table, field = FORMER_KEYS[old][0].split(".")
    default = ALGORITHMS[table].params_model.model_fields[field].default
    value = default if isinstance(default, str) else (
        default + 1 if isinstance(default, int) else default / 2)
    given = f"algorithm.{old}={value!r}" if isinstance(value, str) else f"algorithm.{old}={value}"
    cfg = load_config(None, [given])
    for target in FORMER_KEYS[old]:
        name, key = target.split(".")
        assert getattr(getattr(cfg.algorithm, name), key) == value
    dumped = cfg.model_dump(mode="json")["algorithm"]
    assert old not in dumped and dumped[table][field] == value


def test_a_former_key_and_its_table_disagreeing_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="mu is the former name of algorithm.fedprox.mu"):
        load_config(None, ["algorithm.mu=0.1", "algorithm.fedprox.mu=0.2"])


def test_every_parameter_model_is_declared_in_its_algorithms_module():
    for name, cls in ALGORITHMS.items():
        if cls.params_model is not None:
            assert issubclass(cls.params_model, AlgorithmParams)
            assert cls.params_model.__module__.startswith("fedseq.common.algorithms."), name
    assert {t.split(".")[0] for ts in FORMER_KEYS.values() for t in ts} <= {
        n for n, c in ALGORITHMS.items() if c.params_model is not None}


def test_devices_get_no_parameter_table_nor_a_coordinator_only_key():
    cfg = load_config(None, ["algorithm.name=fedprox", "algorithm.ditto.lam=0.3",
                             "algorithm.server_lr=0.5"])
    sent = cfg.for_devices()
    assert "fedprox" not in sent["algorithm"] and "ditto" not in sent["algorithm"]
    assert "server_lr" not in sent["algorithm"]
    assert "mode" not in sent["train"] and "root" not in sent["data"]
    assert "privacy" not in sent and "fleet" not in sent
    assert "password_file" not in sent["deploy"] and "noise" not in sent.get("seeds", {})
    # what a device reads back: the same run (name, schedule, training) without them
    back = ExperimentConfig.model_validate(sent)
    assert back.algorithm.name == "fedprox" and back.train == cfg.train.model_copy(
        update={k: getattr(type(cfg.train)(), k) for k in ("mode", "concurrency", "buffer",
                                                            "staleness_alpha", "max_staleness",
                                                            "over_select")})


def test_a_key_marked_since_the_current_protocol_is_left_out_at_its_default(monkeypatch):
    """A device-visible key added without a protocol bump (`since`): devices of this protocol
    that predate it would refuse it, so it is broadcast only where it is not its default."""
    from fedseq.common.config import TrainConfig, since
    from fedseq.common.protocol.messages import PROTOCOL_VERSION

    field = TrainConfig.model_fields["lr_gamma"]
    monkeypatch.setattr(field, "json_schema_extra", since(PROTOCOL_VERSION))
    assert "lr_gamma" not in load_config(None, []).for_devices()["train"]
    assert load_config(None, ["train.lr_gamma=0.5"]).for_devices()["train"]["lr_gamma"] == 0.5
    monkeypatch.setattr(field, "json_schema_extra", since(PROTOCOL_VERSION - 1))
    assert "lr_gamma" in load_config(None, []).for_devices()["train"]
