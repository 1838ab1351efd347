"""fedseq-server status prints whatever devices left retained as plain lines, and never crashes on
it (hardening III, finding 5)."""

import pytest

from fedseq.common.errors import ProtocolError
from fedseq.common.protocol.messages import DeviceInfo, DeviceStatus
from fedseq.server.status import FleetView, format_fleet


def test_out_of_range_times_and_raw_strings_print_as_plain_lines():
    forged = {
        f"dev0{i}": DeviceStatus.model_construct(
            device=f"dev0{i}", state="online", since=since, package_version="1.0\x1b[2J\nFAKE LINE",
            torch_device="cuda" * 500, memory_mb=1, error="oops\r\nERROR round 7 failed",
            error_seq=3, error_run_id="r", heartbeat_s=15.0, v=5, temp_c=None, throttled=None,
            gpu_load=None, mem_available_mb=None, energy_source="\x1b]8;;http://x\x07link",
            last_round_j=None)
        for i, since in enumerate([float("inf"), float("nan"), 1e300, -1e300, 1.7e9])}
    stacks = {"dev01": DeviceInfo(device="dev01", torch="1.12\n\x1b[31m")}
    lines = format_fleet(FleetView(devices=forged, stacks=stacks), "mqtt://b:1883")
    text = "\n".join(lines)
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert len(lines) == 1 + 1 + len(forged) + 1  # broker line, header, one per device, count
    assert not any(line.startswith(("FAKE", "ERROR")) for line in lines)
    assert max(len(line) for line in lines) < 600


@pytest.mark.parametrize("since", ["Infinity", "NaN", "1e300", "-5"])
def test_a_status_claiming_an_impossible_time_is_refused(since):
    raw = f'{{"v": 5, "device": "d", "state": "online", "since": {since}}}'.encode()
    with pytest.raises(ProtocolError):
        DeviceStatus.decode(raw)
    with pytest.raises(ProtocolError):
        DeviceStatus.decode(b'{"v": 5, "device": "d", "state": "online", "package_version": "'
                            + b"x" * 500 + b'"}')
