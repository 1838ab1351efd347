"""One paho-mqtt connection with the behaviour both sides need on flaky networks: a last will,
reconnects with backoff, subscriptions renewed on every connect, chunked frame publishing."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlparse

import paho.mqtt.client as mqtt

from fedseq.common.errors import TransportError
from fedseq.common.protocol.frames import CHUNK_BYTES, pack_chunk, split_frame
from fedseq.common.protocol.messages import Message

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], None]


def parse_broker_url(url: str) -> tuple[str, int]:
    """mqtt://host:port (port 1883 by default)."""
    u = urlparse(url if "://" in url else f"mqtt://{url}")
    if u.scheme not in ("mqtt", "tcp") or not u.hostname:
        raise TransportError(f"broker URL {url!r} is not mqtt://HOST:PORT")
    return u.hostname, u.port or 1883


def _no_delay(client, userdata, sock) -> None:
    """Disable Nagle: small messages (steps, chunk tails, acks) otherwise wait for delayed ACKs,
    about 40 ms per exchange on Linux (measured with bench/mqtt_round.py)."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Link:
    def __init__(
        self,
        client_id: str,
        url: str,
        subscriptions: list[str],
        on_message: Handler,
        will: tuple[str, bytes] | None = None,
        username: str | None = None,
        password: str | None = None,
    ):
        self.host, self.port = parse_broker_url(url)
        self.url = url
        self.subscriptions = subscriptions
        self.connected = threading.Event()
        self.bytes_out = 0
        self.bytes_in = 0
        self._on_message = on_message
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True)
        c.max_queued_messages_set(0)
        c.max_inflight_messages_set(100)
        c.reconnect_delay_set(min_delay=1, max_delay=30)
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

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Run after every (re)connect, after the subscriptions are renewed."""
        self._connect_hooks.append(hook)

    def start(self, timeout: float | None = 10.0) -> None:
        try:
            self.client.connect_async(self.host, self.port, keepalive=30)
        except OSError as exc:
            raise TransportError(f"cannot reach broker {self.url}: {exc}") from exc
        self.client.loop_start()
        if timeout is not None and not self.connected.wait(timeout):
            self.client.loop_stop()
            raise TransportError(
                f"no connection to broker {self.url} within {timeout:.0f} s; check that it runs "
                "and that host, port and credentials are right"
            )

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _connected(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("broker %s refused the connection: %s", self.url, reason_code)
            return
        for topic in self.subscriptions:
            client.subscribe(topic, qos=1)
        self.connected.set()
        for hook in self._connect_hooks:
            hook()

    def _disconnected(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if reason_code.is_failure:
            log.warning("lost broker %s (%s); reconnecting", self.url, reason_code)

    def _message(self, client, userdata, msg) -> None:
        self.bytes_in += len(msg.payload)
        try:
            self._on_message(msg.topic, msg.payload)
        except Exception:  # a bad message must never kill the network thread
            log.exception("dropped message on %s", msg.topic)

    def publish(self, topic: str, payload: bytes | Message, retain: bool = False,
                wait: bool = False) -> None:
        data = payload.encode() if isinstance(payload, Message) else payload
        info = self.client.publish(topic, data, qos=1, retain=retain)
        self.bytes_out += len(data)
        if wait:
            info.wait_for_publish(30)

    def publish_frame(self, topic_of: Callable[[int], str], header_of: Callable[..., Message],
                      frame: bytes, retain: bool = False) -> None:
        """Publish a frame as chunks; header_of(chunk=i, chunks=n, size=, sha256=) builds headers."""
        digest = hashlib.sha256(frame).hexdigest()
        chunks = split_frame(frame, CHUNK_BYTES)
        for i, part in enumerate(chunks):
            head = header_of(chunk=i, chunks=len(chunks), size=len(frame), sha256=digest)
            self.publish(topic_of(i), pack_chunk(head, part), retain=retain)
