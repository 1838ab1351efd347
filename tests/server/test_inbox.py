"""The coordinator's inbox stays bounded whatever a device sends (unit level, no broker)."""

import hashlib
import json
import math
import queue

import pytest
import torch

from fedseq.common.protocol.frames import (
    CHUNK_BYTES,
    CHUNK_MESSAGE_BYTES,
    pack_chunk,
    split_frame,
)
from fedseq.common.protocol.messages import DeviceInfo, DeviceStatus, EvalResult, UpdateHeader
from fedseq.common.protocol.tensors import encode_tensors
from fedseq.common.protocol.topics import Topics
from fedseq.server.pools.mqtt import budget, inbox
from fedseq.server.pools.mqtt.budget import Allowance
from fedseq.server.pools.mqtt.inbox import (
    EVALS_PER_CLIENT,
    STACKS_PER_DEVICE,
    STATUS_BYTES,
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
    """No budget: these tests send thousands of messages at once to test the other bounds."""
    monkeypatch.setattr(inbox, "allowance", lambda clients, update: Allowance(1e18, 1e18, 1e18, 1e18))


def _inbox(update_bytes: int = 1 << 20, box: Inbox | None = None, **kw) -> Inbox:
    """An inbox of run r1 (`box`: this one) with clients 0-1 on dev01 and 2 on dev02, collecting
    step 5."""
    box = box or Inbox(T, "r1", **kw)
    box.open({0: "dev01", 1: "dev01", 2: "dev02"}, update_bytes)
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
    junk: list[str] = []
    box = _inbox(on_junk=junk.append)
    many = EvalResult(run_id="r1", seq=5, device="dev01", results={c: (1, 2) for c in range(100_000)})
    box.on_message(T.evaluation("dev01"), many.encode())
    assert junk == [T.evaluation("dev01")] and box.queue.qsize() == 0


def test_a_status_is_never_lost_to_a_full_queue(unlimited):
    """Hardening III, finding 2: when the queue is full (here made tiny), a device's status still
    reaches presence, and so do its later ones (its coalescing never sticks)."""
    from fedseq.server.pools.mqtt.broker_session import ServerSession

    session = ServerSession(T, "r1", "mqtt://127.0.0.1:1")
    box = _inbox(box=session.inbox)
    box.queue = queue.Queue(2)
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
    forged = '{"v": 8, "device": "dev01", "state": "online", "x\\nERROR round 7 failed\\u001b[2J": 1}'
    with caplog.at_level("WARNING", logger="fedseq.server.pools.mqtt.inbox"):
        for _ in range(500):
            box.on_message(T.device_status("dev01"), forged.encode())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == WARNINGS_PER_MINUTE, len(lines)
    assert all("\n" not in x and "\x1b" not in x for x in lines), lines[0]


def test_invalid_messages_on_device_topics_are_reported_for_clearing():
    junk: list[str] = []
    box = _inbox(on_junk=junk.append)
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


def test_a_device_past_its_bytes_is_dropped_unread(monkeypatch):
    """Hardening IV, finding 1: a device's budget counts bytes (plus MESSAGE_BYTES a message),
    not messages: past its burst its messages are dropped before they are parsed; another
    device is not affected, and the budget refills with time."""
    box = _inbox()
    clock = [1000.0]
    monkeypatch.setattr(box.budgets, "clock", lambda: clock[0])
    monkeypatch.setattr(inbox, "thread_seconds", lambda: 0.0)  # bytes alone here
    a = box.allowance("dev01")
    status = DeviceStatus(device="dev01", state="online").encode()
    cost = len(status) + budget.MESSAGE_BYTES
    fits = int(a.burst_bytes // cost)
    for i in range(fits + 500):
        box.on_message(T.device_status("dev01"), DeviceStatus(device="dev01", state="online",
                                                              memory_mb=i % 10).encode())
    assert box.flooded == 500
    box.on_message(T.device_status("dev02"), DeviceStatus(device="dev02", state="online").encode())
    assert "dev02" in [st.device for st in box.take_statuses()]
    clock[0] += 1.0  # one second: rate_bytes more
    for _ in range(3000):
        box.on_message(T.device_status("dev01"), status)
    assert box.flooded == 500 + 3000 - int((a.burst_bytes - fits * cost + a.rate_bytes) // cost)


def test_empty_messages_are_charged_and_a_flood_of_them_reaches_the_guard(monkeypatch):
    """Hardening VI, finding 1: an empty message costs MESSAGE_BYTES like any other, so a flood of
    them is dropped past the device's burst and each drop is reported to the guard (before, empty
    payloads returned first: nothing dropped, nothing counted); another device still gets in."""
    box = _inbox()
    clock = [1000.0]
    monkeypatch.setattr(box.budgets, "clock", lambda: clock[0])
    monkeypatch.setattr(inbox, "thread_seconds", lambda: 0.0)
    reported: list[str] = []
    box.on_flood = reported.append
    fits = int(box.allowance("dev01").burst_bytes // budget.MESSAGE_BYTES)
    for _ in range(fits + 300):
        box.on_message(T.device_status("dev01"), b"")
    assert box.flooded == 300 and reported == ["dev01"] * 300
    assert box.queue.qsize() == 0 and box.take_statuses() == []
    box.on_message(T.device_status("dev02"), DeviceStatus(device="dev02", state="online").encode())
    assert "dev02" in [st.device for st in box.take_statuses()]


def test_big_junk_is_refused_by_its_size_and_never_parsed(monkeypatch):
    """Hardening IV, finding 1: a status, description or evaluation larger than its topic can
    carry is refused before any parsing, and a refused message is not parsed a second time to
    learn its protocol version; a small one of another version says which, from its one parse."""
    parsed: list[str] = []
    for cls in (DeviceStatus, DeviceInfo, EvalResult):
        monkeypatch.setattr(cls, "decode", classmethod(lambda c, p: parsed.append(c.__name__)))
    monkeypatch.setattr(json, "loads", lambda *a, **k: parsed.append("json"))
    box = _inbox()
    junk = b'{"v": 4, "device": "dev01", "x": "' + b"y" * (STATUS_BYTES + 1) + b'"}'
    for topic in (T.device_status("dev01"), T.device_info("dev01"), T.evaluation("dev01")):
        box.on_message(topic, junk)
    assert parsed == [] and box.queue.qsize() == 0 and box.flooded == 0


def test_a_peer_of_another_protocol_is_named_from_one_parse(caplog):
    box = _inbox()
    with caplog.at_level("WARNING", logger="fedseq.server.pools.mqtt.inbox"):
        box.on_message(T.device_status("dev01"), b'{"v": 4, "device": "dev01", "state": "online"}')
    assert "it speaks protocol v4" in caplog.text


def test_a_device_past_its_cpu_is_dropped_unread(monkeypatch):
    """Messages that cost the network thread more than their bytes (here every message is made
    to take 10 ms of its CPU) are bounded by the device's CPU budget: past its burst they are
    dropped unread until it refills; another device still gets in."""
    box = _inbox()
    cpu = [0.0]

    def thread_seconds():
        cpu[0] += 0.01  # read before and after each message: 10 ms a message
        return cpu[0]

    monkeypatch.setattr(inbox, "thread_seconds", thread_seconds)
    clock = [1000.0]
    monkeypatch.setattr(box.budgets, "clock", lambda: clock[0])
    a = box.allowance("dev01")
    status = DeviceStatus(device="dev01", state="online").encode()
    for _ in range(200):
        box.on_message(T.device_status("dev01"), status)
    read = 200 - box.flooded
    assert read == math.ceil(a.burst_cpu / 0.01), (read, a)
    box.on_message(T.device_status("dev02"), DeviceStatus(device="dev02", state="online").encode())
    assert "dev02" in box.heard


def test_a_big_models_updates_fit_the_budget_all_at_once(monkeypatch):
    """A device answers a step and a resend with every client's update at once: with ResNet-34's
    82 chunks an update, its three clients' 2 x 246 chunk messages fit its bytes and (at 3 ms a
    MB) its CPU; three times that in the same instant does not, and a round's worth is back
    within UPDATE_SPACING_S seconds."""
    box = Inbox(T, "r1")
    box.open({0: "dev01", 1: "dev01", 2: "dev01"}, 82 << 20)
    clock = [1000.0]
    monkeypatch.setattr(box.budgets, "clock", lambda: clock[0])
    a = box.allowance("dev01")

    def send_all(updates: int = 3) -> int:
        ok = 0
        for _ in range(updates * 82):
            ok += box.budgets.admit("dev01", CHUNK_MESSAGE_BYTES, a)
            box.budgets.spent("dev01", 0.003)  # 3 ms a 1 MiB chunk: checksum, copies, decoding
        for _ in range(30):  # and a few statuses and evaluations
            ok += box.budgets.admit("dev01", 300, a)
        return ok

    assert send_all(6) == 6 * 82 + 30
    assert send_all() < 3 * 82
    clock[0] += budget.UPDATE_SPACING_S
    assert send_all() == 3 * 82 + 30


def _update_chunks(device: str, client: int, frame: bytes, seq: int = 5, sha: str | None = None):
    parts = split_frame(frame)
    meta = dict(run_id="r1", seq=seq, round=0, client=client, device=device, num_samples=10,
                chunks=len(parts), size=len(frame), sha256=sha or hashlib.sha256(frame).hexdigest())
    return [pack_chunk(UpdateHeader(chunk=i, **meta), p) for i, p in enumerate(parts)]


def test_dropped_frames_give_their_spool_space_back(unlimited):
    """Hardening IV, finding 2: frames whose chunks were spooled and then dropped (a sha256
    mismatch; refused by the queue's per-client cap) free their room in the spool file, which
    later frames reuse: however long a device keeps sending them, the file does not grow past
    what waits at once."""
    frame = encode_tensors({"w": torch.arange(700_000, dtype=torch.float32)})  # 2.8 MB, 3 chunks
    box = _inbox(len(frame) + 4096)
    box.spool.budget = 1  # everything past the first frame goes to the file
    box.frames.budget = 0  # and every partial frame's chunks
    for _ in range(40):
        for m in _update_chunks("dev01", 0, frame, sha="0" * 64):  # never completes
            box.on_message(T.update("dev01"), m)
        for m in _update_chunks("dev01", 1, frame):  # valid, refused past UPDATES_PER_CLIENT
            box.on_message(T.update("dev01"), m)
    assert box.spool.file_bytes <= (UPDATES_PER_CLIENT + 2) * 3 * CHUNK_BYTES, box.spool.file_bytes
    while (ev := box.next_event(0)) is not None:
        box.release(ev)
    assert box.spool.used_bytes == 0 and box.spool.in_memory == 0
    assert box.frames.in_memory == 0


def test_a_device_cannot_hold_more_complete_frames_than_its_share(unlimited):
    """Complete frames waiting to be folded in count against their device's share (one whole
    update per client it holds, and one more): past it, its frames are refused before they are
    kept, and another device's still get in; folding one in gives its room back."""
    frame = encode_tensors({"w": torch.arange(400_000, dtype=torch.float32)})  # 1.6 MB, 2 chunks
    box = _inbox(len(frame) + 4096)
    box.open({c: ("dev01" if c < 2 else "dev02") for c in range(3)}, len(frame) + 4096)
    box.collect(5)
    assert box.frame_cap("dev01") == 3 * (len(frame) + 4096)
    for _ in range(UPDATES_PER_CLIENT):  # valid-looking frames of its two clients, queued
        for c in (0, 1):
            for m in _update_chunks("dev01", c, frame):
                box.on_message(T.update("dev01"), m)
    assert box.queue.qsize() == 3  # its share: three frames
    for m in _update_chunks("dev02", 2, frame):
        box.on_message(T.update("dev02"), m)
    events = []
    while (ev := box.next_event(0)) is not None:
        events.append(ev)
    assert [e.device for e in events] == ["dev01"] * 3 + ["dev02"]
    box.release(events[0])
    for m in _update_chunks("dev01", 1, frame):
        box.on_message(T.update("dev01"), m)
    assert box.queue.qsize() == 1
    box.collect(6)  # a new step: its own shares; the old step's frames given back count nothing
    for _ in range(UPDATES_PER_CLIENT):
        for c in (0, 1):
            for m in _update_chunks("dev01", c, frame, seq=6):
                box.on_message(T.update("dev01"), m)
    for ev in events[1:]:
        box.release(ev)
    for m in _update_chunks("dev01", 0, frame, seq=6):
        box.on_message(T.update("dev01"), m)
    assert box.queue.qsize() == 1 + 3  # the old one left over, and three frames of step 6


def test_names_outside_the_fleet_do_not_grow_the_bookkeeping():
    """Hardening IV, finding 7: on an open broker anyone can invent device names; the inbox keeps
    per-name state (budgets, warnings, last heard, stacks) for at most MAX_STRANGERS of them
    besides the fleet's, and the fleet's own are never forgotten."""
    box = _inbox()
    box.on_message(T.device_status("dev01"), DeviceStatus(device="dev01", state="online").encode())
    for i in range(5000):
        name = f"x{i}"
        box.on_message(T.device_status(name), DeviceStatus(device=name, state="offline").encode())
        box.on_message(T.device_info(name), DeviceInfo(device=name).encode())
        box.on_message(T.device_status(name), b"junk")
    box.take_statuses()
    for d in (box.budgets.logins(), box.heard, box._warned, box._stacks):
        assert len(d) <= inbox.MAX_STRANGERS + 2, len(d)
    assert "dev01" in box.heard and box.budgets.known("dev01")


def test_a_devices_version_is_logged_as_one_plain_line(caplog):
    """Hardening IV, finding 5: the fedseq version a device's status claims is its words: a
    forged log line with escapes stays one plain line of the coordinator's log."""
    from fedseq.server.pools.mqtt.mqtt_pool import warn_other_versions

    forged = "1.0\nERROR fedseq.server.rounds.coordinator: round 7 failed\x1b[2J"
    with caplog.at_level("WARNING", logger="fedseq.server.pools.mqtt.mqtt_pool"):
        warn_other_versions({"dev01": DeviceStatus(device="dev01", state="online",
                                                   package_version=forged)})
    [line] = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x1b" not in line and "round 7 failed" in line


def test_names_that_say_online_are_bounded_before_and_during_a_run(monkeypatch):
    """Hardening V, finding 9: before a run opens every name that said "online" was kept (449 MB
    for 20,000 invented names on an open broker); now at most MAX_PRESENT are (here made 50), and
    once a run opens only its fleet's statuses and presence are kept."""
    monkeypatch.setattr(inbox, "MAX_PRESENT", 50)
    box = Inbox(T, "r1")
    monkeypatch.setattr(box, "allowance", lambda device: Allowance(1e12, 1e12, 1e3, 1e3))
    for i in range(500):
        name = f"x{i}"
        box.on_message(T.device_status(name), DeviceStatus(device=name, state="online").encode())
    assert len(box._present) <= 50 and len(box._status) <= 50
    kept = box.take_statuses()
    assert len(kept) <= 50
    box.open({0: "x0", 1: "x1"}, 1 << 20)
    assert box._present <= {"x0", "x1"}
    for i in range(500, 600):
        name = f"x{i}"
        box.on_message(T.device_status(name), DeviceStatus(device=name, state="online").encode())
    box.on_message(T.device_status("x1"), DeviceStatus(device="x1", state="online").encode())
    assert [s.device for s in box.take_statuses()] == ["x1"]


def test_secure_stages_are_taken_only_for_the_round_under_way_and_within_their_size(
        unlimited, caplog):
    """A stage message before a secure round, for another round, over its size (per client and
    neighbour), naming another device, or of another run is dropped unread or with its reason;
    one of the round under way is one event, and the same stage again is capped."""
    from fedseq.common.protocol.messages import SecAggMessage
    from fedseq.server.pools.mqtt.inbox import SECAGG_BYTES_BASE, SECAGG_BYTES_PER_PAIR, SecAggArrived

    box = _inbox()

    def stage(device="dev01", seq=6, run="r1", items=None):
        return SecAggMessage(run_id=run, seq=seq, stage="keys", device=device,
                             items=items or {0: ["a", "b"]}).encode()

    box.on_message(T.secagg("dev01"), stage())
    assert box.queue.empty() and "no secure round is under way" in caplog.text
    box.secure(6, degree=4)
    box.on_message(T.secagg("dev01"), stage(seq=5))  # a round that is over
    box.on_message(T.secagg("dev01"), stage(device="dev02"))  # a body naming another device
    box.on_message(T.secagg("dev01"), stage(run="r0"))
    limit = SECAGG_BYTES_BASE + SECAGG_BYTES_PER_PAIR * 2 * 5
    box.on_message(T.secagg("dev01"), stage(items={0: ["x" * limit]}))
    assert box.queue.empty() and f"may send at most {limit}" in caplog.text
    for _ in range(5):
        box.on_message(T.secagg("dev01"), stage())
    events = [box.next_event(0) for _ in range(box.queue.qsize())]
    assert len(events) == 2 and all(isinstance(e, SecAggArrived) for e in events)
    assert events[0].device == "dev01" and events[0].message.items == {0: ["a", "b"]}
    box.secure(-1)
    box.on_message(T.secagg("dev01"), stage())
    assert box.queue.empty()


def test_an_honest_device_is_never_dropped_at_any_round_pace(monkeypatch):
    """Hardening VII, finding 7: a lab's small model ran rounds of about 0.1 s, and every honest
    device was dropped ("it sends more than a device needs"), each drop turning a round into
    2 s: the budget refilled per second, whatever the run asked. Now each step grants the
    devices it asks what their answers take (Inbox.expect): 1,000 rounds of 0.05 s, each with
    three clients' update chunks, evaluations and a status, drop nothing; a device that sends
    ten times what it is asked is still dropped."""
    box = Inbox(T, "r1")
    box.open({0: "dev01", 1: "dev01", 2: "dev01", 3: "dev02"}, 20 << 10)  # a 20 KiB update
    clock = [1000.0]
    monkeypatch.setattr(box.budgets, "clock", lambda: clock[0])
    a = box.allowance("dev01")

    def answer(times: int = 1) -> int:
        ok = 0
        for _ in range(times):
            for _ in range(3):  # an update chunk (the frame and its header) and an evaluation
                ok += box.budgets.admit("dev01", (20 << 10) + 700, a)
                box.budgets.spent("dev01", 0.001)
                ok += box.budgets.admit("dev01", 200, a)
                box.budgets.spent("dev01", 0.0002)
            ok += box.budgets.admit("dev01", 400, a)  # a status
        return ok

    for _ in range(1000):
        box.expect([0, 1, 2, 3])
        assert answer() == 7
        clock[0] += 0.05
    box.expect([3])  # a step that asks nothing of dev01 grants it nothing
    assert answer(40) < 40 * 7
    for _ in range(20):
        box.expect([0, 1, 2])
        answer(10)
        clock[0] += 0.05
    box.expect([0, 1, 2])
    assert answer(10) < 10 * 7


def test_an_empty_message_is_charged_the_cpu_it_takes(monkeypatch):
    """Hardening VII, finding 7: empty messages were charged bytes but no CPU time, so an empty
    flood reached the guard later than one of 7-byte messages. Every message read is charged
    the network thread's time from its arrival: with bytes unbounded, empties are dropped once
    the CPU burst is spent, as 7-byte ones are."""
    monkeypatch.setattr(inbox, "allowance",
                        lambda clients, update: Allowance(1e18, 1e18, 0.001, 0.0))
    cpu = [0.0]

    def thread_seconds():
        cpu[0] += 0.00001  # 10 us between two readings
        return cpu[0]

    monkeypatch.setattr(inbox, "thread_seconds", thread_seconds)
    dropped = []
    for payload in (b"", b"junk!!!"):
        box = _inbox()
        for _ in range(1000):
            box.on_message(T.device_status("dev01"), payload)
        dropped.append(box.flooded)
    assert 890 <= dropped[1] <= dropped[0] < 1000, dropped  # (before: no empty one dropped)


def test_a_status_that_cannot_be_read_is_remembered_until_a_readable_one_comes():
    """Hardening VII, finding 4: 2**63 announced rows made the coordinator crash before round 0.
    Such a status is refused when parsed; the inbox keeps why, so the run's gathering leaves the
    device out at once in one line (MqttPool.announcement) instead of waiting it out, and a
    readable status from it forgets it."""
    box = _inbox()
    big = (b'{"v":9,"device":"dev01","state":"online","data":{"run_id":"r1","clients":[{"folder":'
           b'".","train":9223372036854775808,"test":1,"counts":[1]}]}}')
    box.on_message(T.device_status("dev01"), big)
    assert "clients.0.train: Input should be less than or equal to 1000000000" in \
        box.unreadable["dev01"]
    box.on_message(T.device_status("dev01"), DeviceStatus(device="dev01", state="online").encode())
    assert box.unreadable == {}
