"""The embedded brokers: amqtt inside the coordinator on its own asyncio thread, or a Mosquitto
started for one run from the project's broker.conf and ACL (`LocalMosquitto`)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import ipaddress
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fedseq.common.errors import TransportError
from fedseq.common.files import read_secret
from fedseq.common.protocol.link import TlsOptions

if TYPE_CHECKING:
    from fedseq.common.config import DeployConfig

log = logging.getLogger(__name__)

#: the source checkout's broker.conf and ACL (the coordinator is installed from one, editable)
CHECKOUT = Path(__file__).resolve().parents[2]
BROKER_CONF, PROJECT_ACL = CHECKOUT / "broker.conf", CHECKOUT / "deploy" / "mosquitto" / "fedseq.acl"


def coordinator_login(d: DeployConfig) -> tuple[str | None, str | None, TlsOptions]:
    """The coordinator's broker login from its deploy.* keys: user name, password (read from
    deploy.password_file) and TLS options."""
    return (d.username, read_secret(d.password_file, "deploy.password_file"),
            TlsOptions(d.ca_file, d.cert_file, d.key_file, d.tls_verify_hostname))


#: amqtt's loggers that report its PUBACK timeouts
NOISY = ("amqtt.mqtt.protocol.handler", "amqtt.broker")


class SlowLinkNotice(logging.Filter):
    """amqtt waits 5 s for a subscriber's PUBACK and then drops the message (hard-coded in
    amqtt 0.12, amqtt issue #391): on a link where a model's blocks take longer, devices lose
    weights chunks and wait for resyncs. amqtt says so with a warning and a traceback per
    message; this turns them into one warning that says what to do, then stays quiet."""

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()  # a failed task's line names its exception
        if "Timeout waiting for PUBACK" not in text and "PUBACK for unknown pending" not in text:
            return True
        if not self.said:
            self.said = True
            log.warning("the embedded broker (amqtt) dropped a message a device did not acknowledge "
                        "within 5 s (amqtt's fixed limit, amqtt issue #391): a link too slow for "
                        "it; devices there wait for resyncs. Use Mosquitto: "
                        "deploy.embedded_broker = \"mosquitto\", or --broker (docs/deploy.md)")
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


CLONE_NEWNET = 0x40000000  # <sched.h>


def enter_netns(name: str) -> None:
    """Move the calling thread into the network namespace `name` (`ip netns add NAME`'s
    /run/netns/NAME; needs root): the sockets it opens from then on live there."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, CLONE_NEWNET)
        elif ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


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
                 allow_anonymous: bool = False, netns: str | None = None):
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
        #: a rehearsed site's broker listens in its gateway's network namespace (ip netns)
        self.netns = netns
        if netns is not None and not port:
            raise TransportError("a broker in a network namespace needs its port given")
        self.port = port or free_port(host)
        self._loop = asyncio.new_event_loop()
        self._broker = None
        self._thread = threading.Thread(target=self._serve, name="amqtt", daemon=True)
        self._notice = SlowLinkNotice()

    @property
    def url(self) -> str:
        """Where devices and the coordinator reach it: mqtt://HOST:PORT."""
        return f"mqtt://{self.host}:{self.port}"

    def _serve(self) -> None:
        if self.netns is not None:  # the sockets this thread opens live there
            enter_netns(self.netns)
        self._loop.run_forever()

    def start(self) -> None:
        """Start amqtt on its own event-loop thread and wait until it listens; a port in use is a
        one-line TransportError."""
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
        for name in NOISY:
            logging.getLogger(name).addFilter(self._notice)

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
        for name in NOISY:
            logging.getLogger(name).removeFilter(self._notice)
        gc.collect()


