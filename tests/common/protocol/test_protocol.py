import hashlib
import re

import pytest
import torch

from fedseq.common.errors import ProtocolError
from fedseq.common.models import build_model, get_blocks
from fedseq.common.protocol.frames import CHUNK_BYTES, Reassembler, pack_chunk, split_frame, unpack_chunk
from fedseq.common.protocol.messages import PROTOCOL_VERSION, Step, UpdateHeader, WeightsHeader
from fedseq.common.protocol.tensors import DTYPES, decode_tensors, encode_tensors, frame_size
from fedseq.common.protocol.topics import TopicRef, Topics


def _chunks(frame: bytes):
    digest = hashlib.sha256(frame).hexdigest()
    parts = split_frame(frame)
    return digest, [
        pack_chunk(WeightsHeader(run_id="r", block="fc1", version=3, chunk=i, chunks=len(parts),
                                 size=len(frame), sha256=digest), p)
        for i, p in enumerate(parts)
    ]


def test_fc1_frame_splits_below_mosquitto_limit_and_reassembles():
    w = get_blocks(build_model("cnn", (1, 28, 28), 10, generator_seed=0), ["fc1"])
    frame = encode_tensors(w)
    assert len(frame) > 2_099_200  # fc1 alone is over Mosquitto 2.1's 2,000,000-byte default
    digest, msgs = _chunks(frame)
    assert len(msgs) == 3 and all(len(m) < 2_000_000 for m in msgs)
    assert all(len(m) <= CHUNK_BYTES + 400 for m in msgs)
    asm = None
    out = None
    for m in reversed(msgs):  # order on the wire does not matter
        head, data = unpack_chunk(m, WeightsHeader)
        asm = asm or Reassembler(head.size, head.sha256, head.chunks)
        out = asm.add(head.chunk, data)
    assert out == frame
    back = decode_tensors(out)
    assert all(torch.equal(back[k], w[k]) for k in w)


def test_corrupted_chunk_is_rejected():
    frame = encode_tensors({"a.w": torch.arange(10.0)})
    digest, (msg,) = _chunks(frame)
    bad = bytearray(msg)
    bad[-1] ^= 0xFF
    head, data = unpack_chunk(bytes(bad), WeightsHeader)
    with pytest.raises(ProtocolError, match="sha256"):
        Reassembler(head.size, head.sha256, head.chunks).add(head.chunk, data)


@pytest.mark.parametrize("payload", [b"", b"\x00\x00", b"\x00\x00\x10\x00{}", b"\x00\x00\x00\x02{}",
                                     b"\x00\x00\x00\x05hello"])
def test_malformed_chunks_are_protocol_errors(payload):
    with pytest.raises(ProtocolError):
        unpack_chunk(payload, UpdateHeader)


def test_messages_validate_strictly():
    s = Step(run_id="r", seq=1, kind="train", round=0, clients=[1, 2])
    assert Step.decode(s.encode()) == s
    v = PROTOCOL_VERSION
    assert s.v == v  # every message says the version this side speaks
    assert Step.decode(b'{"v": %d, "run_id": "r", "seq": 1, "kind": "idle"}' % v).v == v
    for bad in (b"not json", b'{"v": %d, "run_id": "r", "seq": 1, "kind": "train"}' % (v + 1),
                b'{"v": %d, "run_id": "r", "seq": 1, "kind": "dance"}' % v,
                b'{"v": %d, "run_id": "r", "seq": -1, "kind": "train"}' % v,
                b'{"v": %d, "run_id": "r", "seq": 1, "kind": "stop"}' % v,
                b'{"v": %d, "run_id": "r", "seq": 1, "kind": "train", "extra": 1}' % v):
        with pytest.raises(ProtocolError):
            Step.decode(bad)


@pytest.mark.parametrize("header", [b"[]", b"5", b'"x"', b"[" * 100_000 + b"]" * 100_000,
                                    b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}',
                                    b'{"a": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 4]}}',
                                    b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}',
                                    b'{"a": []}',
                                    b'{"a": {"dtype": [], "shape": [], "data_offsets": [0, 4]}}'])
def test_a_malformed_frame_header_is_a_protocol_error(header):
    """Hardening III, finding 12: whatever a header holds, decoding fails with ProtocolError
    (so the coordinator drops and clears the message) and never with another exception."""
    frame = len(header).to_bytes(8, "little") + header + b"\x00" * 4
    with pytest.raises(ProtocolError):
        decode_tensors(frame)


def test_tensor_frames_reject_garbage_and_nan():
    with pytest.raises(ProtocolError):
        decode_tensors(b"garbage")
    with pytest.raises(ProtocolError, match="NaN"):
        decode_tensors(encode_tensors({"x": torch.tensor([float("nan")])}))
    frame = encode_tensors({"x": torch.ones(2)})
    with pytest.raises(ProtocolError, match="sha256"):
        decode_tensors(frame, expected_sha256="0" * 64)


