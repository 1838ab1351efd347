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


@pytest.mark.parametrize("run_id", ["../../etc", "..", ".", ".hidden", "a/b", "", "x" * 200])
def test_unsafe_run_id_rejected(tmp_path, run_id):
    store = StateStore(tmp_path / "state")
    with pytest.raises(ProtocolError):
        store.save(run_id, 1, {"x": torch.ones(1)})
    with pytest.raises(ProtocolError):
        store.load(run_id, 1)
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_a_round_run_again_starts_from_the_state_before_it(tmp_path):
    st = StateStore(tmp_path)
    for r in range(4):
        st.save("run-1", 3, {"h": torch.full((2,), float(r))}, round=r)
    assert float(st.load("run-1", 3)["h"][0]) == 3.0
    assert float(st.load("run-1", 3, before=3)["h"][0]) == 2.0
    assert st.load("run-1", 3, before=2) is None  # only the two newest rounds are kept
    assert len(list((tmp_path / "run-1").iterdir())) == 2


def test_answered_dispatches_survive_a_restart_and_junk_reads_as_none(tmp_path):
    store = StateStore(tmp_path)
    assert store.answered("r1") == {}
    store.answer("r1", {4: 12, 1: 9})
    assert StateStore(tmp_path).answered("r1") == {1: 9, 4: 12}
    (tmp_path / "r1" / "answered.json").write_text('["not", "a", "map"]')
    assert store.answered("r1") == {}
    (tmp_path / "r1" / "answered.json").write_text('{"x": 1')
    assert store.answered("r1") == {}