def local_mosquitto_conf(broker_conf: str, port: int, passwd: Path, acl: Path, home: Path,
                         user: str, host: str = "127.0.0.1") -> str:
    """The project's production broker.conf turned into a local copy for tests and rehearsals:
    this port on `host` (loopback, or a rehearsal's bridge), these password and ACL files,
    persistence under `home`, logs to stderr, and `user` to run as (as root, Mosquitto drops to
    a user without access)."""
    import re

    conf = re.sub(r"^listener 1883 0\.0\.0\.0$", f"listener {port} {host}", broker_conf,
                  flags=re.M)
    conf = conf.replace("/etc/mosquitto/fedseq.passwd", str(passwd))
    conf = conf.replace("/etc/mosquitto/fedseq.acl", str(acl))
    conf = conf.replace("/var/lib/mosquitto/", f"{home}/")
    conf = conf.replace("log_dest syslog", "log_dest stderr") + f"\nuser {user}\n"
    if f"listener {port} {host}" not in conf or "allow_anonymous false" not in conf:
        raise ValueError("broker.conf no longer has the expected listener/anonymous lines")
    return conf


def dynamic_security_plugin() -> str | None:
    """This machine's Mosquitto dynamic-security plugin (Debian's mosquitto package has it), or
    None."""
    import glob

    found = sorted(glob.glob("/usr/lib/*/mosquitto_dynamic_security.so")) + sorted(
        glob.glob("/usr/lib/mosquitto_dynamic_security.so"))
    return found[0] if found else None


def with_guard(conf: str, home: Path, guard: str | None) -> str:
    """broker.conf's dynamic-security lines (the flood guard) for a local copy: with `guard` (the
    password of the guard login, GUARD_LOGIN) the plugin's file is made under `home` and the
    plugin is this machine's; without, the lines go (the password file and ACL alone)."""
    import re

    lines = re.compile(r"^(plugin|plugin_opt_config_file) .*$", re.M)
    plugin = dynamic_security_plugin()
    if guard is None or plugin is None:
        if guard is not None:
            raise TransportError("the flood guard needs Mosquitto's dynamic-security plugin "
                                 "(mosquitto_dynamic_security.so, in Debian's mosquitto package)")
        return lines.sub("", conf)
    store = home / "dynamic-security.json"
    if not store.exists():
        subprocess.run(["mosquitto_ctrl", "dynsec", "init", str(store), GUARD_LOGIN],
                       input=f"{guard}\n{guard}\n", text=True, check=True, capture_output=True)
        limit_guard_role(store)
    conf = re.sub(r"^plugin /.*$", f"plugin {plugin}", conf, flags=re.M)
    return re.sub(r"^plugin_opt_config_file .*$", f"plugin_opt_config_file {store}", conf, flags=re.M)


#: the login broker.conf's flood guard knows (the dynamic-security plugin's admin)
GUARD_LOGIN = "fedseq-guard"
#: what the guard's role may touch: the plugin's control topic (list, create, disable and delete
#: logins), nothing the fleet publishes
GUARD_TOPICS = "$CONTROL/dynamic-security/"


def limit_guard_role(store: Path, login: str = GUARD_LOGIN) -> bool:
    """The guard login's roles in the dynamic-security file keep only the plugin's control topic:
    `mosquitto_ctrl dynsec init` gives its admin '#' and $SYS/# too, which the guard never reads
    (docs/security.md). The ansible broker role does the same with limit_guard_role.py. Returns
    whether the file changed."""
    import json

    from fedseq.common.files import atomic_write

    data = json.loads(store.read_text())
    roles = {r.get("rolename") for c in data.get("clients", []) if c.get("username") == login
             for r in c.get("roles", [])}
    changed = False
    for role in data.get("roles", []):
        if role.get("rolename") in roles:
            kept = [{**a, "priority": 1} for a in role.get("acls", [])
                    if str(a.get("topic", "")).startswith(GUARD_TOPICS)]
            # the plugin's default lets any of its logins receive what it subscribed to: denied
            kept += [{"acltype": kind, "topic": "#", "priority": 0, "allow": False}
                     for kind in ("publishClientSend", "publishClientReceive", "subscribePattern")]
            changed |= kept != role.get("acls", [])
            role["acls"] = kept
    if changed:
        atomic_write(store, json.dumps(data, indent=2).encode(), mode=0o600)
    return changed


