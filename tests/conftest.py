"""Shared fixtures. The real datasets are read from the data root every command uses ($FEDSEQ_DATA,
else ~/.local/share/fedseq/data: `fedseq data download mnist fmnist`), or from this project's
../shared/data where that holds them; never downloaded here."""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedseq.common.config import ExperimentConfig, load_config
from fedseq.common.data.federated import ClientShard, FederatedData
from fedseq.server.cli.launch import SERVER_PACKAGES
from fedseq.server.ops.broker import free_port, write_local_mosquitto

ROOT = Path(__file__).resolve().parent.parent


# the two tiers (the README's two test commands): --full, the slow marker, the fast tier's limit
from tiers import (  # noqa: E402, F401  (pytest finds hooks by name in this module)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)


def _data_root() -> Path:
    """$FEDSEQ_DATA; else the commands' default root when it holds Fashion-MNIST; else the
    project's ../shared/data when that does; else the commands' default (the tests that need the
    data then skip, saying how to get it)."""
    from fedseq.common.data.store import default_data_root

    if os.environ.get("FEDSEQ_DATA"):
        return Path(os.environ["FEDSEQ_DATA"])
    for root in (default_data_root(), ROOT.parent / "shared" / "data"):
        if (root / "FashionMNIST" / "raw").is_dir():
            return root
    return default_data_root()


# One data root for the tests and the commands they start: a resumed or replayed run reads its
# data from the default root, never from its run directory's config (common/config.py).
DATA_ROOT = _data_root()
os.environ["FEDSEQ_DATA"] = str(DATA_ROOT)

# The full tier runs two test processes on the machine's cores (-n 2): each runs torch on one
# thread, as a simulation does by default. Two threads each oversubscribe the cores, and torch's
# OpenMP barriers then wait on descheduled threads: a 1.4 s test took 21.7 s in CI beside a heavy one.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _server_stack() -> bool:
    """The coordinator's stack: Python >= 3.10, torch >= 2.1 and the server extra. The device's
    own tests also run on the oldest device stack (Python 3.8, torch 1.12; .ci/run), where the
    tests of coordinator-side code are skipped by this marker."""
    import importlib.util

    torch_major_minor = tuple(int(x) for x in torch.__version__.split(".")[:2])
    return (sys.version_info >= (3, 10) and torch_major_minor >= (2, 1)
            and all(importlib.util.find_spec(m) for m in SERVER_PACKAGES))


server_only = pytest.mark.skipif(not _server_stack(), reason="coordinator-side code: needs Python "
                                 ">= 3.10, torch >= 2.1 and the server extra")


class Planted:
    """What an attacker pickles (a planted file, a rogue peer): loading it calls a function of
    its choice, here one that copies a file to `marker`, so a test sees whether it ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (shutil.copyfile, (__file__, str(self.marker)))


def shared_data_root() -> Path:
    """The real datasets' root; without them a test skips with the command that fetches them
    (in CI, where they must be there, it fails)."""
    root = DATA_ROOT
    if not (root / "FashionMNIST" / "raw").is_dir() or not (root / "MNIST" / "raw").is_dir():
        why = (f"MNIST and Fashion-MNIST not found under {root}: run `fedseq data download mnist "
               "fmnist` (or `--from DIR` with the files, offline), or set FEDSEQ_DATA to the "
               "folder that holds them")
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return root


@pytest.fixture(scope="session")
def data_root() -> Path:
    return shared_data_root()


def quick_config(data_root: Path, *overrides: str) -> ExperimentConfig:
    """A small real-data experiment: 5% of FMNIST over 5 clients, all of them every round."""
    base = [
        f"data.root={str(data_root)!r}", "data.dataset=fmnist", "data.fraction=0.05",
        "data.num_clients=5", "data.alpha=0.5", "data.min_samples=40", "rounds=3",
        "train.join_ratio=1.0", "train.local_epochs=1", "train.batch_size=20",
        "algorithm.finetune_epochs=2",
    ]
    return load_config(None, base + list(overrides))


def coordinator_run(data_root: Path, out: Path | None, mosquitto, *overrides: str):
    """(config, result) of a deployment on the test's Mosquitto as the coordinator account, with
    quick_config and `overrides`; the devices are the caller's."""
    from fedseq.server.ops.deployment import run_deployment

    port, home, _ = mosquitto
    cfg = quick_config(data_root, "deploy.username=coordinator",
                       f"deploy.password_file={str(home / 'coordinator.pw')!r}", *overrides)
    return cfg, run_deployment(cfg, out, broker=f"mqtt://127.0.0.1:{port}", announce=lambda m: None)


def without_seconds(rows: list[dict]) -> list[dict]:
    """Rows as two runs of the same bits share them: every field but the wall time."""
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def same_run(a, b):
    """Bitwise the same run (two RunResults): weights, every row but its seconds, every client's
    final score."""
    assert all(torch.equal(a.global_weights[k], v) for k, v in b.global_weights.items())
    assert without_seconds(a.rows) == without_seconds(b.rows)
    assert a.final.per_client == b.final.per_client


def placed_run_is_simulated(out: Path, cfg) -> list[dict]:
    """A data.placement = "device" run directory against fedseq-sim of `cfg`: training rounds
    0.. in order, the saved global model bitwise the simulation's, the same federated scores;
    the run's rows."""
    import json

    from fedseq.common.protocol.tensors import decode_tensors
    from fedseq.server.ops.simulation import run_simulation

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows if x["phase"] == "train"] == list(range(cfg.rounds))
    sim = run_simulation(cfg, None)
    saved = decode_tensors((out / "model.safetensors").read_bytes())
    assert all(torch.equal(saved[k], v) for k, v in sim.global_weights.items())
    assert [x.get("federated_acc") for x in rows] == [x.get("federated_acc") for x in sim.rows]
    assert [x.get("reported") for x in rows] == [x.get("reported") for x in sim.rows]
    return rows


