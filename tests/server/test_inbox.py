"""The coordinator's inbox stays bounded whatever a device sends (unit level, no broker)."""

import hashlib
import queue

import pytest
import torch

from fedseq.common.protocol.frames import FramePool, pack_chunk
from fedseq.common.protocol.messages import DeviceInfo, DeviceStatus, EvalResult, UpdateHeader
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.server.mqtt import inbox
from fedseq.server.mqtt.inbox import (
    EVALS_PER_CLIENT,
    STACKS_PER_DEVICE,
    UPDATES_PER_CLIENT,
    WARNINGS_PER_MINUTE,
    Inbox,
    StatusArrived,
    UpdateArrived,
    queue_share,
)

T = Topics()


@pytest.fixture
def unlimited(monkeypatch):
    """No rate budget: these tests send thousands of messages at once to test the other bounds."""
    monkeypatch.setattr(inbox, "BURST_BASE", 10**9)


def _inbox() -> Inbox:
    box = Inbox(T, "r1")
    box.owner = {0: "dev01", 1: "dev01", 2: "dev02"}
    box.frames = FramePool(max_frame=1 << 20, per_sender=4 << 20)
    box.collect(5)
    return box


def test_a_status_flood_is_one_event_with_the_latest_status(unlimited):
    box = _inbox()
    for i in range(5000):
        st = DeviceStatus(device="dev01", state="online", memory_mb=i)
        box.on_message(T.device_status("dev01"), st.encode())
    assert box.queue.qsize() == 1
    ev = box.next_event(0)
    assert isinstance(ev, StatusArrived) and ev.device == "dev01"
    assert [st.memory_mb for st in box.take_statuses()] == [4999]
    box.on_message(T.device_status("dev01"), DeviceStatus(device="dev01", state="offline").encode())
    assert box.queue.qsize() == 1  # a new change after the last was taken is a new event


def test_repeated_updates_and_evaluations_are_capped_per_client_and_step(unlimited):
    box = _inbox()
    frame = encode_tensors({"fc.w": torch.ones(3)})
    head = UpdateHeader(run_id="r1", seq=5, round=0, client=0, device="dev01", num_samples=10,
                        chunk=0, chunks=1, size=len(frame), sha256=hashlib.sha256(frame).hexdigest())
    for _ in range(50):
        box.on_message(T.update("dev01"), pack_chunk(head, frame))
    assert box.queue.qsize() == UPDATES_PER_CLIENT and box.dropped == 50 - UPDATES_PER_CLIENT
    res = EvalResult(run_id="r1", seq=5, device="dev01", results={}, final=False)
    before = box.queue.qsize()
    for _ in range(100):
        box.on_message(T.evaluation("dev01"), res.encode())
    assert box.queue.qsize() - before == EVALS_PER_CLIENT * 3  # two clients on dev01, plus one
    box.collect(7)  # a new step: its own budget
    head7 = head.model_copy(update={"seq": 7})
    box.on_message(T.update("dev01"), pack_chunk(head7, frame))
    assert box.queue.qsize() - before == EVALS_PER_CLIENT * 3 + 1


def test_one_login_cannot_take_the_queue_or_grow_the_bookkeeping(unlimited):
    """Hardening III, finding 2: evaluations under every step number a sender can choose, and
    more than its share for the step being collected: dev01 never has more than its queue share
    waiting, the per-step counts do not grow with the step numbers it invents, and dev02's
    update still gets in."""
    box = _inbox()
    for seq in range(20_000):
        res = EvalResult(run_id="r1", seq=seq if seq % 2 else 5, device="dev01", results={0: (1, 2)})
        box.on_message(T.evaluation("dev01"), res.encode())
    assert box.queue.qsize() <= queue_share(2)
    assert len(box._queued) <= 2 and box.late_evals == 9_999  # every odd step but 5
    frame = encode_tensors({"fc.w": torch.ones(3)})
    head = UpdateHeader(run_id="r1", seq=5, round=0, client=2, device="dev02", num_samples=10,
                        chunk=0, chunks=1, size=len(frame), sha256=hashlib.sha256(frame).hexdigest())
    box.on_message(T.update("dev02"), pack_chunk(head, frame))
    events = []
    while (ev := box.next_event(0)) is not None:
        events.append(ev)
    assert any(isinstance(e, UpdateArrived) and e.device == "dev02" for e in events)
    assert box._held.get("dev01") == 0  # taking an event gives its device's share back


