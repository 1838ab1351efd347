"""fedseq-client doctor: checks what usually breaks on a device and says how to fix it."""

from __future__ import annotations

import ssl
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Tuple

from fedseq.client.settings import ClientSettings
from fedseq.common.errors import DatasetError

Check = Tuple[Optional[bool], str]  # (ok, or None for a warning; one line: found, and the fix)

# `fedseq data` is a coordinator-side tool (the server extra); a lean device gets the files copied
WHERE_FEDSEQ = (" where fedseq's server extra is installed (or on the controller, then copy the "
                "files: the ansible role's fedseq_client_dataset_src)")


def check_stack() -> list[Check]:
    """The L4T/JetPack release, glibc, Python, torch and CUDA, and whether fedseq supports the
    combination; if not, the route for this kind of device (client/stack.py)."""
    from fedseq.client import stack

    f = stack.facts()
    ok, why = stack.verdict(f)
    return [(True, stack.describe(f)), (ok, why)]


def check_torch(s: ClientSettings) -> Check:
    """Whether torch imports and runs a tensor op, on the device the settings name (CUDA where
    asked)."""
    try:
        import torch
    except ImportError as exc:
        return False, (f"torch not importable ({exc}): install your JetPack's torch wheel system-wide "
                       "and create the venv with --system-site-packages (docs/deploy.md, section 1)")
    cuda = torch.cuda.is_available()
    if s.torch_device == "cuda" and not cuda:
        return False, (f"torch {torch.__version__}: CUDA not visible but torch_device=cuda: use "
                       "JetPack's CUDA build of torch and add the service user to the video group")
    if not cuda:
        return True, f"torch {torch.__version__}, CPU only"
    return cuda_kernel_check(torch)


def cuda_kernel_check(torch) -> Check:  # type: ignore[no-untyped-def]
    """The GPU by name and memory, and a tiny kernel that must compute the right number: a
    driver, library or permission problem shows here, not in round 0."""
    import time

    try:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        start = time.perf_counter()
        a = torch.arange(16, dtype=torch.float32, device="cuda").reshape(4, 4)
        got = float((a @ a.T).sum().item())  # = sum of squared column sums: 24..36 step 4
        ms = 1000 * (time.perf_counter() - start)
    except Exception as exc:  # a broken driver raises many kinds of errors
        return False, (f"torch {torch.__version__}: CUDA is visible but a test kernel failed "
                       f"({type(exc).__name__}: {str(exc).splitlines()[0]}): check JetPack's "
                       f"driver and that the user is in the video group")
    if got != 3680.0:
        return False, f"CUDA test kernel computed {got}, expected 3680: the GPU or driver is faulty"
    return True, (f"torch {torch.__version__}, CUDA {torch.version.cuda}: {props.name}, "
                  f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), test kernel ok in "
                  f"{ms:.0f} ms")


def check_data(s: ClientSettings) -> Check:
    """Every dataset under data_dir, checked by content: md5 of each original file (CIFAR: its
    extracted folder), so a truncated or corrupt copy is found here, not in round 0."""
    from fedseq.common.data.catalog import DATASETS
    from fedseq.common.data.store import verify

    if not s.data_dir.is_dir():
        return False, (f"data_dir {s.data_dir} does not exist: run `fedseq data download fmnist "
                       f"--root {s.data_dir}`{WHERE_FEDSEQ}, or set data_dir")
    placed = placed_clients(s.data_dir)
    if placed is not None:
        return placed
    present, broken = [], []
    for name in DATASETS:
        problems = verify(s.data_dir, name)
        if not problems:
            present.append(name)
        elif len(problems) < len(DATASETS[name].files) or any("md5" in p or "bytes" in p
                                                                for p in problems):
            broken.append(problems[0])
    if broken:
        return False, (f"{broken[0]}: re-run `fedseq data download` for it with --root {s.data_dir}"
                       f"{WHERE_FEDSEQ}")
    if not present:
        return False, (f"no dataset under {s.data_dir}: run `fedseq data download fmnist --root "
                       f"{s.data_dir}`{WHERE_FEDSEQ}")
    return True, f"datasets under {s.data_dir}, md5 ok: {', '.join(present)}"


