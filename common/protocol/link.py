"""One paho-mqtt connection with the behaviour both sides need on flaky networks: TLS, a last will,
a first connection that says why it fails, reconnects with backoff, subscriptions renewed on every
connect, chunked frame publishing."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import logging
import secrets
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable  # subscripted at run time below: typing works on Python 3.8
from urllib.parse import urlparse

import paho.mqtt.client as mqtt

from fedseq.common.errors import LoginRefused, TransportError
from fedseq.common.protocol.frames import CHUNK_BYTES, pack_chunk, split_frame
from fedseq.common.protocol.messages import Message

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], None]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.lru_cache(maxsize=None)
def keep_large_buffers() -> bool:
    """Let glibc's malloc reuse multi-MB buffers instead of mapping and unmapping each one.

    Every 1 MiB chunk paho reads or writes, and every 2.3 MB frame, is a fresh allocation; above
    glibc's mmap threshold each is a new mapping whose pages fault in one by one and go back to
    the kernel when freed. Serving up to 8 MiB from the heap and keeping 32 MiB of free heap cuts
    paho's CPU per 2.3 MB frame from 3.9-5.0 to 1.8-2.1 ms received and from 3.8-4.8 to 2.4-2.6 ms
    sent (bench/paho_frame.py); the daemon's peak RSS stays within its 400 MB (bench/footprint.py).
    No-op (False) where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 8 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 32 << 20))


@dataclass(frozen=True)
class TlsOptions:
    """TLS for an mqtts:// broker: the CA that signed its certificate (None: the system's CAs),
    optionally this side's certificate and key (mutual TLS)."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    verify_hostname: bool = True


def parse_broker_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of mqtt://HOST[:1883] or mqtts://HOST[:8883]."""
    u = urlparse(url if "://" in url else f"mqtt://{url}")
    scheme = "mqtt" if u.scheme == "tcp" else u.scheme
    try:
        port = u.port
    except ValueError as exc:
        raise TransportError(f"broker URL {url!r}: {exc}") from exc
    if scheme not in ("mqtt", "mqtts") or not u.hostname:
        raise TransportError(f"broker URL {url!r} is not mqtt://HOST:PORT or mqtts://HOST:PORT")
    return scheme, u.hostname, port or (8883 if scheme == "mqtts" else 1883)


def tls_context(tls: TlsOptions) -> ssl.SSLContext:
    """A client TLS context; a missing or unreadable file is a one-line TransportError."""
    for what, path in (("ca_file", tls.ca_file), ("cert_file", tls.cert_file),
                       ("key_file", tls.key_file)):
        if path is not None and not Path(path).is_file():
            raise TransportError(f"TLS {what} {path} does not exist; point {what} at a PEM file")
    if (tls.cert_file is None) != (tls.key_file is None):
        raise TransportError("TLS needs both cert_file and key_file for a client certificate")
    try:
        ctx = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
        if tls.cert_file is not None:
            ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    except (ssl.SSLError, OSError) as exc:
        raise TransportError(f"TLS files unusable ({exc}); check that they are PEM and that the key "
                             "matches the certificate") from exc
    ctx.check_hostname = tls.verify_hostname
    return ctx


def explain_tls_error(url: str, exc: ssl.SSLError) -> str:
    """One line: what the TLS handshake said and how to fix it."""
    text = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        if "expired" in text:
            fix = "the broker's certificate has expired: issue a new one from your CA"
        elif "hostname" in text.lower() or "IP address mismatch" in text:
            fix = ("the broker's certificate does not name this host: connect by a name in its "
                   "subjectAltName, or reissue it")
        else:
            fix = "the broker's certificate is not signed by ca_file: give the CA that signed it"
        return f"TLS handshake with {url} failed ({text}): {fix}"
    low = text.lower()
    if "expired" in low:
        fix = "the broker rejected this side's certificate as expired: issue a new client certificate"
    elif "unknown ca" in low or "certificate required" in low or "bad certificate" in low:
        fix = ("the broker rejected this side's certificate: give cert_file/key_file signed by the "
               "broker's CA")
    elif "wrong version" in low or "record layer" in low:
        fix = "the port does not speak TLS: use mqtt:// for a plain listener or the TLS port (8883)"
    else:
        fix = "check ca_file, cert_file and key_file against the broker's TLS listener"
    return f"TLS handshake with {url} failed ({text}): {fix}"


def explain_refusal(url: str, reason: object, username: str | None) -> str:
    """One line for a CONNACK refusal."""
    text = str(reason)
    if "user name or password" in text.lower() or "not authorized" in text.lower():
        who = f"user {username!r}" if username else "an anonymous login"
        return (f"broker {url} refused {who} ({text}): check the user name and password file "
                "against the broker's password file (device accounts are named after the device)")
    return f"broker {url} refused the connection ({text})"