def resumed_after(cfg, out: Path, stop_round: int):
    """A simulation of `cfg` into `out` interrupted after round `stop_round`'s row (as by ^C),
    then resumed there: its RunResult."""
    import pytest

    from fedseq.server.ops.simulation import run_simulation

    def stop(row):
        if row.round == stop_round:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_simulation(cfg, out, stop)
    return run_simulation(cfg, out, mode="resume")


def synthetic_data(num_clients: int = 3, per_client: int = 40, classes: int = 4, seed: int = 0):
    """Random 28x28 images with a label-dependent offset: tiny, fast, learnable."""
    g = torch.Generator().manual_seed(seed)
    n = num_clients * per_client
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, 1, 28, 28, generator=g) * 0.5 + (y.float() / classes)[:, None, None, None]
    shards = []
    for c in range(num_clients):
        idx = torch.arange(c * per_client, (c + 1) * per_client)
        cut = per_client * 3 // 4
        shards.append(ClientShard(c, idx[:cut], idx[cut:]))
    return FederatedData(x, y, classes, tuple(shards))


def plain_sgd(model, start, data, shard, seed, purpose, epochs, lr, batch, grad_extra):
    """An update rule written out: plain SGD from `start` over the trainer's batches of
    (seed, purpose, round 0, client), with `grad_extra(name, param)` added to each parameter's
    gradient; returns (the parameters after, the steps taken)."""
    from fedseq.common.seeding import torch_rng

    model.load_state_dict({**model.state_dict(), **start})
    model.train()
    model.requires_grad_(True)
    g = torch_rng(seed, purpose, 0, shard.client)
    steps = 0
    for _ in range(epochs):
        perm = torch.randperm(len(shard.train), generator=g)
        for i in range(0, len(perm), batch):
            rows = shard.train[perm[i:i + batch]]
            model.zero_grad()
            logits = model.logits(model.features(data.images(rows)), (model.spec.head,))
            torch.nn.functional.cross_entropy(logits, data.y[rows]).backward()
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.add_(p.grad + grad_extra(k, p), alpha=-lr)
            steps += 1
    return {k: v.detach().clone() for k, v in model.named_parameters()}, steps


MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
PROJECT_ACL = ROOT / "deploy" / "mosquitto" / "fedseq.acl"


#: the flood guard's password in the tests' Mosquitto: held to the cluster secret's checks
GUARD_SECRET = "0f6c2a9e4b7d13586e0a9c2f4b7d1358"


@pytest.fixture
def mosquitto(tmp_path):
    """Mosquitto from a test copy of the project's broker.conf: loopback, free port, own files."""
    if not Path(MOSQUITTO).exists():
        pytest.fail("mosquitto is not installed (apt-get install mosquitto); .ci/run installs it")
    port = free_port()
    users = {"coordinator": "c-secret", "local01": "d1-secret", "local02": "d2-secret",
             "local03": "d3-secret"}
    conf = write_local_mosquitto(tmp_path, port, users, ROOT / "broker.conf", PROJECT_ACL,
                                 getpass.getuser(), guard=GUARD_SECRET)
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    if proc.poll() is not None:
        pytest.fail(f"mosquitto did not start: {proc.stderr.read()}")
    for user, pw in {**users, "fedseq-guard": GUARD_SECRET}.items():  # the flood guard's too
        (tmp_path / f"{user}.pw").write_text(pw + "\n")
        (tmp_path / f"{user}.pw").chmod(0o600)
    procs = [proc]

    def restart(lose_everything: bool = False):
        if lose_everything:  # kill -9 and no persistence file: the broker forgets every message
            procs[-1].kill()
            procs[-1].wait(10)
            for db in tmp_path.glob("*.db"):
                db.unlink()
        else:
            procs[-1].terminate()  # SIGTERM: mosquitto saves its retained messages
            procs[-1].wait(10)
        time.sleep(1.0)
        procs.append(subprocess.Popen([MOSQUITTO, "-c", str(conf)]))

    yield port, tmp_path, restart
    procs[-1].terminate()
    procs[-1].wait(10)


def device_process(name, port, tmp_path, data_root, *extra, python=sys.executable):
    """A fedseq-client daemon on the test's Mosquitto, with its login (`python`: a device stack's
    interpreter)."""
    return subprocess.Popen(
        [python, "-m", "fedseq.client.cli", "--device", name, "--broker",
         f"mqtt://127.0.0.1:{port}", "--data-dir", str(data_root), "--state-dir",
         str(tmp_path / "state" / name), "--username", name, "--password-file",
         str(tmp_path / f"{name}.pw"), "--threads", "1", "--log-level", "WARNING", *extra],
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def coordinator_watcher(port: int, home: Path, on_message, topic: str = "fedseq/step"):
    """A started paho client on the coordinator's login that calls on_message for every message
    on `topic` (the step, unless told otherwise); the caller stops and disconnects it."""
    import paho.mqtt.client as mqtt

    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watcher-{topic}")
    watcher.username_pw_set("coordinator", (home / "coordinator.pw").read_text().strip())
    watcher.on_message = on_message
    watcher.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, qos=1)
    watcher.connect("127.0.0.1", port)
    watcher.loop_start()
    return watcher


def wait_online(port: int, home: Path, device: str, timeout: float = 120.0) -> None:
    """Block until `device`'s retained status on the broker says online (generous: a daemon
    imports torch, which takes many seconds on a loaded machine)."""
    import threading

    from fedseq.common.protocol.messages import DeviceStatus

    online = threading.Event()

    def on_status(client, userdata, msg):
        if msg.payload and DeviceStatus.decode(msg.payload).state == "online":
            online.set()

    watcher = coordinator_watcher(port, home, on_status, f"fedseq/device/{device}/status")
    try:
        assert online.wait(timeout), f"{device} did not come online within {timeout} s"
    finally:
        watcher.loop_stop()
        watcher.disconnect()


