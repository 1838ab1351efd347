import pytest
import torch

from fedseq.client.state import StateStore
from fedseq.common.errors import ProtocolError


def test_personal_blocks_survive_a_new_store(tmp_path):
    w = {"fc2.weight": torch.randn(10, 512), "fc2.bias": torch.randn(10)}
    StateStore(tmp_path).save("run-1", 7, w)
    back = StateStore(tmp_path).load("run-1", 7)  # as after a daemon restart
    assert back is not None and all(torch.equal(back[k], w[k]) for k in w)
    assert StateStore(tmp_path).load("run-1", 8) is None
    assert not list(tmp_path.rglob("*.tmp"))  # written via a temporary file and a rename


def test_unsafe_run_id_rejected(tmp_path):
    with pytest.raises(ProtocolError):
        StateStore(tmp_path).save("../../etc", 1, {"x": torch.ones(1)})
