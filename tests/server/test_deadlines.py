"""Round deadlines that fit the fleet: derived from each device's measured pace."""

from fedseq.common.config import load_config
from fedseq.server.pools.mqtt.collect import DeadlinePolicy


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


def test_one_slow_device_cannot_stretch_every_deadline():
    """A device that answers just before each deadline is measured slow; with three or more
    devices in the round the slowest does not set the deadline, so it cannot grow it round after
    round towards the ceiling."""
    policy = _policy("deploy.round_timeout_factor=3", "deploy.round_timeout_min_s=10",
                     "deploy.round_timeout_max_s=1000")
    policy.pace = {"a": 10.0, "b": 12.0, "evil": 10.0}
    load = {"a": 1, "b": 1, "evil": 1}
    assert policy.deadline(load) == 3 * 10.0  # b, the slowest (12 s), is left out
    for _ in range(10):  # evil reports just before each deadline
        policy.measured("evil", 1, policy.deadline(load) * 0.99)
    assert policy.pace["evil"] > 12.0
    assert policy.deadline(load) == 3 * 12.0  # set by b now, not growing towards 1000
    assert policy.deadline({"a": 1, "evil": 1}) == 3 * policy.pace["evil"]  # two: none left out


def test_a_device_that_missed_the_deadline_is_measured_again():
    """A device that slowed down by more than the factor is not stuck with its old pace: missing
    the deadline with m of its clients done puts its pace at least at deadline / (m + 1)."""
    policy = _policy("deploy.round_timeout_factor=3", "deploy.round_timeout_min_s=10",
                     "deploy.round_timeout_max_s=1000")
    policy.pace = {"a": 10.0}
    assert policy.deadline({"a": 2}) == 60
    policy.missed("a", 0, 60.0)  # not even its first client within 60 s
    assert policy.pace["a"] == 60.0
    assert policy.deadline({"a": 2}) == 360  # the next round waits long enough for it
    policy.missed("a", 1, 360.0)
    assert policy.pace["a"] == 180.0
    policy.missed("a", 1, 30.0)  # a lower bound never lowers a known pace
    assert policy.pace["a"] == 180.0
