"""Datasets: download from mirrors (a local HTTP server serving the real files), resume, refuse
corrupt files, import from a folder, the one default data root, and the CLI around it."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import server_only
from fedseq.common.config import load_config
from fedseq.common.data import catalog, store
from fedseq.common.errors import DatasetError


class Mirror:
    """A loopback HTTP server over a folder, with Range support and injectable faults:
    `cut` = serve only this many bytes of the next full-file response, then drop the connection;
    `corrupt` = flip a byte in every response; `missing` = answer 404."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.requests: list[tuple[str, str | None]] = []
        self.cut: int | None = None
        self.corrupt = False
        self.missing = False
        self.flood = 0  # serve this many bytes more than the file, announced or not
        self.announce = True
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                mirror.requests.append((self.path, rng))
                path = mirror.folder / self.path.lstrip("/")
                if mirror.missing or not path.is_file():
                    self.send_error(404)
                    return
                body = path.read_bytes()
                start = int(rng[len("bytes="):].split("-")[0]) if rng else 0
                part = bytearray(body[start:])
                if mirror.corrupt:
                    part[len(part) // 2] ^= 0xFF
                part += b"\0" * mirror.flood
                self.send_response(206 if rng else 200)
                if mirror.announce:
                    self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                if mirror.cut is not None and not rng:
                    self.wfile.write(part[: mirror.cut])
                    mirror.cut = None
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                self.wfile.write(part)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def base(self, dataset: str) -> str:
        return f"{self.url}/{catalog.DATASETS[dataset].folder}/"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def mirror(data_root):
    m = Mirror(data_root)
    yield m
    m.close()


def test_download_checks_every_file_and_skips_good_ones(mirror, tmp_path, data_root):
    seen = []
    folder = store.download("fmnist", tmp_path, (mirror.base("fmnist"),),
                            progress=lambda name, done, total: seen.append((name, done, total)))
    assert folder == tmp_path / "FashionMNIST" / "raw"
    assert store.verify(tmp_path, "fmnist") == []
    for f in catalog.DATASETS["fmnist"].files:
        assert (folder / f.name).read_bytes() == (data_root / "FashionMNIST/raw" / f.name).read_bytes()
    assert seen[-1][1] == seen[-1][2]  # progress reached the end
    n = len(mirror.requests)
    store.download("fmnist", tmp_path, (mirror.base("fmnist"),))
    assert len(mirror.requests) == n  # nothing fetched again
    assert not list(folder.glob("*.part"))


def test_falls_back_to_the_next_mirror(mirror, tmp_path):
    dead = "http://127.0.0.1:9/"  # discard port: connection refused
    logs = []
    store.download("mnist", tmp_path, (dead, f"{mirror.url}/nowhere/", mirror.base("mnist")),
                   log=logs.append)
    assert store.verify(tmp_path, "mnist") == []
    assert any("trying the next mirror" in m for m in logs)


def test_interrupted_download_resumes_with_a_range_request(mirror, tmp_path):
    mirror.cut = 1_000_000  # the first full response breaks off after 1 MB
    b = mirror.base("mnist")
    store.download("mnist", tmp_path, (b, b))
    assert store.verify(tmp_path, "mnist") == []
    ranges = [r for _, r in mirror.requests if r]
    assert ranges == ["bytes=1000000-"]  # the second try continued, did not start over


def test_corrupt_file_is_refused_in_one_line_and_not_kept(mirror, tmp_path):
    mirror.corrupt = True
    with pytest.raises(DatasetError) as err:
        store.download("mnist", tmp_path, (mirror.base("mnist"),))
    msg = str(err.value)
    assert "\n" not in msg and "md5" in msg and "--from DIR" in msg
    assert not any((tmp_path / "MNIST" / "raw").iterdir())  # no partial or bad file left behind


@pytest.mark.parametrize("announce", [True, False])
def test_a_mirror_sending_more_than_the_file_fills_no_disk(mirror, tmp_path, announce):
    """Hardening IV, finding 8: a mirror that sends 200 MB for a file of a few KB (with or
    without saying so in Content-Length) makes the download stop at the file's size: at most
    that many bytes are written, none kept, and the error says which mirror in one line."""
    mirror.flood, mirror.announce = 200 << 20, announce
    written: list[int] = []
    with pytest.raises(DatasetError) as err:
        store.download("mnist", tmp_path, (mirror.base("mnist"),),
                       progress=lambda name, done, total: written.append(done - total))
    assert "more than" in str(err.value) and "\n" not in str(err.value)
    assert max(written, default=0) <= 0  # never past a file's size
    assert not list((tmp_path / "MNIST" / "raw").glob("*"))


def test_import_from_a_folder_checks_first(data_root, tmp_path):
    dest = tmp_path / "root"
    store.import_from("fmnist", data_root, dest)  # a data root with the standard layout
    assert store.verify(dest, "fmnist") == []
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in catalog.DATASETS["mnist"].files:
        shutil.copy(data_root / "MNIST/raw" / f.name, flat / f.name)
    with (flat / "t10k-labels-idx1-ubyte.gz").open("r+b") as fh:
        fh.seek(100)
        fh.write(b"\x00")
    with pytest.raises(DatasetError, match="md5.*not imported"):
        store.import_from("mnist", flat, dest)
    assert not (dest / "MNIST/raw/t10k-labels-idx1-ubyte.gz").exists()


@pytest.mark.parametrize("below", ["FashionMNIST", "FashionMNIST/raw"])
def test_import_from_torchvisions_dataset_folder(data_root, tmp_path, below):
    """`--from DIR/FashionMNIST` (torchvision's layout, files under raw/), as
    docs/how-to/datasets.md's example gives it, and `--from DIR/FashionMNIST/raw`."""
    dest = tmp_path / "root"
    store.import_from("fmnist", data_root / below, dest)
    assert store.verify(dest, "fmnist") == []


def test_cifar_archive_is_checked_then_extracted(tmp_path, monkeypatch):
    import hashlib
    import tarfile

    src = tmp_path / "src"
    (src / "cifar-10-batches-py").mkdir(parents=True)
    (src / "cifar-10-batches-py" / "batches.meta").write_bytes(b"x")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    blob = archive.read_bytes()
    fake = catalog.DatasetSpec("", (catalog.DataFile(archive.name, hashlib.md5(blob).hexdigest(),
                                                 len(blob)),), (), extract=archive.name)
    monkeypatch.setitem(catalog.DATASETS, "cifar10", fake)
    root = tmp_path / "root"
    store.import_from("cifar10", tmp_path, root)
    assert (root / "cifar-10-batches-py" / "batches.meta").read_bytes() == b"x"
    assert store.verify(root, "cifar10") == [] and not (root / archive.name).exists()


def test_one_default_root_env_and_override(tmp_path, monkeypatch):
    from fedseq.client.settings import load_settings

    monkeypatch.setenv("FEDSEQ_DATA", str(tmp_path / "env"))
    assert load_config(None, []).data.root == tmp_path / "env"
    assert load_config(None, [f"data.root={str(tmp_path)!r}"]).data.root == tmp_path
    assert load_settings(None, {"device": "d1"}, environ={}).data_dir == tmp_path / "env"
    monkeypatch.delenv("FEDSEQ_DATA")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert store.default_data_root() == tmp_path / "xdg" / "fedseq" / "data"
    assert load_config(None, []).data.root == tmp_path / "xdg" / "fedseq" / "data"


def _fedseq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedseq.server.cli.tools", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@server_only  # `fedseq data` is the controller's tool
def test_cli_download_verify_and_where(mirror, tmp_path):
    root = tmp_path / "data"
    r = _fedseq("data", "download", "mnist", "--root", str(root), "--mirror", mirror.base("mnist"), "-q")
    assert r.returncode == 0, r.stderr
    assert _fedseq("data", "verify", "mnist", "--root", str(root)).returncode == 0
    with (root / "MNIST/raw/train-labels-idx1-ubyte.gz").open("r+b") as fh:
        fh.seek(1000)
        fh.write(b"\xff\xff")
    bad = _fedseq("data", "verify", "mnist", "--root", str(root))
    assert bad.returncode == 1
    assert "train-labels-idx1-ubyte.gz has md5" in bad.stdout and "fedseq data download mnist" in bad.stdout
    assert _fedseq("data", "where", env={"FEDSEQ_DATA": str(root)}).stdout.strip() == str(root)
    unknown = _fedseq("data", "download", "imagenet", "--root", str(root))
    assert unknown.returncode == 2 and "unknown dataset 'imagenet'" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1


def test_doctor_checks_content_not_presence(data_root, tmp_path):
    from fedseq.client.doctor import check_data
    from fedseq.client.settings import load_settings

    root = tmp_path / "data"
    shutil.copytree(data_root / "FashionMNIST", root / "FashionMNIST")
    ok, msg = check_data(load_settings(None, {"device": "d1", "data_dir": root}, environ={}))
    assert ok and "fmnist" in msg
    raw = root / "FashionMNIST/raw/t10k-images-idx3-ubyte.gz"
    raw.chmod(0o644)
    raw.write_bytes(raw.read_bytes()[:-10])  # truncated: present, but not the original
    ok, msg = check_data(load_settings(None, {"device": "d1", "data_dir": root}, environ={}))
    assert ok is False and "t10k-images" in msg and "fedseq data download" in msg