def write_local_mosquitto(home: Path, port: int, logins: dict[str, str], broker_conf: Path,
                          acl: Path, user: str, settings: dict[str, str] | None = None,
                          log_file: Path | None = None, host: str = "127.0.0.1",
                          guard: str | None = None) -> Path:
    """The files of a loopback Mosquitto under `home` (tests, benchmarks, rehearsals): a password
    file of these logins (login -> password, hashed by one mosquitto_passwd -U however many),
    a copy of the ACL, the flood guard's plugin file with the guard login's password `guard`
    (`with_guard`; none: no guard), and mosquitto.conf from `local_mosquitto_conf`, where `settings` replace
    broker.conf's lines of the same keys and `log_file` takes the log instead of stderr. Returns
    the config's path: `mosquitto -c PATH`."""
    passwd, acl_copy, conf_path = home / "passwd", home / "acl", home / "mosquitto.conf"
    conf = local_mosquitto_conf(broker_conf.read_text(), port, passwd, acl_copy, home, user, host)
    conf = with_guard(conf, home, guard)
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


class LocalMosquitto:
    """Mosquitto for one run (deploy.embedded_broker = "mosquitto"): the project's broker.conf and
    ACL on host:port (port 0 = a free one), its files under `home`, one login: `user` with a
    password made for this run (the ACL's coordinator account, which the run's --local-devices
    share). Unlike amqtt it never drops a message to a slow subscriber (no in-session retries
    since Mosquitto 1.5): a rehearsal's wifi-poor and 3g-fast links need it."""

    def __init__(self, host: str, port: int, home: Path, user: str = "coordinator"):
        import getpass
        import secrets

        from fedseq.common.files import atomic_write

        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(exe).exists() or not shutil.which("mosquitto_passwd"):
            raise TransportError("deploy.embedded_broker = \"mosquitto\" needs Mosquitto: "
                                 "apt-get install mosquitto (or use the embedded amqtt)")
        if not BROKER_CONF.is_file() or not PROJECT_ACL.is_file():
            raise TransportError(f"deploy.embedded_broker = \"mosquitto\" reads the project's "
                                 f"broker.conf and ACL from a source checkout; {BROKER_CONF} is "
                                 "not there (install fedseq from its checkout: pip install -e)")
        self.host, self.port, self.user = host, port or free_port(host), user
        password = secrets.token_urlsafe(24)
        self.secret = home / f"{user}.pw"
        atomic_write(self.secret, f"{password}\n".encode(), mode=0o600)
        # the flood guard, on wherever this Mosquitto has its dynamic-security plugin: a login
        # of its own with a password made for the run (None: no plugin here, no guard)
        self.guard_secret: Path | None = None
        guard = None
        if dynamic_security_plugin() is not None and shutil.which("mosquitto_ctrl"):
            guard = secrets.token_urlsafe(36)
            self.guard_secret = home / f"{GUARD_LOGIN}.pw"
            atomic_write(self.guard_secret, f"{guard}\n".encode(), mode=0o600)
        self.log_file = home / "mosquitto.log"
        self.conf = write_local_mosquitto(home, self.port, {user: password}, BROKER_CONF,
                                          PROJECT_ACL, getpass.getuser(), log_file=self.log_file,
                                          host=host, guard=guard)
        self.command = [exe, "-c", str(self.conf)]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Where devices and the coordinator reach it: mqtt://HOST:PORT."""
        return f"mqtt://{self.host}:{self.port}"

    def __enter__(self) -> LocalMosquitto:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 0.5):
                return self
            time.sleep(0.1)
        self.__exit__()
        said = self.log_file.read_text().strip().splitlines()[-1:] if self.log_file.exists() else []
        raise TransportError(f"Mosquitto did not start on {self.host}:{self.port}"
                             + (f" ({said[0]})" if said else "")
                             + "; pick another deploy.port (0 = any free one)")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
