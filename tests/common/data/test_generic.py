"""The generic built-in datasets (common/data/generic.py): npz, csv and imagefolder files as a lab
has them; every bad file is one line naming the file and what is wrong."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fedseq.common.config import load_config
from fedseq.common.data.datasets import dataset
from fedseq.common.errors import ConfigError, DatasetError


def _npz(path, x, y):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=x, y=y)


def test_npz_reads_train_then_test_and_checks_every_array(tmp_path):
    rng = np.random.default_rng(0)
    _npz(tmp_path / "lab" / "train.npz", rng.random((30, 1, 2, 3)), rng.integers(0, 3, 30))
    _npz(tmp_path / "lab" / "test.npz", rng.random((10, 1, 2, 3)), rng.integers(0, 3, 10))
    opts = {"path": "lab", "classes": 3, "shape": [1, 2, 3]}
    raw = dataset("npz").load(tmp_path, opts)
    assert raw.images.shape == (40, 1, 2, 3) and raw.images.dtype == np.float32
    assert raw.num_train == 30 and raw.num_classes == 3 and len(raw.labels) == 40
    assert dataset("npz").load(tmp_path, opts, rows=np.array([0, 39])).images.shape[0] == 2
    assert dataset("npz").describe(opts) == ((1, 2, 3), 3)
    one = tmp_path / "one.npz"
    _npz(one, rng.random((5, 1, 2, 3)), np.array([0, 1, 2, 3, 0]))
    with pytest.raises(DatasetError, match=r"one.npz: labels from 0 to 3, but .* gives 3 classes"):
        dataset("npz").load(tmp_path, {**opts, "path": "one.npz"})
    _npz(one, rng.random((5, 2, 2, 3)), np.zeros(5, np.int64))
    with pytest.raises(DatasetError, match=r"one.npz: x is \(5, 2, 2, 3\)"):
        dataset("npz").load(tmp_path, {**opts, "path": "one.npz"})
    _npz(one, np.array([object()] * 5, dtype=object).reshape(5, 1, 1, 1), np.zeros(5, np.int64))
    with pytest.raises(DatasetError, match="one.npz: not a readable .npz file") as err:
        dataset("npz").load(tmp_path, {**opts, "path": "one.npz", "shape": [1, 1, 1]})
    assert "\n" not in str(err.value)  # an object array is never unpickled
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(DatasetError, match="junk.npz: not a readable .npz file"):
        dataset("npz").load(tmp_path, {**opts, "path": "junk.npz"})
    with pytest.raises(DatasetError, match="nowhere: no such file or folder"):
        dataset("npz").load(tmp_path, {**opts, "path": "nowhere"})


CSV = "temp,hum,label\n1.0,2.0,cold\n3.0,4.0,hot\n5.5,0.5,cold\n"


def test_csv_maps_labels_by_the_fixed_class_list_and_refuses_bad_rows(tmp_path):
    (tmp_path / "s.csv").write_text(CSV)
    opts = {"path": "s.csv", "classes": ["hot", "cold", "mild"], "features": 2}
    raw = dataset("csv").load(tmp_path, opts)
    assert raw.labels.tolist() == [1, 0, 1] and raw.num_classes == 3
    assert raw.images[:, 0, 0].tolist() == [[1.0, 2.0], [3.0, 4.0], [5.5, 0.5]]
    cases = {
        CSV + "1.0,warm\n": "line 5: 2 values, the header has 3 (a ragged row)",
        CSV + "1.0,2.0,warm\n": "line 5: label 'warm' is not in data.options.classes",
        CSV + "x,2.0,hot\n": "line 5: a feature is not a number",
        "temp,hum,kind\n1,2,hot\n": "no header with a 'label' column",
        "a,b,c,label\n1,2,3,hot\n": "3 feature columns, data.options.features = 2",
    }
    for text, why in cases.items():
        (tmp_path / "s.csv").write_text(text)
        with pytest.raises(DatasetError, match=re.escape(why)) as err:
            dataset("csv").load(tmp_path, opts)
        assert str(err.value).startswith(str(tmp_path / "s.csv")) and "\n" not in str(err.value)


def _png(path, value, size=(6, 5), mode="L"):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value).save(path)


def test_an_image_folder_is_decoded_once_resized_and_cached(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    monkeypatch.setenv("FEDSEQ_CACHE", str(tmp_path / "cache"))
    for split, n in (("train", 3), ("test", 1)):
        for cls, value in (("cat", 10), ("dog", 200)):
            for i in range(n):
                _png(tmp_path / "pics" / split / cls / f"{i}.png", value)
    opts = {"path": "pics", "classes": ["dog", "cat", "bird"], "size": 4, "channels": 1}
    raw = dataset("imagefolder").load(tmp_path, opts)
    assert raw.images.shape == (8, 1, 4, 4) and raw.images.dtype == np.uint8 and raw.num_train == 6
    assert raw.labels.tolist() == [1, 1, 1, 0, 0, 0, 1, 0]  # folders sorted, labels by the list
    assert (raw.images[0] == 10).all() and (raw.images[3] == 200).all()
    assert len(list((tmp_path / "cache").glob("imagefolder-*.npz"))) == 2

    import PIL.Image

    def no_decoding(*a, **k):
        raise AssertionError("decoded again")

    monkeypatch.setattr(PIL.Image, "open", no_decoding)
    again = dataset("imagefolder").load(tmp_path, opts)
    assert np.array_equal(again.images, raw.images)
    monkeypatch.undo()
    monkeypatch.setenv("FEDSEQ_CACHE", str(tmp_path / "cache"))
    rgb = dataset("imagefolder").load(tmp_path, {**opts, "channels": 3, "size": [3, 2]})
    assert rgb.images.shape == (8, 3, 3, 2)


def test_a_bad_image_or_an_unknown_class_folder_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    monkeypatch.setenv("FEDSEQ_CACHE", str(tmp_path / "cache"))
    _png(tmp_path / "pics" / "cat" / "0.png", 1)
    (tmp_path / "pics" / "cat" / "1.png").write_bytes(b"\x89PNG but not really")
    opts = {"path": "pics", "classes": ["cat", "dog"], "size": 4, "channels": 1}
    with pytest.raises(DatasetError, match=r"cat/1.png: not a readable image") as err:
        dataset("imagefolder").load(tmp_path, opts)
    assert "\n" not in str(err.value)
    (tmp_path / "pics" / "cat" / "1.png").unlink()
    _png(tmp_path / "pics" / "cow" / "0.png", 1)
    with pytest.raises(DatasetError, match="class folder 'cow' is not in data.options.classes"):
        dataset("imagefolder").load(tmp_path, opts)


def test_the_options_are_checked_with_the_config_before_any_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data.options.classes \(imagefolder\)"):
        load_config(None, ["data.dataset=imagefolder", "data.options.path='x'",
                           "data.options.size=28"])
    with pytest.raises(ConfigError, match=r"data.options.channels \(imagefolder\): 2: give 1"):
        load_config(None, ["data.dataset=imagefolder", "data.options.path='x'", "data.options.size=8",
                           "data.options.classes=['a','b']", "data.options.channels=2"])
    with pytest.raises(ConfigError, match="the catalog dataset fmnist takes no options"):
        load_config(None, ["data.options.path='x'"])
    cfg = load_config(None, ["data.dataset=csv", "data.options.path='s.csv'",
                             "data.options.classes=['a','b']", "data.options.features=7"])
    assert dataset("csv").describe(cfg.data.options) == ((1, 1, 7), 2)


def test_npz_takes_tabular_rows_and_sensor_series_as_they_are(tmp_path):
    """Issue 94, finding 2: (N, F) tabular rows and (N, C, L) sensor series are first class;
    fedseq holds them as (N, 1, 1, F) and (N, C, 1, L), a shape of the wrong rank is one line."""
    rng = np.random.default_rng(0)
    _npz(tmp_path / "tab.npz", rng.random((12, 5)), rng.integers(0, 2, 12))
    _npz(tmp_path / "series.npz", rng.random((12, 3, 50)).astype(np.float16), rng.integers(0, 2, 12))
    tab = {"path": "tab.npz", "classes": 2, "shape": [5]}
    series = {"path": "series.npz", "classes": 2, "shape": [3, 50]}
    assert dataset("npz").describe(tab) == ((1, 1, 5), 2)
    assert dataset("npz").describe(series) == ((3, 1, 50), 2)
    raw = dataset("npz").load(tmp_path, tab)
    assert raw.images.shape == (12, 1, 1, 5) and raw.images.dtype == np.float32
    loaded = dataset("npz").load(tmp_path, series)
    assert loaded.images.shape == (12, 3, 1, 50)
    np.testing.assert_array_equal(loaded.images[:, :, 0, :], np.load(tmp_path / "series.npz")["x"])
    with pytest.raises(DatasetError, match=r"series.npz: x is \(12, 3, 50\) and y \(12,\); want "
                                           r"\(N, 50, 3\)"):
        dataset("npz").load(tmp_path, {**series, "shape": [50, 3]})
    for bad in ([], [1, 2, 3, 4], [0, 5]):
        with pytest.raises(ConfigError, match=r"data.options.shape \(npz\)"):
            dataset("npz").describe({**series, "shape": bad})


def test_normalize_stats_needs_its_numbers(tmp_path):
    """data.normalize = "stats": a mean and a std of one length, finite, std > 0; the numbers
    without the choice are refused, each in one line."""
    ok = load_config(None, ["data.normalize='stats'", "data.mean=[1.0, 2.0]", "data.std=[0.5, 3]"])
    assert ok.data.stats() == ((1.0, 2.0), (0.5, 3.0))
    assert load_config(None, []).data.stats() is None
    for bad, says in ((["data.normalize='stats'"], "needs data.mean and data.std"),
                      (["data.normalize='stats'", "data.mean=[1.0]", "data.std=[1, 2]"],
                       "of one length"),
                      (["data.normalize='stats'", "data.mean=[1.0]", "data.std=[0]"], "> 0"),
                      (["data.normalize='stats'", "data.mean=[nan]", "data.std=[1]"], "finite"),
                      (["data.mean=[1.0]", "data.std=[1]"], "for data.normalize = \"stats\"")):
        with pytest.raises(ConfigError, match=re.escape(says)) as err:
            load_config(None, bad)
        assert "\n" not in str(err.value)