def _no_delay(client, userdata, sock) -> None:
    """Disable Nagle: small messages (steps, chunk tails, acks) otherwise wait for delayed ACKs,
    about 40 ms per exchange on Linux (measured with bench/mqtt_round.py)."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def session_id(role: str) -> str:
    """A client id nobody can guess: `<role>-<16 random hex digits>`.

    MQTT lets a CONNECT with a client id already in use disconnect the holder, and a broker's ACL
    binds topics to logins, not client ids. With predictable ids (fedseq-device-<name>) any login
    could knock any device, or the coordinator, off the broker every few seconds. The role keeps
    broker logs readable; a fresh id per process means a restarted daemon's old session is simply
    replaced by its last will."""
    return f"{role}-{secrets.token_hex(8)}"


class Link:
    """One MQTT connection for either side (see the module docstring): connect with clear errors,
    reconnect with backoff, re-subscribe and run hooks on every connect, publish chunked frames.
    `bytes_out` / `bytes_in` count payload bytes published and received (a deployment's
    wire_bytes)."""

    def __init__(
        self,
        client_id: str,
        url: str,
        subscriptions: list[str],
        on_message: Handler,
        will: tuple[str, bytes] | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: TlsOptions | None = None,
        on_retained: Callable[[str], None] | None = None,
    ):
        self.scheme, self.host, self.port = parse_broker_url(url)
        keep_large_buffers()
        self.url = url
        self.username = username
        self.subscriptions = subscriptions
        self.connected = threading.Event()
        self.bytes_out = 0
        self.bytes_in = 0
        self._on_message = on_message
        # called with the topic of every retained message the broker replays to a subscription
        self.on_retained = on_retained
        self._connack = threading.Event()
        self._refusal: str | None = None
        self._closed: str | None = None
        self._stopping = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True)
        c.max_queued_messages_set(0)
        c.max_inflight_messages_set(100)
        c.reconnect_delay_set(min_delay=1, max_delay=30)
        if self.scheme == "mqtts":
            c.tls_set_context(tls_context(tls or TlsOptions()))
        elif tls is not None and (tls.ca_file or tls.cert_file):
            raise TransportError(f"TLS files given but the broker URL {url} is plain mqtt://; "
                                 "use mqtts://HOST:8883")
        if username:
            c.username_pw_set(username, password)
        if will:
            c.will_set(will[0], will[1], qos=1, retain=True)
        c.on_socket_open = _no_delay
        c.on_connect = self._connected
        c.on_disconnect = self._disconnected
        c.on_message = self._message
        self.client = c
        self._connect_hooks: list[Callable[[], None]] = []
        self._fatal_hooks: list[Callable[[str], None]] = []
        self._refused_in_a_row = 0
        self._was_connected = False

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Run after every (re)connect, after the subscriptions are renewed."""
        self._connect_hooks.append(hook)

    def on_fatal(self, hook: Callable[[str], None]) -> None:
        """Run when the broker has refused three reconnects in a row (credentials revoked)."""
        self._fatal_hooks.append(hook)

    def start(self, attempts: int | None = 1, refusals: int = 1) -> None:
        """Connect (TCP, TLS handshake, MQTT login), then keep the connection in the background.

        An unreachable broker is retried with backoff, a line per attempt, `attempts` times in all
        (None: until stop()); a refused login `refusals` times. Every failure that ends the
        attempts is a TransportError with its cause and fix (LoginRefused for a refused login);
        a TLS verification error is final at once: retrying cannot fix a certificate."""
        delay, tries, refused = 1.0, 0, 0
        while not self._stopping.is_set():
            tries += 1
            problem = self._try_connect()
            if problem is None:
                return
            if self._refusal is not None:
                refused += 1
                if refused >= refusals:
                    raise LoginRefused(problem)
            elif attempts is not None and tries >= attempts:
                raise TransportError(problem)
            log.warning("%s; retrying in %.0f s (attempt %d)", problem, delay, tries)
            self._stopping.wait(delay)
            delay = min(2 * delay, 30.0)
        raise TransportError(f"stopped before connecting to {self.url}")

    def _try_connect(self) -> str | None:
        """One attempt; None when connected, else what went wrong (one line)."""
        self._connack.clear()
        self._refusal = self._closed = None
        try:
            self.client.connect(self.host, self.port, keepalive=30)
        except ssl.SSLError as exc:
            raise TransportError(explain_tls_error(self.url, exc)) from exc
        except OSError as exc:
            cause = exc.strerror or str(exc) or type(exc).__name__
            if self.scheme == "mqtts" and isinstance(exc, ConnectionResetError):
                return (f"broker {self.url} reset the TLS handshake ({cause}): the port probably "
                        "does not speak TLS; use mqtt:// for a plain listener or the TLS port (8883)")
            return (f"cannot reach broker {self.url} ({cause}): check that it runs and that host "
                    "and port are right")
        self.client.loop_start()
        if not self._connack.wait(15):
            self.client.loop_stop()
            with contextlib.suppress(Exception):
                self.client.disconnect()
            return f"broker {self.url} accepted TCP but sent no MQTT answer in 15 s: is it an MQTT port?"
        if self._closed is not None:
            self.client.loop_stop()
            if self.scheme == "mqtts":  # a certificate problem: retrying cannot fix it
                raise TransportError(self._closed)
            return self._closed
        if self._refusal is not None:
            self.client.loop_stop()
            with contextlib.suppress(Exception):
                self.client.disconnect()
            return self._refusal
        return None

    def cancel(self) -> None:
        """Give up connecting (start() raises); an established connection stays up."""
        self._stopping.set()

    def stop(self) -> None:
        """Disconnect and stop the network thread."""
        self._stopping.set()
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()

    def _connected(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            msg = explain_refusal(self.url, reason_code, self.username)
            if self._connack.is_set():  # a reconnect refused: say so once per refusal
                log.error("%s", msg)
                self._refused_in_a_row += 1
                if self._refused_in_a_row >= 3:
                    for fatal in self._fatal_hooks:
                        fatal(msg)
            self._refusal = msg
            self._connack.set()
            return
        self._refusal = None
        self._refused_in_a_row = 0
        for topic in self.subscriptions:
            client.subscribe(topic, qos=1)
        self.connected.set()
        self._connack.set()
        if self._was_connected:
            log.info("reconnected to broker %s", self.url)
        self._was_connected = True
        for hook in self._connect_hooks:
            hook()

    def subscribe_again(self, topic: str) -> None:
        """Subscribe to `topic` again while connected: the broker then re-sends the retained
        messages it matches (MQTT 3.1.1, section 3.8.4); a reconnect subscribes anyway."""
        if self.connected.is_set():
            self.client.subscribe(topic, qos=1)

    def _disconnected(self, client, userdata, flags, reason_code, properties) -> None:
        if not self._connack.is_set():  # closed before answering the login
            if self.scheme == "mqtts":
                self._closed = (
                    f"broker {self.url} closed the TLS connection without answering: it rejected "
                    "this side's certificate (expired, not signed by the broker's CA, or missing "
                    "where the listener requires one); check cert_file and key_file")
            else:
                self._closed = f"broker {self.url} closed the connection without answering ({reason_code})"
            self._connack.set()
            return
        was = self.connected.is_set()
        self.connected.clear()
        if was and reason_code.is_failure and not self._stopping.is_set():
            log.warning("lost broker %s (%s); reconnecting", self.url, reason_code)

    def _message(self, client, userdata, msg) -> None:
        self.bytes_in += len(msg.payload)
        try:
            self._on_message(msg.topic, msg.payload)
            if msg.retain and msg.payload and self.on_retained is not None:
                self.on_retained(msg.topic)
        except Exception:  # a bad message must never kill the network thread
            log.exception("dropped message on %s", msg.topic)

    def publish(self, topic: str, payload: bytes | Message, retain: bool = False,
                wait: bool = False, timeout: float = 30.0) -> mqtt.MQTTMessageInfo:
        """Publish at QoS 1 (optionally waiting up to `timeout` for the broker's ack); the
        message's info says when the broker has acknowledged it (`on_the_way`)."""
        data = payload.encode() if isinstance(payload, Message) else payload
        info = self.client.publish(topic, data, qos=1, retain=retain)
        self.bytes_out += len(data)
        if wait:
            with contextlib.suppress(RuntimeError, ValueError):  # not connected: nothing to wait for
                info.wait_for_publish(timeout)
        return info

    def publish_frame(self, topic_of: Callable[[int], str], header_of: Callable[..., Message],
                      frame: bytes, retain: bool = False, digest: str | None = None
                      ) -> list[mqtt.MQTTMessageInfo]:
        """Publish a frame as chunks; header_of(chunk=i, chunks=n, size=, sha256=) builds headers
        (`digest`: the frame's sha256 where the caller has it already). Returns the chunks'
        message infos."""
        digest = digest or hashlib.sha256(frame).hexdigest()
        chunks = split_frame(frame, CHUNK_BYTES)
        infos = []
        for i, part in enumerate(chunks):
            head = header_of(chunk=i, chunks=len(chunks), size=len(frame), sha256=digest)
            infos.append(self.publish(topic_of(i), pack_chunk(head, part), retain=retain))
        return infos


def on_the_way(sent: object) -> bool:
    """Whether a publish (a message info, a list of them, or None) is still on its way to the
    broker: queued here or sent and not acknowledged yet (QoS 1). A publish refused outright (not
    connected) is not: a reconnect sends it again."""
    infos: list = sent if isinstance(sent, list) else [sent] if sent is not None else []
    return any(getattr(i, "rc", 1) == mqtt.MQTT_ERR_SUCCESS and not i.is_published() for i in infos)
