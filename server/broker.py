"""The embedded amqtt broker: runs inside the coordinator on its own asyncio thread."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

from fedseq.common.errors import TransportError

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedBroker:
    """amqtt on host:port (port 0 = a free one); anonymous, for one-machine runs and tests."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1883):
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

        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._thread.start()

        async def boot():
            broker = Broker({
                "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
                "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                            {"allow_anonymous": True}},
            })
            await broker.start()
            return broker

        try:
            self._broker = asyncio.run_coroutine_threadsafe(boot(), self._loop).result(15)
        except Exception as exc:
            raise TransportError(
                f"cannot start the embedded broker on {self.host}:{self.port} ({exc}); "
                "pick another deploy.port or pass --broker mqtt://HOST:PORT"
            ) from exc

    def stop(self) -> None:
        if self._broker is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(10)
            except Exception:  # shutting down anyway
                log.debug("amqtt shutdown raised", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
