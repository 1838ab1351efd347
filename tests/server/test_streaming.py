"""The MQTT pool hands updates to aggregation as they arrive, in client order; unchanged blocks
are not encoded again. Pure bookkeeping: the pool is not connected, events are injected."""

import time

import torch

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.config import load_config
from fedseq.common.protocol.messages import DeviceStatus
from fedseq.server.mqtt_pool import MqttPool


def _pool(*overrides):
    cfg = load_config(None, ["deploy.round_timeout_s=120", *overrides])
    pool = MqttPool(cfg, "mqtt://127.0.0.1:1", "run-1")
    pool.owner = {0: "a", 1: "a", 2: "b", 3: "b"}
    pool.online = {d: DeviceStatus(device=d, state="online") for d in "ab"}
    pool._await_quorum = lambda: None
    pool._sync = lambda weights, force=False: {}
    pool._retain = lambda topic, payload: None
    return pool


def _update(c):
    return ClientUpdate(client=c, round=0, deltas={"w": torch.full((2,), float(c))}, num_samples=1)


def _arrive(pool, c):
    pool.events.put(("update", (pool.owner[c], pool.seq + (pool.train_seq < 0), _update(c))))


def _next(gen):
    start = time.monotonic()
    u = next(gen)
    return u.client, time.monotonic() - start


def test_updates_stream_in_client_order_while_others_are_owed():
    pool = _pool()
    plan = ClientPlan(phases=(), upload=())
    _arrive(pool, 2)
    _arrive(pool, 0)
    gen = pool.train(0, [0, 1, 2, 3], plan, {}, lambda u: None)
    c, waited = _next(gen)
    assert c == 0 and waited < 60  # handed over at once, not at the 120 s deadline
    _arrive(pool, 3)
    _arrive(pool, 1)
    assert [next(gen).client for _ in range(3)] == [1, 2, 3]  # 2 and 3 waited for 1
    assert list(gen) == []
    assert pool.round_info["reporters"] == {"0": "a", "1": "a", "2": "b", "3": "b"}


def test_a_client_that_fails_does_not_hold_back_the_ones_after_it():
    pool = _pool()
    _arrive(pool, 1)
    gen = pool.train(0, [0, 1, 2], ClientPlan(phases=(), upload=()), {}, lambda u: None)
    pool.events.put(("status", DeviceStatus(device="a", state="online", error="out of memory",
                                            error_seq=pool.seq + 1, error_run_id="run-1")))
    # device a cannot train: client 0 never comes; 1 (already in) is handed over, 2 follows
    assert next(gen).client == 1
    _arrive(pool, 2)
    assert [u.client for u in gen] == [2]


def test_quorum_failure_is_flagged_after_streaming():
    pool = _pool("deploy.min_updates=3", "deploy.round_timeout_s=2")
    _arrive(pool, 0)
    got = [u.client for u in pool.train(0, [0, 1, 2], ClientPlan(phases=(), upload=()), {}, lambda u: None)]
    assert got == [0]  # streamed as it came; the coordinator discards it on the flag below
    assert "quorum_failed" in pool.round_info


def test_sync_encodes_a_block_again_only_when_its_tensors_change(monkeypatch):
    cfg = load_config(None, [])
    pool = MqttPool(cfg, "mqtt://127.0.0.1:1", "run-1")
    sent = []
    pool._publish_block = lambda block, version, frame, digest: sent.append((block, version))
    w = {"a.weight": torch.ones(3), "b.weight": torch.zeros(2)}
    assert pool._sync(w) == {"a": 0, "b": 0}
    w2 = {**w, "b.weight": torch.full((2,), 5.0)}  # aggregation replaced b only
    assert pool._sync(w2) == {"a": 0, "b": 1}
    w2["a.weight"].add_(1)  # an in-place edit is seen too
    assert pool._sync(w2) == {"a": 1, "b": 1}
    w3 = {k: v.clone() for k, v in w2.items()}  # same content in new tensors: no new version
    assert pool._sync(w3) == {"a": 1, "b": 1}
    assert sent == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
