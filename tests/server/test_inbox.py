"""The coordinator's inbox stays bounded whatever a device sends (unit level, no broker)."""

import hashlib

import torch

from fedseq.common.protocol.frames import FramePool, pack_chunk
from fedseq.common.protocol.messages import DeviceInfo, DeviceStatus, EvalResult, UpdateHeader
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.server.mqtt.inbox import (
    EVALS_PER_CLIENT,
    STACKS_PER_DEVICE,
    UPDATES_PER_CLIENT,
    Inbox,
    StatusArrived,
)

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
    box.on_message(T.evaluation("dev02"), b'{"v": 4}')
    box.on_message(T.device_status("dev01"), b"not json")  # its own retained topic: kept
    assert junk == [T.update("dev01", 0, 0), T.evaluation("dev02")]
    assert box.queue.qsize() == 0
    assert box.heard == {}  # invalid messages prove nothing about a device being alive


def test_device_stacks_keep_each_change_once_and_refuse_another_devices_claim():
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