def placed_clients(data_dir: Path) -> Optional[Check]:
    """data.placement = "device": the clients in data_dir with their parts (their files are read
    with the run's dataset when a run starts); None where data_dir holds no train part."""
    from fedseq.common.data.placed import client_folders

    try:
        found = client_folders(data_dir)
    except DatasetError as exc:
        if "no train part" in str(exc):
            return None
        return False, str(exc).splitlines()[0]
    try:
        listed = [f"{name} ({', '.join(_opened(folder))})" for name, folder in found]
    except DatasetError as exc:
        return False, str(exc).splitlines()[0]
    return True, (f"{len(found)} client folder(s) for data.placement = \"device\" in {data_dir}: "
                  f"{'; '.join(listed[:10])}{' ...' if len(listed) > 10 else ''} (opened; read "
                  "with the run's dataset when a run starts)")


def _opened(folder: Path) -> list[str]:
    """Each part of a client folder, opened (`probe_part`), with its rows where its layout
    tells them; a DatasetError for one that cannot be read, or an empty training part."""
    from fedseq.common.data.generic import probe_part
    from fedseq.common.data.placed import client_parts

    out = []
    for name, where in client_parts(folder):
        rows = probe_part(where)
        if name == "train" and rows == 0:
            raise DatasetError(f"{where}: its training part holds no rows")
        out.append(where.name + ("/" if where.is_dir() else "")
                   + (f" {rows} rows" if rows >= 0 else ""))
    return out


def check_state_dir(s: ClientSettings) -> Check:
    """Whether the state directory can be made and written."""
    try:
        s.state_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=s.state_dir):
            pass
    except OSError as exc:
        return False, f"state_dir {s.state_dir} not writable ({exc}): fix its owner or permissions"
    return True, f"state_dir {s.state_dir} writable"


def check_sensors() -> list[Check]:
    """The power sources and health sensors this device has, and whether this user (run doctor as
    the service's user) can read them: energy per client-round is null, never 0, without one."""
    import getpass

    from fedseq.client import power

    user = getpass.getuser()
    rows = power.sensors()
    health = [r for r in rows if r[0] in power.HEALTH_SENSORS]
    rows = [r for r in rows if r[0] not in power.HEALTH_SENSORS]
    checks: list[Check] = []
    usable = [(name, detail) for name, ok, detail in rows if ok]
    if usable:
        name, detail = usable[0]
        checks.append((True, f"power: {name} readable by {user}, {detail}; energy is measured "
                             f"every {power.PERIOD_S * 1000:.0f} ms per client-round"))
    else:
        problems = [detail for _, ok, detail in rows if not ok]
        unreadable = [p for p in problems if "not readable" in p]
        checks.append((None, "power: no readable source, energy per round will be null ("
                       + "; ".join(unreadable or problems) + ")"))
    for name, ok, detail in health:
        checks.append((True if ok else None, f"{name}: {detail}"))
    return checks


def _days_left(not_after: datetime) -> float:
    return (not_after - datetime.now(timezone.utc)).total_seconds() / 86400


def _expiry_check(what: str, not_after: datetime, warn_days: float = 30) -> Check:
    days = _days_left(not_after)
    if days < 0:
        return False, f"{what} expired on {not_after:%Y-%m-%d}: issue a new one from your CA"
    if days < warn_days:
        return None, f"{what} expires in {days:.0f} days ({not_after:%Y-%m-%d}): renew it soon"
    return True, f"{what} valid until {not_after:%Y-%m-%d}"


def check_own_certificate(s: ClientSettings) -> list[Check]:
    """This device's TLS client certificate, read from cert_file (needs `cryptography`)."""
    if s.cert_file is None:
        return []
    try:
        from cryptography import x509
    except ImportError:
        return [(None, f"cert_file {s.cert_file}: install `cryptography` to check its expiry")]
    try:
        cert = x509.load_pem_x509_certificate(Path(s.cert_file).read_bytes())
    except (OSError, ValueError) as exc:
        return [(False, f"cert_file {s.cert_file} unreadable ({exc}): give a PEM certificate")]
    return [_expiry_check(f"client certificate {s.cert_file}", cert.not_valid_after_utc)]


