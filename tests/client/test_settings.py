import pytest

from fedseq.client.settings import load_settings
from fedseq.common.errors import ConfigError


def test_file_then_environment_then_flags(tmp_path):
    cfg = tmp_path / "client.toml"
    cfg.write_text('device = "jetson01"\nbroker = "mqtt://laptop:1883"\nthreads = 2\n'
                   'state_dir = "/var/lib/fedseq/state"\n')
    s = load_settings(cfg, {}, environ={})
    assert (s.device, s.broker, s.threads) == ("jetson01", "mqtt://laptop:1883", 2)
    s = load_settings(cfg, {}, environ={"FEDSEQ_BROKER": "mqtt://other:1884", "FEDSEQ_THREADS": "4"})
    assert s.broker == "mqtt://other:1884" and s.threads == 4
    s = load_settings(cfg, {"broker": "mqtt://flag:1", "threads": None},
                      environ={"FEDSEQ_BROKER": "mqtt://other:1884"})
    assert s.broker == "mqtt://flag:1" and s.threads == 2


@pytest.mark.parametrize("values, needle", [
    ({}, "device"), ({"device": "bad name!"}, "device"),
    ({"device": "j1", "torch_device": "tpu"}, "torch_device"),
])
def test_bad_settings_are_one_line(values, needle):
    with pytest.raises(ConfigError) as info:
        load_settings(None, values, environ={})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_unknown_key_in_file(tmp_path):
    cfg = tmp_path / "client.toml"
    cfg.write_text('device = "j1"\nbrokr = "x"\n')
    with pytest.raises(ConfigError, match="brokr"):
        load_settings(cfg, {}, environ={})
