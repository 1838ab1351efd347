"""Round deadlines that fit the fleet: derived from each device's measured pace."""

from fedseq.common.config import load_config
from fedseq.server.mqtt_pool import MqttPool


def _pool(*overrides):
    cfg = load_config(None, list(overrides))
    pool = MqttPool(cfg, "mqtt://127.0.0.1:1", "run-1")  # not connected: pure bookkeeping here
    pool.owner = {0: "a", 1: "a", 2: "b", 3: "b"}
    return pool


def test_fixed_deadline_wins():
    pool = _pool("deploy.round_timeout_s=42")
    pool.pace = {"a": 100.0, "b": 100.0}
    assert pool.round_deadline([0, 1, 2]) == 42


def test_ceiling_until_every_device_was_measured_then_factor_times_slowest():
    pool = _pool("deploy.round_timeout_factor=3", "deploy.round_timeout_min_s=10",
                 "deploy.round_timeout_max_s=1000")
    assert pool.round_deadline([0, 2]) == 1000
    pool.pace = {"a": 20.0}
    assert pool.round_deadline([0, 2]) == 1000  # b never measured
    assert pool.round_deadline([0, 1]) == 3 * 2 * 20.0  # a alone, two clients
    pool.pace["b"] = 50.0
    assert pool.round_deadline([0, 1, 2]) == 3 * 50.0  # b's one client is slower than a's two
    pool.pace = {"a": 1.0, "b": 1.0}
    assert pool.round_deadline([0, 2]) == 10  # the floor
    pool.pace = {"a": 900.0, "b": 1.0}
    assert pool.round_deadline([0, 2]) == 1000  # the ceiling
