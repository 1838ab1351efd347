"""fedseq-server status prints whatever devices left retained as plain lines, and never crashes on
it (hardening III, finding 5)."""

import pytest

from fedseq.common.errors import ProtocolError
from fedseq.common.protocol.messages import DeviceInfo, DeviceStatus
from fedseq.server.ops.status import FleetView, format_fleet


def test_out_of_range_times_and_raw_strings_print_as_plain_lines():
    forged = {
        f"dev0{i}": DeviceStatus.model_construct(
            device=f"dev0{i}", state="online", since=since, package_version="1.0\x1b[2J\nFAKE LINE",
            torch_device="cuda" * 500, memory_mb=1, error="oops\r\nERROR round 7 failed",
            error_seq=3, error_run_id="r", heartbeat_s=15.0, v=8, temp_c=None, throttled=None,
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
    raw = f'{{"v": 8, "device": "d", "state": "online", "since": {since}}}'.encode()
    with pytest.raises(ProtocolError):
        DeviceStatus.decode(raw)
    with pytest.raises(ProtocolError):
        DeviceStatus.decode(b'{"v": 8, "device": "d", "state": "online", "package_version": "'
                            + b"x" * 500 + b'"}')


def _fleet(n: int) -> dict[str, DeviceStatus]:
    """n healthy devices, then a few with each problem."""
    out = {f"jetson{i:04d}": DeviceStatus(device=f"jetson{i:04d}", state="online", since=1.7e9,
                                          temp_c=50.0, throttled=False, mem_available_mb=2000)
           for i in range(n)}
    sick = {"jetson0007": {"state": "offline"}, "jetson0500": {"error": "CUDA out of memory",
                                                                 "error_seq": 9},
            "jetson0012": {"throttled": True, "temp_c": 90.0}, "jetson0999": {"mem_available_mb": 100},
            "jetson0003": {"state": "offline", "error": "missing dataset file"}}
    for name, change in sick.items():
        if name in out:
            out[name] = out[name].model_copy(update=change)
    return out


def test_a_thousand_devices_are_summarized_with_the_sick_ones_first():
    devices = _fleet(1000)
    lines = format_fleet(FleetView(devices=devices), "mqtt://b:1883")
    assert len(lines) < 20  # not a line per device
    text = "\n".join(lines)
    assert "1000 devices: 998 online, 2 offline; 2 with an error, 1 throttled, 1 hot, 1 low memory" in text
    assert "5 need a look (below); 995 healthy devices not listed" in text and "--all" in text
    listed = [line.split()[0] for line in lines if line.startswith("jetson")]
    # worst first (offline, then an error, then throttled, then low memory), by name within
    assert listed == ["jetson0003", "jetson0007", "jetson0500", "jetson0012", "jetson0999"]
    every = format_fleet(FleetView(devices=devices), "mqtt://b:1883", every=True)
    assert sum(line.startswith("jetson") for line in every) == 1000
    assert every[-1] == "998 of 1000 devices online"
    # a testbed-sized fleet keeps its line per device, in name order
    small = format_fleet(FleetView(devices=_fleet(10)), "mqtt://b:1883")
    assert sum(line.startswith("jetson") for line in small) == 10


def test_many_sick_devices_are_listed_up_to_a_bound():
    devices = {n: d.model_copy(update={"state": "offline"}) for n, d in _fleet(400).items()}
    lines = format_fleet(FleetView(devices=devices), "mqtt://b:1883")
    assert "400 need a look, the first 50 below; 0 healthy devices not listed" in "\n".join(lines)
    assert sum(line.startswith("jetson") for line in lines) == 50
