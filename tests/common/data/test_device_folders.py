"""Data on the devices (common/data/placed.py): a device's folder layouts, what it announces,
and what the coordinator refuses of an announcement."""

from __future__ import annotations

import numpy as np
import pytest

from fedseq.common.config import load_config
from fedseq.common.data.federated import announced_data, placed_data
from fedseq.common.data.placed import (
    ClientData,
    announce,
    announcement_problem,
    client_folders,
    device_folders,
    read_client,
    roster,
)
from fedseq.common.errors import ConfigError, DatasetError


def npz_client(folder, n_train, n_test, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for part, n in (("train", n_train), ("test", n_test)):
        if n:
            np.savez(folder / f"{part}.npz", x=rng.integers(0, 255, (n, 1, 4, 4), dtype=np.uint8),
                     y=rng.integers(0, classes, n))


def data_cfg(*more):
    return load_config(None, ['data.placement="device"', 'data.dataset="npz"',
                              "data.options.shape=[1,4,4]", "data.options.classes=3", *more]).data


def test_a_data_folder_is_one_client_or_one_subfolder_per_client(tmp_path):
    npz_client(tmp_path / "one", 5, 2)
    assert client_folders(tmp_path / "one") == [(".", tmp_path / "one")]
    npz_client(tmp_path / "many" / "cam-b", 5, 2)
    npz_client(tmp_path / "many" / "cam-a", 5, 0)
    (tmp_path / "many" / "notes").mkdir()  # no train part: not a client
    assert [n for n, _ in client_folders(tmp_path / "many")] == ["cam-a", "cam-b"]


@pytest.mark.parametrize("case, words", [
    ("missing", "no such data folder"),
    ("empty", "no train part"),
    ("twice", "keep one"),
])
def test_a_data_folder_that_cannot_be_read_is_one_line(tmp_path, case, words):
    root = tmp_path / "d"
    if case != "missing":
        root.mkdir()
    if case == "twice":
        npz_client(root, 3, 1)
        (root / "train.csv").write_text("label,a\n")
    with pytest.raises(DatasetError, match=words) as exc:
        client_folders(root)
    assert "\n" not in str(exc.value)


def test_a_client_reads_its_train_then_test_rows_capped_and_announces_them(tmp_path):
    npz_client(tmp_path / "c", 7, 4, seed=3)
    raw = read_client(data_cfg(), tmp_path / "c")
    assert (raw.num_train, len(raw.labels)) == (7, 11)
    with np.load(tmp_path / "c" / "train.npz") as f:
        assert np.array_equal(raw.images[:7], f["x"]) and np.array_equal(raw.labels[:7], f["y"])
    capped = read_client(data_cfg("data.max_rows_per_client=5"), tmp_path / "c")
    assert (capped.num_train, len(capped.labels)) == (5, 9)
    said = announce(capped, "c")
    assert (said.train, said.test, sum(said.counts), len(said.counts)) == (5, 4, 5, 3)
    assert said.counts == tuple(np.bincount(capped.labels[:5], minlength=3))
    assert ClientData.from_dict(said.to_dict()) == said


def test_a_broken_file_in_a_client_folder_is_named(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "train.npz").write_bytes(b"not a zip")
    with pytest.raises(DatasetError, match="train.npz: not a readable .npz file"):
        read_client(data_cfg(), tmp_path / "c")


def test_clients_are_numbered_by_device_then_folder():
    def c(folder):
        return ClientData(folder, 1, 0, (1, 0, 0))

    order = roster({"dev-b": [c("y"), c("x")], "dev-a": [c(".")]})
    assert [(d, x.folder) for d, x in order] == [("dev-a", "."), ("dev-b", "x"), ("dev-b", "y")]


@pytest.mark.parametrize("clients, words", [
    ([], "no client"),
    ([ClientData("a", 3, 1, (1, 1, 1)), ClientData("a", 3, 1, (1, 1, 1))], "twice"),
    ([ClientData("a", 3, 1, (1, 1))], "not 3 counts"),
    ([ClientData("a", 3, 1, (1, 1, 2))], "summing to its 3"),
    ([ClientData("a", 0, 1, (0, 0, 0))], "0 training"),
    ([ClientData("../x", 3, 1, (1, 1, 1))], "not a plain name"),
    ([ClientData("a", 9, 1, (3, 3, 3))], "max_rows_per_client = 5"),
])
def test_an_announcement_that_cannot_be_true_is_refused(clients, words):
    why = announcement_problem(data_cfg("data.max_rows_per_client=5"), clients)
    assert why is not None and words in why, why


def test_the_coordinator_holds_the_validation_rows_and_no_clients_row(tmp_path):
    npz_client(tmp_path / "val", 6, 0)
    cfg = data_cfg(f"data.root={str(tmp_path)!r}")
    clients = [ClientData(".", 40, 10, (20, 10, 10)), ClientData("b", 8, 2, (0, 8, 0))]
    val = read_client(cfg, tmp_path / "val")
    data = announced_data(cfg, clients, val)
    assert len(data.x) == 6 and data.validation is not None and len(data.validation) == 6
    assert [(s.num_train, s.num_test) for s in data.clients] == [(40, 10), (8, 2)]
    assert data.clients[1].train_class_counts(data.y, 3).tolist() == [0, 8, 0]
    assert all(len(s.train) == 0 and len(s.test) == 0 for s in data.clients)


def test_a_device_holds_its_own_clients_rows_only(tmp_path):
    npz_client(tmp_path / "a", 5, 2, seed=1)
    npz_client(tmp_path / "b", 3, 1, seed=2)
    cfg = data_cfg()
    data = placed_data(cfg, {4: read_client(cfg, tmp_path / "b")}, 5)
    assert len(data.x) == 4 and [s.num_train for s in data.clients] == [0, 0, 0, 0, 3]
    with np.load(tmp_path / "b" / "train.npz") as f:
        assert np.array_equal(data.x[data.clients[4].train].numpy(), f["x"])


def test_devices_data_holds_one_folder_per_device(tmp_path):
    (tmp_path / "jetson01").mkdir()
    (tmp_path / "bad name").mkdir()
    with pytest.raises(DatasetError, match="not a device name"):
        device_folders(tmp_path)


@pytest.mark.parametrize("keys, words", [
    (['data.validation="v"'], "for data.placement"),
    (['data.placement="device"', "data.fraction=0.5"], "max_rows_per_client instead"),
])
def test_placement_keys_out_of_place_are_refused(keys, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, keys)


def test_the_doctor_lists_a_devices_client_folders(tmp_path):
    from fedseq.client.doctor import check_data
    from fedseq.client.settings import load_settings

    npz_client(tmp_path / "d" / "north", 3, 1)
    npz_client(tmp_path / "d" / "south", 3, 0)
    ok, msg = check_data(load_settings(None, {"device": "d1", "data_dir": tmp_path / "d"},
                                       environ={}))
    assert ok and "2 client folder(s)" in msg, msg
    assert "north (train.npz 3 rows, test.npz 1 rows)" in msg and "south (train.npz 3 rows)" in msg
    (tmp_path / "d" / "south" / "train.csv").write_text("x")
    ok, msg = check_data(load_settings(None, {"device": "d1", "data_dir": tmp_path / "d"},
                                       environ={}))
    assert ok is False and "keep one" in msg, msg


def _device(n_train, clients=1):
    return [ClientData(f"c{i}", n_train, 1, (n_train, 0, 0)) for i in range(clients)]


def test_a_device_that_announces_too_many_rows_is_left_out_in_one_line():
    """Hardening VII, finding 1: a device's sizes are its own word and weigh its updates. One
    that announces a million times an honest device's rows (class counts scaled to add up) was
    1.0000 of a FedAvg round; now it is left out by the default bound (10 x the other devices'
    median), whoever else is in the fleet, and honest differences pass."""
    from fedseq.common.data.placed import influence_refusals

    cfg = data_cfg()
    assert cfg.max_weight_ratio == 10
    attack = {"honest01": _device(300), "liar": _device(300_000_000)}
    why = influence_refusals(cfg, attack)
    assert list(why) == ["liar"]
    assert why["liar"].startswith("liar announced 300000000 training rows, more than "
                                  "data.max_weight_ratio = 10")
    # several clients add up; the device's own number never sets its bound
    fleet = {"a": _device(100), "b": _device(200), "c": _device(300), "d": _device(200, 16)}
    assert list(influence_refusals(cfg, fleet)) == ["d"]  # 3,200 > 10 x median(100, 200, 300)
    assert influence_refusals(cfg, {"a": _device(100), "b": _device(1000)}) == {}  # 10x: within
    assert influence_refusals(cfg, {"alone": _device(10**9)}) == {}  # no other device to outweigh
    # the operator's choice
    assert list(influence_refusals(data_cfg("data.max_weight_ratio=1.5"), fleet)) == ["d"]
    assert influence_refusals(data_cfg("data.max_weight_ratio=2000000"), attack) == {}


def test_a_roster_beyond_the_bound_is_refused_on_resume_and_in_a_simulation(tmp_path):
    """The bound holds where no gathering applies it: a checkpoint's roster (resume; an edge
    loading its run) and fedseq-sim --devices-data of the same folders."""
    cfg = data_cfg()
    clients = [*_device(40), *_device(4000)]
    with pytest.raises(DatasetError, match="the run's roster: dev-b announced 4000 training rows"):
        announced_data(cfg, clients, None, ("dev-a", "dev-b"))
    assert len(announced_data(cfg, clients, None, ("dev-a", "dev-a")).clients) == 2
    npz_client(tmp_path / "dev-a", 20, 5)
    npz_client(tmp_path / "dev-b", 201, 5, seed=1)
    sim = data_cfg(f"data.devices_root={str(tmp_path)!r}", "data.num_clients=2")
    from fedseq.common.data.placed import simulated_data

    with pytest.raises(DatasetError, match=r"--devices-data .*: dev-b announced 201 training"):
        simulated_data(sim)


def _png(path, width, height):
    """A valid 1 x 1 grayscale PNG whose header then declares width x height (a few hundred
    bytes, however large it says it is)."""
    import struct
    import zlib

    from PIL import Image

    Image.new("L", (1, 1)).save(path)
    raw = bytearray(path.read_bytes())
    ihdr = raw[12:29]  # the IHDR chunk's type and data
    ihdr[4:12] = struct.pack(">II", width, height)
    raw[12:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    path.write_bytes(bytes(raw))


def _image_cfg():
    return load_config(None, ['data.placement="device"', 'data.dataset="imagefolder"',
                              'data.options.classes=["a","b"]', "data.options.size=4",
                              "data.options.channels=1"]).data


@pytest.mark.parametrize("case, words", [
    ("truncated npz", "not a readable .npz file"),
    ("npz zip bomb", "(a zip bomb?)"),
    ("npz without y", "no array 'y' in it (it has 'x'"),
    ("empty training npz", "its training part holds no rows"),
    ("huge csv line", "line 2: longer than"),
    ("link out", "a link out of its data folder"),
    ("10000 x 6000 png", "10000 x 6000 pixels, more than the 50,000,000"),
    ("20000 x 20000 png", "not a readable image (DecompressionBombError"),
    ("broken png", "not a readable image"),
])
def test_a_client_file_that_cannot_be_read_is_one_line(tmp_path, case, words):
    """Hardening VII, finding 8: a truncated npz (zipfile.BadZipFile) or a PNG that declares
    20000 x 20000 pixels (Pillow's DecompressionBombError) escaped the readers' error type and
    killed the device's worker. Every way a client's files fail is a DatasetError naming the
    file, before anything large is allocated; doctor opens the same files (`probe_part`)."""
    from fedseq.client.doctor import placed_clients

    folder = tmp_path / "dev" / "c"
    cfg = data_cfg()
    if case == "truncated npz":
        npz_client(folder, 20, 5)
        whole = (folder / "train.npz").read_bytes()
        (folder / "train.npz").write_bytes(whole[: len(whole) // 2])
    elif case == "npz zip bomb":
        folder.mkdir(parents=True)
        np.savez_compressed(folder / "train.npz", x=np.zeros((5 << 20, 1, 4, 4), np.uint8),
                            y=np.zeros(5 << 20, np.int64))
    elif case == "npz without y":
        folder.mkdir(parents=True)
        np.savez(folder / "train.npz", x=np.zeros((3, 1, 4, 4), np.uint8))
    elif case == "empty training npz":
        npz_client(folder, 0, 5)
        np.savez(folder / "train.npz", x=np.zeros((0, 1, 4, 4), np.uint8), y=np.zeros(0, int))
    elif case == "huge csv line":
        cfg = load_config(None, ['data.placement="device"', 'data.dataset="csv"',
                                 "data.options.features=2", "data.options.classes=2"]).data
        folder.mkdir(parents=True)
        (folder / "train.csv").write_text("a,b,label\n" + "1," * 5_000_000 + "1\n")
    elif case == "link out":
        npz_client(tmp_path / "elsewhere", 20, 5)
        folder.mkdir(parents=True)
        (folder / "train.npz").symlink_to(tmp_path / "elsewhere" / "train.npz")
    else:
        pytest.importorskip("PIL")  # (a device installs Pillow only for image folders)
        cfg = _image_cfg()
        for cls in ("a", "b"):
            (folder / "train" / cls).mkdir(parents=True)
            _png(folder / "train" / cls / "ok.png", 1, 1)
        bad = folder / "train" / "a" / "bad.png"
        if case == "broken png":
            bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 50)
        else:
            _png(bad, *map(int, case.split()[:3:2]))
    with pytest.raises(DatasetError) as got:
        read_client(cfg, folder)
    assert words in str(got.value) and len(str(got.value).splitlines()) == 1, got.value
    if case != "npz without y":  # (doctor knows no run's array names)
        ok, line = placed_clients(tmp_path / "dev")
        assert not ok and words.split(" (")[0].split(":")[0] in line, line


def test_an_image_just_under_the_pixel_limit_is_read(tmp_path):
    """An image of 7000 x 7000 pixels (49 million, under MAX_IMAGE_PIXELS and Pillow's own
    limits) is decoded and resized as any."""
    Image = pytest.importorskip("PIL.Image")

    folder = tmp_path / "c"
    for cls in ("a", "b"):
        (folder / "train" / cls).mkdir(parents=True)
        Image.new("L", (1, 1), 7).save(folder / "train" / cls / "small.png")
    Image.new("L", (7000, 7000), 200).save(folder / "train" / "a" / "big.png")
    raw = read_client(_image_cfg(), folder)
    assert raw.images.shape == (3, 1, 4, 4) and int(raw.images[0].max()) == 200