def test_an_evaluation_larger_than_its_devices_scores_is_refused_before_parsing():
    box = _inbox()
    junk: list[str] = []
    box.on_junk = junk.append
    many = EvalResult(run_id="r1", seq=5, device="dev01", results={c: (1, 2) for c in range(100_000)})
    box.on_message(T.evaluation("dev01"), many.encode())
    assert junk == [T.evaluation("dev01")] and box.queue.qsize() == 0


def test_a_status_is_never_lost_to_a_full_queue(unlimited):
    """Hardening III, finding 2: when the queue is full (here made tiny), a device's status still
    reaches presence, and so do its later ones (its coalescing never sticks)."""
    from fedseq.server.mqtt.session import ServerSession

    box = _inbox()
    box.queue = queue.Queue(2)
    session = ServerSession(T, "r1", "mqtt://127.0.0.1:1", box)
    for i in range(3):
        box.on_message(T.evaluation("dev01"), EvalResult(run_id="r1", seq=5, device="dev01",
                                                         results={0: (i, 9)}).encode())
    box.on_message(T.device_status("dev02"), DeviceStatus(device="dev02", state="online").encode())
    assert box.queue.qsize() == 2 and box.dropped == 2  # the third eval and the wake-up
    session.drain(0)
    assert "dev02" in session.online
    for state in ("offline", "online", "offline"):
        for i in range(3):
            box.on_message(T.evaluation("dev01"), EvalResult(run_id="r1", seq=5, device="dev01",
                                                             results={0: (i, 9)}).encode())
        box.on_message(T.device_status("dev02"), DeviceStatus(device="dev02", state=state).encode())
        session.drain(0)
        assert ("dev02" in session.online) == (state == "online"), state


def test_warnings_about_one_device_are_rate_limited_and_plain_text(caplog):
    """Hardening III, finding 6: a device's junk is logged at most WARNINGS_PER_MINUTE times a
    minute, each line one line of plain text whatever the device put in it."""
    box = _inbox()
    forged = '{"v": 5, "device": "dev01", "state": "online", "x\\nERROR round 7 failed\\u001b[2J": 1}'
    with caplog.at_level("WARNING", logger="fedseq.server.mqtt.inbox"):
        for _ in range(500):
            box.on_message(T.device_status("dev01"), forged.encode())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == WARNINGS_PER_MINUTE, len(lines)
    assert all("\n" not in x and "\x1b" not in x for x in lines), lines[0]


def test_invalid_messages_on_device_topics_are_reported_for_clearing():
    box = _inbox()
    junk: list[str] = []
    box.on_junk = junk.append
    box.on_message(T.update("dev01"), b"\x00junk")
    box.on_message(T.evaluation("dev02"), b'{"v": 4}')
    box.on_message(T.device_status("dev01"), b"not json")  # its own retained topic: kept
    assert junk == [T.update("dev01"), T.evaluation("dev02")]
    assert box.queue.qsize() == 0
    assert box.heard == {}  # invalid messages prove nothing about a device being alive