def check_broker(s: ClientSettings) -> list[Check]:
    """Reach the broker, complete the TLS handshake (mqtts://) and log in, as the daemon would."""
    from fedseq.common.errors import ConfigError, TransportError
    from fedseq.common.files import read_secret
    from fedseq.common.protocol.link import Link, TlsOptions, session_id

    try:
        password = read_secret(s.password_file)
    except ConfigError as exc:
        return [(False, str(exc))]
    try:
        link = Link(session_id(f"fedseq-doctor-{s.device}"), s.broker, [], lambda t, p: None,
                    username=s.username, password=password,
                    tls=TlsOptions(s.ca_file, s.cert_file, s.key_file, s.verify_hostname))
        link.start(attempts=1, refusals=1)
    except TransportError as exc:
        return [(False, str(exc))]
    checks: list[Check] = []
    try:
        sock = link.client.socket()
        peer = sock.getpeercert() if isinstance(sock, ssl.SSLSocket) else None
        if peer:
            not_after = datetime.fromtimestamp(ssl.cert_time_to_seconds(str(peer["notAfter"])),
                                               timezone.utc)
            checks.append(_expiry_check(f"broker certificate of {link.host}", not_after))
    finally:
        link.stop()
    secure = "TLS, " if link.scheme == "mqtts" else ""
    checks.insert(0, (True, f"broker {link.host}:{link.port} ({secure}MQTT) accepts "
                            f"{s.username or 'anonymous'}"))
    return checks


def check_plugins(s: ClientSettings) -> list[Check]:
    """The installed plugins (not fedseq's built-ins), whether each is allowed here, and every
    allowed name that nothing installed provides."""
    from fedseq.common.errors import FedseqError
    from fedseq.common.registry import DEVICE_GROUPS, GROUPS, KINDS, REGISTRY

    try:
        entries = [e for g in GROUPS for e in REGISTRY.entries(g) if not e.builtin]
    except FedseqError as exc:
        return [(False, f"plugins: {exc}")]
    allowed = set(s.plugins.allow)
    before = REGISTRY.allowed
    REGISTRY.restrict(allowed)  # as the daemon does: its verdicts are this device's
    checks: list[Check] = []
    try:
        for e in entries:
            what = f"plugin {KINDS[e.group]} {e.name!r} ({e.distribution} {e.version}) installed"
            if e.group not in DEVICE_GROUPS:
                checks.append((True, f"{what}: it runs on the coordinator, a device never loads "
                                     "it (nothing to allow)"))
            elif REGISTRY.device_refusal(e.group, e.name) is None:
                checks.append((True, f"{what} and allowed"))
            else:
                checks.append((None, f"{what}, not allowed: runs that use it are refused here "
                                     f"(--allow-plugin {e.name} allows it)"))
    finally:
        REGISTRY.restrict(before)
    for name in sorted(allowed - {e.name for e in entries}):
        checks.append((False, f"plugin {name!r} is allowed but no installed package registers it: "
                              "install the lab's package in this device's environment"))
    if not checks:
        checks.append((True, "plugins: none installed (fedseq's built-ins only)"))
    return checks


def run_doctor(s: ClientSettings, out: Callable[[str], None] = print) -> int:
    """`fedseq-client doctor`: every check, one line each to `out`; the exit status (1 if any
    failed)."""
    checks = [*check_stack(), check_torch(s), check_data(s), check_state_dir(s), *check_plugins(s),
              *check_sensors(),
              *check_own_certificate(s), *check_broker(s)]
    for ok, line in checks:
        out(f"{'ok  ' if ok else 'warn' if ok is None else 'FAIL'} {line}")
    failed = sum(ok is False for ok, _ in checks)
    out("all checks passed" if not failed else f"{failed} check(s) failed")
    return 0 if not failed else 1
