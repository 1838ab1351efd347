"""The MQTT pool hands updates to aggregation as they arrive, in client order; unchanged blocks
are not encoded again. Pure bookkeeping: the pool is not connected, events are injected."""

import time

import torch

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.config import load_config
from fedseq.common.protocol.messages import DeviceStatus
from fedseq.server.pools.mqtt import MqttPool
from fedseq.server.pools.mqtt.inbox import UpdateArrived


def _pool(*overrides):
    cfg = load_config(None, ["deploy.round_timeout_s=120", *overrides])
    pool = MqttPool(cfg, "mqtt://127.0.0.1:1", "run-1")
    pool.owner = {0: "a", 1: "a", 2: "b", 3: "b"}
    pool.session.online = {d: DeviceStatus(device=d, state="online") for d in "ab"}
    pool._prepare_step = lambda weights: {}
    pool.session.retain = lambda topic, payload: None
    return pool


def _update(c):
    return ClientUpdate(client=c, round=0, deltas={"w": torch.full((2,), float(c))}, num_samples=1)


def _arrive(pool, c):
    seq = pool.seq + (pool.inbox.collecting < 0)  # the step about to go out, or the current one
    pool.inbox.queue.put(UpdateArrived(pool.owner[c], seq, _update(c)))


def _next(it):
    start = time.monotonic()
    u = next(it)
    return u.client, time.monotonic() - start


def test_updates_stream_in_client_order_while_others_are_owed():
    pool = _pool()
    plan = ClientPlan(phases=(), upload=())
    _arrive(pool, 2)
    _arrive(pool, 0)
    dispatch = pool.train(0, [0, 1, 2, 3], plan, {}, lambda u: None)
    it = iter(dispatch)
    c, waited = _next(it)
    assert c == 0 and waited < 60  # handed over at once, not at the 120 s deadline
    _arrive(pool, 3)
    _arrive(pool, 1)
    assert [next(it).client for _ in range(3)] == [1, 2, 3]  # 2 and 3 waited for 1
    assert list(it) == []
    assert dispatch.outcome.reporters == {0: "a", 1: "a", 2: "b", 3: "b"}
    assert dispatch.outcome.deadline_s == 120


def test_a_client_that_fails_does_not_hold_back_the_ones_after_it():
    pool = _pool()
    _arrive(pool, 1)
    dispatch = pool.train(0, [0, 1, 2], ClientPlan(phases=(), upload=()), {}, lambda u: None)
    it = iter(dispatch)
    pool.inbox.on_message(pool.topics.device_status("a"), DeviceStatus(
        device="a", state="online", error="out of memory", error_seq=pool.seq,
        error_run_id="run-1").encode())
    # device a cannot train: client 0 never comes; 1 (already in) is handed over, 2 follows
    assert next(it).client == 1
    _arrive(pool, 2)
    assert [u.client for u in it] == [2]
    assert dispatch.outcome.device_failures == {"a": "out of memory"}
    assert dispatch.outcome.blocked == {0, 1}


def test_a_short_round_ends_at_its_deadline_with_what_came():
    pool = _pool("deploy.round_timeout_s=2")
    _arrive(pool, 0)
    dispatch = pool.train(0, [0, 1, 2], ClientPlan(phases=(), upload=()), {}, lambda u: None)
    assert [u.client for u in dispatch] == [0]  # streamed as it came; the round loop decides
    assert dispatch.outcome.deadline_s == 2 and not dispatch.outcome.blocked


def test_sync_encodes_a_block_again_only_when_its_tensors_change():
    pool = MqttPool(load_config(None, []), "mqtt://127.0.0.1:1", "run-1")
    sent = []
    pool.blocks._publish = lambda block, version, frame, digest: sent.append((block, version))
    w = {"a.weight": torch.ones(3), "b.weight": torch.zeros(2)}
    assert pool.blocks.sync(w) == {"a": 0, "b": 0}
    w2 = {**w, "b.weight": torch.full((2,), 5.0)}  # aggregation replaced b only
    assert pool.blocks.sync(w2) == {"a": 0, "b": 1}
    w2["a.weight"].add_(1)  # an in-place edit is seen too
    assert pool.blocks.sync(w2) == {"a": 1, "b": 1}
    w3 = {k: v.clone() for k, v in w2.items()}  # same content in new tensors: no new version
    assert pool.blocks.sync(w3) == {"a": 1, "b": 1}
    assert sent == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert pool.blocks.republish() == 2
