"""fedseq-client doctor: checks what usually breaks on a device and says how to fix it."""

from __future__ import annotations

import socket
import sys
import tempfile
import threading
from collections.abc import Callable

from fedseq.client.settings import ClientSettings

Check = tuple[bool, str]  # (ok, one line: what was found, and the fix when not ok)

DATASET_FILES = {
    "mnist": [f"MNIST/raw/{n}-idx{d}-ubyte.gz" for n, d in
              (("train-images", 3), ("train-labels", 1), ("t10k-images", 3), ("t10k-labels", 1))],
    "fmnist": [f"FashionMNIST/raw/{n}-idx{d}-ubyte.gz" for n, d in
               (("train-images", 3), ("train-labels", 1), ("t10k-images", 3), ("t10k-labels", 1))],
    "cifar10": ["cifar-10-batches-py/data_batch_1", "cifar-10-batches-py/test_batch"],
    "cifar100": ["cifar-100-python/train", "cifar-100-python/test"],
}


def check_python() -> Check:
    ok = sys.version_info >= (3, 10)
    v = ".".join(map(str, sys.version_info[:3]))
    return ok, f"python {v}" + ("" if ok else ": fedseq needs Python >= 3.10 (JetPack 6, or a "
                                              "Python 3.10 build on JetPack 4)")


def check_torch(s: ClientSettings) -> Check:
    try:
        import torch
    except ImportError as exc:
        return False, (f"torch not importable ({exc}): install JetPack's torch wheel and create the "
                       "venv with --system-site-packages")
    cuda = torch.cuda.is_available()
    if s.torch_device == "cuda" and not cuda:
        return False, (f"torch {torch.__version__}: CUDA not visible but torch_device=cuda: use "
                       "JetPack's CUDA build of torch and add the service user to the video group")
    where = f"CUDA ({torch.cuda.get_device_name(0)})" if cuda else "CPU only"
    return True, f"torch {torch.__version__}, {where}"


def check_data(s: ClientSettings) -> Check:
    if s.data_dir is None:
        return True, "data_dir not set: the run's data.root is used as given by the coordinator"
    if not s.data_dir.is_dir():
        return False, f"data_dir {s.data_dir} does not exist: copy the dataset files there"
    present = [name for name, files in DATASET_FILES.items()
               if all((s.data_dir / f).exists() for f in files)]
    if not present:
        return False, (f"no complete dataset under {s.data_dir}: copy e.g. FashionMNIST/raw/*.gz "
                       "(the four original IDX files)")
    return True, f"datasets under {s.data_dir}: {', '.join(present)}"


def check_state_dir(s: ClientSettings) -> Check:
    try:
        s.state_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=s.state_dir):
            pass
    except OSError as exc:
        return False, f"state_dir {s.state_dir} not writable ({exc}): fix its owner or permissions"
    return True, f"state_dir {s.state_dir} writable"


def check_broker(s: ClientSettings, timeout: float = 5.0) -> Check:
    import paho.mqtt.client as mqtt

    from fedseq.common.errors import TransportError
    from fedseq.common.protocol.link import parse_broker_url

    try:
        host, port = parse_broker_url(s.broker)
    except TransportError as exc:
        return False, str(exc)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return False, (f"broker {host}:{port} unreachable ({exc}): check the address, that "
                       "Mosquitto runs, and the firewall")
    password = None
    if s.password_file is not None:
        try:
            password = s.password_file.read_text().strip()
        except OSError as exc:
            return False, f"password_file {s.password_file} unreadable ({exc})"
    result: dict[str, str] = {}
    done = threading.Event()

    def on_connect(client, userdata, flags, reason_code, properties):
        result["rc"] = str(reason_code)
        result["ok"] = "" if reason_code.is_failure else "yes"
        done.set()

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fedseq-doctor-{s.device}")
    if s.username:
        c.username_pw_set(s.username, password)
    c.on_connect = on_connect
    c.connect(host, port, keepalive=10)
    c.loop_start()
    done.wait(timeout)
    c.disconnect()
    c.loop_stop()
    if not done.is_set():
        return False, f"broker {host}:{port} accepted TCP but no MQTT answer: is it an MQTT port?"
    if not result["ok"]:
        return False, (f"broker refused the login ({result['rc']}): check username/password_file "
                       "against the broker's password file (user name = device name)")
    return True, f"broker {host}:{port} accepts {s.username or 'anonymous'}"


def run_doctor(s: ClientSettings, out: Callable[[str], None] = print) -> int:
    checks = [check_python(), check_torch(s), check_data(s), check_state_dir(s), check_broker(s)]
    for ok, line in checks:
        out(f"{'ok  ' if ok else 'FAIL'} {line}")
    failed = sum(not ok for ok, _ in checks)
    out("all checks passed" if not failed else f"{failed} check(s) failed")
    return 0 if not failed else 1
