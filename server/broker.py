"""The embedded amqtt broker: runs inside the coordinator on its own asyncio thread."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import shutil
import socket
import subprocess
import threading
from pathlib import Path

from fedseq.common.errors import TransportError

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def hash_password(password: str) -> str:
    """An argon2 hash for an amqtt password file line `user:hash`."""
    from pwdlib import PasswordHash
    from pwdlib.hashers.argon2 import Argon2Hasher

    return PasswordHash((Argon2Hasher(),)).hash(password)


def one_run_login(folder: Path, user: str = "rehearsal") -> tuple[Path, Path]:
    """A login that exists for one run: (the broker's password file, the file holding the
    password), both readable by this user only, in `folder`. The rehearsal's embedded broker
    listens on a bridge other namespaces of this machine reach; with this, only the processes
    the coordinator starts can log in."""
    import secrets

    from fedseq.common.files import atomic_write

    password = secrets.token_urlsafe(24)
    broker_file, secret_file = folder / "broker.passwd", folder / f"{user}.pw"
    atomic_write(broker_file, f"{user}:{hash_password(password)}\n".encode(), mode=0o600)
    atomic_write(secret_file, f"{password}\n".encode(), mode=0o600)
    return broker_file, secret_file


class EmbeddedBroker:
    """amqtt on host:port (port 0 = a free one). On loopback it may be anonymous; bound to any
    other address it needs a password file (lines `user:argon2-hash`, see `fedseq-server passwd`)
    unless anonymous logins are explicitly allowed."""

    def __init__(self, host: str = "127.0.0.1", port: int = 18830, password_file: Path | None = None,
                 allow_anonymous: bool = False):
        if password_file is None and not is_loopback(host) and not allow_anonymous:
            raise TransportError(
                f"the embedded broker on {host} would accept anyone on the network: give "
                "deploy.broker_password_file (create it with fedseq-server passwd FILE USER), bind "
                "it to 127.0.0.1, or set deploy.allow_anonymous = true")
        if password_file is not None and not Path(password_file).is_file():
            raise TransportError(f"deploy.broker_password_file {password_file} does not exist; "
                                 "create it with fedseq-server passwd FILE USER")
        if password_file is None and not is_loopback(host):
            log.warning("embedded broker on %s accepts anonymous logins (deploy.allow_anonymous)",
                        host)
        self.password_file = password_file
        self.host = host
        self.port = port or free_port(host)
        self._loop = asyncio.new_event_loop()
        self._broker = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="amqtt", daemon=True)

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> None:
        from amqtt.broker import Broker

        quiet = [logging.getLogger(n) for n in ("amqtt", "transitions")]
        for lg in quiet:  # a port in use is our one-line error, not amqtt's traceback
            lg.setLevel(logging.CRITICAL)
        self._thread.start()

        auth = "amqtt.plugins.authentication."
        plugins: dict[str, dict] = {f"{auth}AnonymousAuthPlugin":
                                    {"allow_anonymous": self.password_file is None}}
        if self.password_file is not None:
            plugins[f"{auth}FileAuthPlugin"] = {"password_file": str(self.password_file)}

        async def boot():
            broker = Broker({
                "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
                "plugins": plugins,
            })
            await broker.start()
            return broker

        try:
            self._broker = asyncio.run_coroutine_threadsafe(boot(), self._loop).result(15)
        except Exception as exc:
            cause = "the port is in use" if isinstance(exc, OSError) or "in use" in str(exc) else exc
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise TransportError(
                f"cannot start the embedded broker on {self.host}:{self.port} ({cause}); "
                "pick another deploy.port (0 = any free one) or pass --broker mqtt://HOST:PORT"
            ) from exc
        for lg in quiet:
            lg.setLevel(logging.WARNING)

    def __enter__(self) -> EmbeddedBroker:
        """Started (`start`), and stopped at the end of the block."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Shut amqtt down, cancel what it left running and collect it now: coroutines finalized
        later, on a stopped loop, raise 'Event loop is closed' from the garbage collector at
        arbitrary moments of the host process."""
        for name in ("amqtt", "transitions"):  # its tasks' cancellation is not an error to print
            logging.getLogger(name).setLevel(logging.CRITICAL)
        if self._broker is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(10)
            except Exception:  # shutting down anyway
                log.debug("amqtt shutdown raised", exc_info=True)

        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_the_rest(), self._loop).result(10)
            except Exception:
                log.debug("cancelling amqtt's tasks raised", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._broker = None
        gc.collect()


def local_mosquitto_conf(broker_conf: str, port: int, passwd: Path, acl: Path, home: Path,
                         user: str) -> str:
    """The project's production broker.conf turned into a loopback-only copy for tests and
    rehearsals: this port on 127.0.0.1, these password and ACL files, persistence under `home`,
    logs to stderr, and `user` to run as (as root, Mosquitto drops to a user without access)."""
    import re

    conf = re.sub(r"^listener 1883 0\.0\.0\.0$", f"listener {port} 127.0.0.1", broker_conf,
                  flags=re.M)
    conf = conf.replace("/etc/mosquitto/fedseq.passwd", str(passwd))
    conf = conf.replace("/etc/mosquitto/fedseq.acl", str(acl))
    conf = conf.replace("/var/lib/mosquitto/", f"{home}/")
    conf = conf.replace("log_dest syslog", "log_dest stderr") + f"\nuser {user}\n"
    if f"listener {port} 127.0.0.1" not in conf or "allow_anonymous false" not in conf:
        raise ValueError("broker.conf no longer has the expected listener/anonymous lines")
    return conf


def write_local_mosquitto(home: Path, port: int, logins: dict[str, str], broker_conf: Path,
                          acl: Path, user: str, settings: dict[str, str] | None = None,
                          log_file: Path | None = None) -> Path:
    """The files of a loopback Mosquitto under `home` (tests, benchmarks, rehearsals): a password
    file of these logins (login -> password, hashed by one mosquitto_passwd -U however many),
    a copy of the ACL, and mosquitto.conf from `local_mosquitto_conf`, where `settings` replace
    broker.conf's lines of the same keys and `log_file` takes the log instead of stderr. Returns
    the config's path: `mosquitto -c PATH`."""
    passwd, acl_copy, conf_path = home / "passwd", home / "acl", home / "mosquitto.conf"
    conf = local_mosquitto_conf(broker_conf.read_text(), port, passwd, acl_copy, home, user)
    for key, value in (settings or {}).items():
        line = next((x for x in conf.splitlines() if x.startswith(key + " ")), None)
        if line is None:
            raise ValueError(f"broker.conf has no {key!r} line to set")
        conf = conf.replace(line, f"{key} {value}")
    if log_file is not None:
        conf = conf.replace("log_dest stderr", f"log_dest file {log_file}")
    passwd.write_text("".join(f"{login}:{pw}\n" for login, pw in logins.items()))
    subprocess.run(["mosquitto_passwd", "-U", str(passwd)], check=True)
    shutil.copy(acl, acl_copy)
    conf_path.write_text(conf)
    return conf_path
