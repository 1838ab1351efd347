"""The flood guard: a device login that floods pays for it at the broker, not in the coordinator.

The inbox drops a login's messages unread once the login has spent its budget (budget.py), but
each dropped message still costs the coordinator's network thread its read: a login publishing
tiny messages as fast as its connection goes delays every other device's messages by seconds.
On Mosquitto with its dynamic-security plugin (broker.conf loads it beside the password file and
the ACL), the guard, a login of its own that holds the plugin's admin role (deploy.guard_username,
deploy.guard_password_file), disables a login that keeps flooding: the broker closes its
connections and refuses its logins, so its messages never reach the coordinator again. After a
cool-down the guard lets it in again (the plugin forgets the login; the password file and the
ACL apply as before); each further flood doubles the cool-down, up to MAX_COOLDOWN_S.

A login is disabled through the plugin as a client of that name with no password, marked with
MARK; the guard deletes every client so marked when it starts and when it stops, so a crashed
coordinator locks no device out past its next start. On amqtt (no such plugin) and on a broker
without it, the inbox's budget is the only bound (docs/security.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fedseq.common.errors import ConfigError, FedseqError
from fedseq.common.files import HOW_TO_MAKE_A_SECRET, read_private_secret
from fedseq.common.protocol.link import Link, TlsOptions, session_id
from fedseq.common.text import printable

log = logging.getLogger(__name__)

#: messages dropped unread within FLOOD_WINDOW_S that make a login a flooder: an honest device
#: never has one dropped (its budget holds two whole updates of every client, bench/flood.py)
FLOOD_DROPS, FLOOD_WINDOW_S = 100, 5.0
#: how long a flooding login stays disabled the first time, and at most
COOLDOWN_S, MAX_COOLDOWN_S = 60.0, 3600.0
#: the plugin's control topics (Mosquitto 2.0)
CONTROL = "$CONTROL/dynamic-security/v1"
MARK = "fedseq guard: disabled for flooding"


def guard_password(path: Path | None) -> str:
    """The flood guard's password (deploy.guard_password_file): its login administers the
    broker's logins, so its file is held to the cluster secret's checks (readable by its owner
    alone, at least 32 characters of 8 distinct ones); a one-line ConfigError otherwise."""
    if path is None:
        raise ConfigError("deploy.guard_username needs deploy.guard_password_file, the file of its "
                          f"password ({HOW_TO_MAKE_A_SECRET}; docs/security.md)")
    return read_private_secret(path, f"deploy.guard_password_file {path}",
                               "it can be guessed, and its login administers the broker")


class FloodGuard:
    """Counts each device login's dropped messages (`dropped`, network thread) and disables at
    the broker a login over FLOOD_DROPS in FLOOD_WINDOW_S; `enable_due` (any thread, called
    every few seconds) lets logins in again after their cool-down."""

    def __init__(self, url: str, username: str, password: str | None, tls: TlsOptions | None,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.link = Link(session_id("fedseq-guard"), url, [CONTROL + "/response"],
                         self._response, username=username, password=password, tls=tls)
        self._lock = threading.Lock()
        self._drops: dict[str, list[float]] = {}  # login -> times of its recent dropped messages
        self._disabled: dict[str, float] = {}  # login -> when it may log in again
        self._floods: dict[str, int] = {}  # login -> how often it was disabled this run
        self._listed = threading.Event()
        self._stopped = threading.Event()
        self._marked: list[str] = []
        self.disabled_total = 0
        self.disabled_at: float | None = None  # when it last disabled a login (its clock)

    def start(self) -> None:
        """Connect as the guard login, and let in every login an earlier guard left disabled."""
        self.link.start(attempts=3)
        self._command([{"command": "listClients", "verbose": True}])
        if self._listed.wait(10):
            self._enable(self._marked)
        threading.Thread(target=self._enabler, name="fedseq-guard", daemon=True).start()

    def _enabler(self) -> None:
        while not self._stopped.wait(1.0):
            self.enable_due()

    def stop(self) -> None:
        """Let every login this guard disabled in again, then disconnect."""
        self._stopped.set()
        try:
            self.enable_all()
        finally:
            self.link.stop()

    def enable_all(self) -> None:
        """Let every login this guard disabled in again now (its flood count stays)."""
        with self._lock:
            names = list(self._disabled)
            self._disabled.clear()
        self._enable(names, wait=True)

    def dropped(self, login: str) -> None:
        """Network thread: one message of `login` was dropped unread (its budget is spent)."""
        now = self.clock()
        with self._lock:
            if login in self._disabled:
                return
            times = self._drops.setdefault(login, [])
            times.append(now)
            while times and times[0] < now - FLOOD_WINDOW_S:
                times.pop(0)
            if len(times) < FLOOD_DROPS:
                return
            n = self._floods[login] = self._floods.get(login, 0) + 1
            cooldown = min(MAX_COOLDOWN_S, COOLDOWN_S * 2 ** (n - 1))
            self._disabled[login] = now + cooldown
            del self._drops[login]
            self.disabled_total += 1
            self.disabled_at = now
        log.warning("disabled the broker login %s for %.0f s: it kept sending after its budget "
                    "was spent (%d messages dropped in %.0f s); flood %d this run",
                    printable(login, 80), cooldown, FLOOD_DROPS, FLOOD_WINDOW_S, n)
        self._command([{"command": "createClient", "username": login, "textname": MARK},
                       {"command": "disableClient", "username": login}])

    def enable_due(self) -> None:
        """Let in again the logins whose cool-down is over."""
        now = self.clock()
        with self._lock:
            due = [name for name, until in self._disabled.items() if until <= now]
            for name in due:
                del self._disabled[name]
        self._enable(due)

    def disabled(self) -> list[str]:
        """The logins disabled at the broker, sorted."""
        with self._lock:
            return sorted(self._disabled)

    def _enable(self, names: list[str], wait: bool = False) -> None:
        if names:
            self._command([{"command": "deleteClient", "username": n} for n in names], wait)

    def _command(self, commands: list[dict], wait: bool = False) -> None:
        try:
            self.link.publish(CONTROL, json.dumps({"commands": commands}).encode(), wait=wait,
                              timeout=5.0)
        except (FedseqError, RuntimeError, ValueError) as exc:
            log.warning("the flood guard could not reach the broker's dynamic-security plugin: %s",
                        exc)

    def _response(self, topic: str, payload: bytes) -> None:
        """The plugin's answers: errors are logged; listClients gives the marked clients."""
        try:
            answers = json.loads(payload).get("responses", [])
        except (ValueError, AttributeError):
            return
        for a in answers if isinstance(answers, list) else []:
            if not isinstance(a, dict):
                continue
            if a.get("error") and a.get("command") != "deleteClient":
                log.warning("the broker's dynamic-security plugin refused %s: %s",
                            printable(str(a.get("command")), 40), printable(str(a["error"]), 200))
            if a.get("command") == "listClients":
                clients = (a.get("data") or {}).get("clients", [])
                self._marked = [c["username"] for c in clients if isinstance(c, dict)
                                and c.get("textname") == MARK and isinstance(c.get("username"), str)]
                self._listed.set()