def test_topics():
    t = Topics("fedseq")
    assert t.weights("fc1", 2) == "fedseq/weights/fc1/2"
    assert t.update("jetson01") == "fedseq/update/jetson01"
    assert t.parse(t.update("jetson01")) == TopicRef("update", device="jetson01")
    assert t.parse(t.device_status("jetson07")) == TopicRef("device_status", device="jetson07")
    assert t.parse(t.assignment("jetson07")) == TopicRef("assignment", device="jetson07")
    assert t.parse(t.device_info("jetson07")) == TopicRef("device_info", device="jetson07")
    assert t.parse(t.weights("fc1", 2)) == TopicRef("weights", block="fc1", chunk="2")
    for kind in ("server_status", "run_config", "step", "control"):
        assert t.parse(getattr(t, kind)) == TopicRef(kind)
    assert t.parse(t.evaluation("d1")) == TopicRef("eval", device="d1")
    for junk in ("fedseq", "other/step", "fedseq/eval/d1/extra", "fedseq/update/x/y", "fedseq/update/x/3/0",
                 "fedseq/update/x\nERROR", "fedseq/device/\x1b[2J/status", "fedseq/eval/" + "a" * 65,
                 "fedseq/device//status",
                 "fedseqx/step",
                 "fedseq/device/d1/else", "fedseq/step/1"):
        assert t.parse(junk) is None, junk


def test_every_device_model_is_complete_on_this_python():
    """pydantic evaluates field annotations at run time: a `list[int]` or `X | None` field fails
    on the device's Python 3.8 (.ci/run runs this there). Every model the device uses must be
    fully built at import, and validate a round trip."""
    from pydantic import BaseModel

    from fedseq.client import settings
    from fedseq.common import config
    from fedseq.common.protocol import messages

    models = [obj for mod in (messages, config, settings) for obj in vars(mod).values()
              if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel]
    assert len(models) >= 15
    for model in models:
        assert model.__pydantic_complete__, model
        model.model_json_schema()  # resolves every field's type
    step = Step(run_id="r", seq=1, round=0, kind="train", clients=[1, 2],
                versions={"fc1": 3}, eval_heads=["fc2"])
    assert Step.model_validate_json(step.model_dump_json()) == step


def test_frame_size_is_the_encoded_length_without_encoding():
    """Every dtype, empty and scalar tensors, names that sort differently as bytes and as
    characters or need JSON escapes, and sizes whose offsets change digit counts: the size from
    the header equals the length safetensors writes, and the models' frames too."""
    gen = torch.Generator().manual_seed(0)
    names = ["w", "a.b", "Z", "é", "ü.weight", 'q"uote', "tab\tx", "ctl\x01", "\u65e5", "b" * 40]
    for trial in range(200):
        k = int(torch.randint(0, 8, (1,), generator=gen))
        weights = {}
        for i in range(k):
            dtype = list(DTYPES.values())[int(torch.randint(0, len(DTYPES), (1,), generator=gen))]
            shape = [int(d) for d in torch.randint(0, 6, (int(torch.randint(0, 4, (1,),
                                                                            generator=gen)),),
                                                   generator=gen)]
            if trial % 7 == 0 and shape:
                shape[0] *= 1000  # offsets of more digits
            weights[f"{names[(trial + i) % len(names)]}{i}"] = torch.zeros(shape, dtype=dtype)
        assert frame_size(weights) == len(encode_tensors(weights)), weights.keys()
    for name in ("cnn", "convnet", "4convnet"):
        model = build_model(name, (1, 28, 28), 10, True)
        for b in model.spec.blocks:
            part = get_blocks(model, [b])
            assert frame_size(part) == len(encode_tensors(part))


def test_a_frame_listing_more_tensors_than_an_update_holds_is_refused_before_parsing(monkeypatch):
    """Hardening V, finding 5: a frame of a run's size whose header lists ~38,500 empty tensors
    cost the network thread ~0.45 s to decode and held ~24x its size as tensor objects. With
    max_tensors (every shared tensor an update may carry) its header's length is refused before
    it is parsed, and a header within that length but with too many entries before any tensor is
    built; an honest frame passes."""
    import json

    from fedseq.common.protocol import tensors

    many = {f"t{i}": torch.empty(0) for i in range(38500)}
    frame = encode_tensors(many)
    parsed = []
    real = json.loads
    monkeypatch.setattr(tensors.json, "loads", lambda raw: parsed.append(len(raw)) or real(raw))
    with pytest.raises(ProtocolError, match="more than 20 tensors need"):
        decode_tensors(frame, max_tensors=20)
    assert parsed == []  # refused unparsed
    few = encode_tensors({f"t{i}": torch.empty(0) for i in range(30)})
    with pytest.raises(ProtocolError, match="30 tensors, more than the 20"):
        decode_tensors(few, max_tensors=20)
    honest = encode_tensors({"w": torch.ones(3, 4), "b": torch.zeros(4)})
    assert set(decode_tensors(honest, max_tensors=2)) == {"w", "b"}


