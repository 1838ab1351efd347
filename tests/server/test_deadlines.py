"""Round deadlines that fit the fleet: derived from each device's measured pace."""

from fedseq.common.config import load_config
from fedseq.server.mqtt.collect import DeadlinePolicy


def _policy(*overrides):
    return DeadlinePolicy(load_config(None, list(overrides)).deploy)


def test_fixed_deadline_wins():
    policy = _policy("deploy.round_timeout_s=42")
    policy.pace = {"a": 100.0, "b": 100.0}
    assert policy.deadline({"a": 2, "b": 1}) == 42


def test_ceiling_until_every_device_was_measured_then_factor_times_slowest():
    policy = _policy("deploy.round_timeout_factor=3", "deploy.round_timeout_min_s=10",
                     "deploy.round_timeout_max_s=1000")
    assert policy.deadline({"a": 1, "b": 1}) == 1000
    policy.measured("a", 2, 40.0)
    assert policy.pace == {"a": 20.0}
    assert policy.deadline({"a": 1, "b": 1}) == 1000  # b never measured
    assert policy.deadline({"a": 2}) == 3 * 2 * 20.0  # a alone, two clients
    policy.pace["b"] = 50.0
    assert policy.deadline({"a": 2, "b": 1}) == 3 * 50.0  # b's one client is slower than a's two
    policy.pace = {"a": 1.0, "b": 1.0}
    assert policy.deadline({"a": 1, "b": 1}) == 10  # the floor
    policy.pace = {"a": 900.0, "b": 1.0}
    assert policy.deadline({"a": 1, "b": 1}) == 1000  # the ceiling
