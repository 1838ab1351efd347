"""The coordinator's inbox stays bounded whatever a device sends (unit level, no broker)."""

import hashlib

import torch

from fedseq.common.protocol.frames import FramePool, pack_chunk
from fedseq.common.protocol.messages import DeviceStatus, EvalResult, UpdateHeader
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.server.mqtt.inbox import EVALS_PER_CLIENT, UPDATES_PER_CLIENT, Inbox, StatusArrived

T = Topics()


def _inbox() -> Inbox:
    box = Inbox(T, "r1")
    box.owner = {0: "dev01", 1: "dev01", 2: "dev02"}
    box.frames = FramePool(max_frame=1 << 20, per_sender=4 << 20)
    box.collect(5)
    return box


def test_a_status_flood_is_one_event_with_the_latest_status():
    box = _inbox()
    for i in range(5000):
        st = DeviceStatus(device="dev01", state="online", memory_mb=i)
        box.on_message(T.device_status("dev01"), st.encode())
    assert box.queue.qsize() == 1
    ev = box.queue.get_nowait()
    assert isinstance(ev, StatusArrived) and ev.device == "dev01"
    assert box.take_status("dev01").memory_mb == 4999
    box.on_message(T.device_status("dev01"), DeviceStatus(device="dev01", state="offline").encode())
    assert box.queue.qsize() == 1  # a new change after the last was taken is a new event


def test_repeated_updates_and_evaluations_are_capped_per_client_and_step():
    box = _inbox()
    frame = encode_tensors({"fc.w": torch.ones(3)})
    head = UpdateHeader(run_id="r1", seq=5, round=0, client=0, device="dev01", num_samples=10,
                        chunk=0, chunks=1, size=len(frame), sha256=hashlib.sha256(frame).hexdigest())
    for _ in range(50):
        box.on_message(T.update("dev01", 0, 0), pack_chunk(head, frame))
    assert box.queue.qsize() == UPDATES_PER_CLIENT and box.dropped == 50 - UPDATES_PER_CLIENT
    res = EvalResult(run_id="r1", seq=6, device="dev01", results={}, final=False)
    before = box.queue.qsize()
    for _ in range(100):
        box.on_message(T.evaluation("dev01"), res.encode())
    assert box.queue.qsize() - before == EVALS_PER_CLIENT * 3  # two clients on dev01, plus one
    box.collect(7)  # a new step: its own budget
    head7 = head.model_copy(update={"seq": 7})
    box.on_message(T.update("dev01", 0, 0), pack_chunk(head7, frame))
    assert box.queue.qsize() - before == EVALS_PER_CLIENT * 3 + 1


def test_invalid_messages_on_device_topics_are_reported_for_clearing():
    box = _inbox()
    junk: list[str] = []
    box.on_junk = junk.append
    box.on_message(T.update("dev01", 0, 0), b"\x00junk")
    box.on_message(T.evaluation("dev02"), b'{"v": 3}')
    box.on_message(T.device_status("dev01"), b"not json")  # its own retained topic: kept
    assert junk == [T.update("dev01", 0, 0), T.evaluation("dev02")]
    assert box.queue.qsize() == 0
    assert box.heard == {}  # invalid messages prove nothing about a device being alive