@pytest.fixture
def one_thread():
    """Devices run one torch thread each; the simulation must too, for bitwise parity."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_pki(folder: Path) -> dict[str, Path]:
    """A CA, a broker certificate for 127.0.0.1/localhost, a device certificate, an expired device
    certificate and an unrelated CA, as PEM files (generated with `cryptography`)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)
    out: dict[str, Path] = {}

    def key_pem(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def write(name, cert, key=None):
        out[name] = folder / f"{name}.crt"
        out[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            out[f"{name}_key"] = folder / f"{name}.key"
            out[f"{name}_key"].write_bytes(key_pem(key))

    def issue(cn, issuer_name, issuer_key, ca=False, days=(-1, 365), san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now + dt.timedelta(days=days[0]))
             .not_valid_after(now + dt.timedelta(days=days[1]))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key or key, hashes.SHA256()), key

    ca, ca_key = issue("fedseq test CA", None, None, ca=True)
    write("ca", ca, ca_key)
    other, other_key = issue("some other CA", None, None, ca=True)
    write("other_ca", other, other_key)
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    write("server", *issue("broker", ca.subject, ca_key, san=san))
    write("device", *issue("local01", ca.subject, ca_key))
    write("coordinator", *issue("coordinator", ca.subject, ca_key))
    write("expired", *issue("local01", ca.subject, ca_key, days=(-30, -1)))
    return out


def connack(host: str, port: int, user: str | None = None, password: str | None = None) -> int:
    """The broker's CONNACK reason code for this login, anonymous without `user` (0: accepted;
    -1: no answer)."""
    import paho.mqtt.client as mqtt

    codes: list[int] = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"login-{time.monotonic_ns()}")
    if user is not None:
        c.username_pw_set(user, password)
    c.on_connect = lambda cl, u, f, rc, p: codes.append(rc.value)
    try:
        c.connect(host, port)
    except OSError:
        return -1
    c.loop_start()
    deadline = time.monotonic() + 10
    while not codes and time.monotonic() < deadline:
        time.sleep(0.05)
    c.loop_stop()
    c.disconnect()
    return codes[0] if codes else -1


# -- data.placement = "device" (tests/server/test_device_data.py, tests/deploy) --------------------

DEVICES = {"local01": ["."], "local02": ["cam-a", "cam-b"]}


def fmnist_devices(root: Path, devices=DEVICES, rows=160) -> Path:
    """Each device's folder with npz clients of real Fashion-MNIST rows (disjoint), and a
    validation file beside them."""
    import numpy as np

    from fedseq.common.data.readers import read_dataset
    from fedseq.common.data.store import default_data_root

    raw = read_dataset(default_data_root(), "fmnist")
    order = np.random.default_rng(0).permutation(len(raw.labels))
    at = 0
    for device, folders in devices.items():
        for name in folders:
            folder = root / device if name == "." else root / device / name
            folder.mkdir(parents=True)
            for part, n in (("train", rows), ("test", rows // 4)):
                idx = order[at: at + n]
                at += n
                np.savez(folder / f"{part}.npz", x=raw.images[idx], y=raw.labels[idx])
    val = order[at: at + 300]
    np.savez(root / "validation.npz", x=raw.images[val], y=raw.labels[val])
    return root


def placed_config(root: Path, *more):
    from fedseq.common.config import load_config

    return load_config(None, [
        'data.placement="device"', 'data.dataset="npz"', "data.options.shape=[1,28,28]",
        "data.options.classes=10", f"data.devices_root={str(root)!r}",
        f"data.validation={str(root / 'validation.npz')!r}", "algorithm.name=fedavg", "rounds=2",
        "train.join_ratio=1.0", "train.local_epochs=1", "deploy.port=0", *more])