def test_fields_added_within_the_protocol_are_left_out_at_their_default():
    """A device or coordinator of this protocol from before a field refuses unknown fields:
    such a field is sent only when it says something (data.placement = "device")."""
    from fedseq.common.protocol.messages import Assignment, DeviceStatus, EvalResult, Message

    plain = [Assignment(run_id="r", device="d", clients=[1]), DeviceStatus(device="d", state="online"),
             EvalResult(run_id="r", seq=1, device="d", results={1: (2, 3)})]
    for m in plain:
        assert m.since_current and not any(f'"{f}"' in m.encode().decode() for f in m.since_current)
        assert type(m).decode(m.encode()) == m
    placed = Assignment(run_id="r", device="d", clients=[1], folders=["cam-a"])
    assert '"folders":["cam-a"]' in placed.encode().decode() and Assignment.decode(placed.encode()) == placed
    assert all(f in cls.model_fields for cls in Message.__subclasses__() for f in cls.since_current)


@pytest.mark.parametrize("payload, words", [
    # 2**63 announced rows crashed the coordinator before round 0 (torch.tensor overflowed)
    (b'{"v":9,"device":"d","state":"online","data":{"run_id":"r","clients":[{"folder":".",'
     b'"train":9223372036854775808,"test":1,"counts":[1]}]}}', "less than or equal to 1000000000"),
    (b'{"v":9,"device":"d","state":"online","data":{"run_id":"r","clients":[{"folder":".",'
     b'"train":5,"test":1,"counts":[-4, 9]}]}}', "greater than or equal to 0"),
    (b'{"v":9,"device":"d","state":"online","temp_c":NaN}', "temp_c holds a number that is not finite"),
    (b'{"v":9,"device":"d","state":"online","last_round_j":1e999}', "not finite"),
    (b'{"v":9,"device":"d","state":"online","memory_mb":99999999999999999999}', "beyond 2**53"),
])
def test_every_number_from_the_wire_is_finite_and_bounded(payload, words):
    """Hardening VII, findings 4-5: every float that crosses the wire is refused when it is not
    finite, and every integer has an upper bound (a client's rows at most MAX_ROWS, anything
    else 2**53), when the message is parsed, however deep it sits."""
    from fedseq.common.protocol.messages import DeviceStatus

    with pytest.raises(ProtocolError, match=re.escape(words)):
        DeviceStatus.decode(payload)


def test_numbers_in_free_form_fields_are_bounded_too():
    """A plan or a secure stage travels as free-form JSON: a NaN in it is refused on parse as
    in a typed field; a message built here with one still encodes (pydantic writes null)."""
    from fedseq.common.protocol.messages import DeviceStatus, SiteResultHeader

    step = Step(run_id="r", seq=1, kind="train", round=0, clients=[0], plan={"lr": 0.1})
    assert Step.decode(step.encode()).plan == {"lr": 0.1}
    with pytest.raises(ProtocolError, match="plan holds a number that is not finite"):
        Step.decode(step.encode().replace(b"0.1", b"NaN"))
    head = SiteResultHeader(run_id="r", site="a", seq=1, weights={"w": 2.0}, chunk=0, chunks=1,
                            size=0, sha256="0" * 64)
    with pytest.raises(ProtocolError, match="weights holds a number that is not finite"):
        SiteResultHeader.decode(head.encode().replace(b"2.0", b"-Infinity"))
    sent = DeviceStatus(device="d", state="online", temp_c=float("nan")).encode()
    assert DeviceStatus.decode(sent).temp_c is None


def test_an_update_and_its_header_convert_one_way_each_and_back():
    """Issue 93, a typed wire: the device says its ClientUpdate and DeviceCost in the header with
    `fields_of`, the coordinator reads the same update back with `to_update`; every field
    survives the wire's JSON."""
    from fedseq.common.algorithms.aggregate import ClientUpdate, DeviceCost

    cost = DeviceCost(energy_j=1.5, energy_w=3.0, energy_rails={"gpu": 0.5}, energy_source="ina",
                      max_temp_c=51.0, throttled=False, gpu_load=0.25, mem_available_mb=900)
    sent = ClientUpdate(3, 7, {}, 120, effective_samples=96, train_seconds=2.5,
                        local_score=(30, 40), diverged_at=None, under_clip=True)
    head = UpdateHeader(run_id="r", seq=9, device="jetson01", chunk=0, chunks=1, size=0,
                        sha256="0" * 64, **UpdateHeader.fields_of(sent, cost))
    back = UpdateHeader.decode(head.encode()).to_update({}, "jetson01", cost)
    assert back == ClientUpdate(3, 7, {}, 120, effective_samples=96, train_seconds=2.5,
                                local_score=(30, 40), device="jetson01", cost=cost,
                                under_clip=True)
    bare = UpdateHeader(run_id="r", seq=9, device="d", chunk=0, chunks=1, size=0, sha256="0" * 64,
                        **UpdateHeader.fields_of(ClientUpdate(0, 1, {}, 5)))
    assert bare.to_update({}, "d").local_score is None and bare.energy_j is None