def test_device_stacks_keep_each_change_once_and_refuse_another_devices_claim(unlimited):
    box = _inbox()
    nano = DeviceInfo(device="dev01", torch="1.12.1", threads=4, machine="aarch64",
                      cpu="NVIDIA Jetson Nano Developer Kit", l4t="R32.7.1")
    for _ in range(3):  # every reconnect re-publishes the same stack: one entry
        box.on_message(T.device_info("dev01"), nano.encode())
    upgraded = nano.model_copy(update={"torch": "1.13.0"})
    box.on_message(T.device_info("dev01"), upgraded.encode())
    # another device's login cannot describe dev01 from its own topic, nor send junk
    box.on_message(T.device_info("dev02"), nano.encode())
    box.on_message(T.device_info("dev02"), b'{"v": 4, "device": "dev02", "torch": 5}')
    stacks = box.device_stacks()
    assert list(stacks) == ["dev01"]
    assert [r["torch"] for r in stacks["dev01"]] == ["1.12.1", "1.13.0"]
    assert stacks["dev01"][0]["l4t"] == "R32.7.1" and stacks["dev01"][0]["seen"] > 0
    assert box.queue.qsize() == 0  # informational: no event for the round loop
    assert "dev01" not in box.heard  # and not a sign of life (it is retained)
    for i in range(100):  # a device that keeps changing its story stays bounded
        box.on_message(T.device_info("dev01"), nano.model_copy(update={"threads": i + 5}).encode())
    kept = box.device_stacks()["dev01"]
    assert len(kept) == STACKS_PER_DEVICE
    assert kept[0]["torch"] == "1.12.1" and kept[-1]["threads"] == 104  # the first and the latest


def test_a_device_sending_faster_than_its_budget_is_dropped_unread(monkeypatch):
    """Hardening III, finding 2: past its burst, a device's messages are dropped before they are
    parsed (counted, and warned about at the rate limit); another device is not affected, and the
    budget refills with time."""
    box = _inbox()
    clock = [1000.0]
    monkeypatch.setattr(inbox.time, "monotonic", lambda: clock[0])
    burst = inbox.BURST_BASE + inbox.BURST_PER_CLIENT * 2  # dev01 holds two clients
    for i in range(burst + 500):
        box.on_message(T.device_status("dev01"), DeviceStatus(device="dev01", state="online",
                                                              memory_mb=i).encode())
    assert box.flooded == 500
    assert [st.memory_mb for st in box.take_statuses()] == [burst - 1]
    box.on_message(T.device_status("dev02"), DeviceStatus(device="dev02", state="online").encode())
    assert [st.device for st in box.take_statuses()] == ["dev02"]
    clock[0] += 1.0  # one second: RATE_BASE + RATE_PER_CLIENT * 2 more messages
    for i in range(100):
        box.on_message(T.device_status("dev01"), DeviceStatus(device="dev01", state="online",
                                                              memory_mb=i).encode())
    assert box.flooded == 500 + 100 - int(inbox.RATE_BASE + inbox.RATE_PER_CLIENT * 2)


def test_a_big_models_updates_fit_the_budget_all_at_once(monkeypatch):
    """A device answers a resend with every client's update at once: with ResNet-34's 82 chunks
    an update, its three clients' 246 chunks pass; twice that in the same instant does not, and
    another round's worth is back within RESEND_SPACING_S seconds."""
    box = Inbox(T, "r1")
    box.owner = {0: "dev01", 1: "dev01", 2: "dev01"}
    box.frames = FramePool(max_frame=82 << 20, per_sender=4 * (82 << 20))
    box.update_chunks = 82
    box.collect(5)
    clock = [1000.0]
    monkeypatch.setattr(inbox.time, "monotonic", lambda: clock[0])
    status = DeviceStatus(device="dev01", state="online").encode()
    for _ in range(3 * 82 + 30):  # every update, and a few statuses and evaluations
        box.on_message(T.device_status("dev01"), status)
    assert box.flooded == 0
    for _ in range(3 * 82):
        box.on_message(T.device_status("dev01"), status)
    assert box.flooded > 0
    flooded = box.flooded
    clock[0] += inbox.RESEND_SPACING_S
    for _ in range(3 * 82):
        box.on_message(T.device_status("dev01"), status)
    assert box.flooded == flooded
