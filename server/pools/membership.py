"""Who belongs to a distributed simulation: every rank proves it knows the run's secret before
rank 0 reads anything else from it, and what they exchange until then is JSON through the
rendezvous store, never a pickle.

`fedseq-sim --workers N` makes a secret per run and hands it to the workers it starts in their
environment; a cluster run (torchrun, srun) takes it from FEDSEQ_SECRET or from the file named by
FEDSEQ_SECRET_FILE, the same on every node (docs/security.md says what a cluster run trusts).
Rank 0 publishes a fresh nonce; each rank answers with its hello (versions, host, GPUs) and an
HMAC-SHA256 over the nonce, its rank and the hello; rank 0 checks every answer, then publishes
its verdict, itself signed, which the ranks check before they take part in any collective.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
from typing import Any

import torch.distributed as dist

from fedseq.common.errors import ConfigError, TransportError
from fedseq.common.files import read_private_secret, strong_secret

#: the largest hello a rank may store (an honest one is a few hundred bytes)
HELLO_BYTES = 64 << 10
SECRET_ENV, SECRET_FILE_ENV = "FEDSEQ_SECRET", "FEDSEQ_SECRET_FILE"


def new_secret() -> str:
    """A secret for one `--workers` run (its workers get it in their environment)."""
    return secrets.token_hex(32)


#: what a weak cluster secret risks (strong_secret's message)
_OFFLINE = "anyone who sees one hello can guess it offline"


def cluster_secret() -> str:
    """The run's secret under a launcher: FEDSEQ_SECRET, or the first line of the file
    FEDSEQ_SECRET_FILE names (readable by its owner alone); ConfigError in one line when
    neither gives one, when it is weak (common/files.py strong_secret), or when the file is
    readable by others."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return read_private_secret(path, f"{SECRET_FILE_ENV}={path}", _OFFLINE)
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise ConfigError(
            f"a distributed simulation across processes needs a shared secret that every rank "
            f"proves it knows: export {SECRET_ENV}=$(openssl rand -hex 32) (the same value on "
            f"every node, before torchrun or srun), or {SECRET_FILE_ENV}=PATH to a file only you "
            "can read")
    return strong_secret(secret, SECRET_ENV, _OFFLINE)


def _mac(secret: str, *parts: str) -> str:
    return hmac.new(secret.encode(), "|".join(parts).encode(), hashlib.sha256).hexdigest()


def _get(store: Any, key: str, timeout: datetime.timedelta) -> bytes:
    """`key`'s value, waiting for it at most `timeout`."""
    store.wait([key], timeout)
    return bytes(store.get(key))


def admit_ranks(store: Any, world: int, secret: str, timeout: datetime.timedelta
                ) -> list[dict[str, Any]]:
    """Rank 0: every other rank's hello (index = rank - 1), each proven with the run's secret;
    TransportError naming the first rank that did not prove it (the ranks are told too)."""
    nonce = secrets.token_hex(16)
    store.set("fedseq/nonce", nonce)
    hellos: list[dict[str, Any]] = []
    problem = None
    for rank in range(1, world):
        try:
            raw = _get(store, f"fedseq/hello/{rank}", timeout)
        except (RuntimeError, dist.DistError) as exc:
            problem = f"rank {rank} said nothing within {timeout.total_seconds():.0f} s ({exc})"
            break
        problem = _hello_problem(raw, rank, nonce, secret)
        if problem is not None:
            break
        hellos.append(json.loads(json.loads(raw)["hello"]))
    verdict = "ok" if problem is None else f"refused: {problem}"
    store.set("fedseq/verdict", json.dumps({"verdict": verdict,
                                            "mac": _mac(secret, nonce, "verdict", verdict)}))
    if problem is not None:
        raise TransportError(f"a simulation worker was refused: {problem}; every rank needs the "
                             f"run's secret ({SECRET_ENV} or {SECRET_FILE_ENV}, the same on every "
                             "node)")
    return hellos


def _hello_problem(raw: bytes, rank: int, nonce: str, secret: str) -> str | None:
    """Why `raw` is not rank `rank`'s proven hello, or None."""
    if len(raw) > HELLO_BYTES:
        return f"rank {rank}'s hello is {len(raw)} bytes (at most {HELLO_BYTES})"
    try:
        msg = json.loads(raw)
        body, mac = msg["hello"], msg["mac"]
        hello = json.loads(body)
        ok = isinstance(mac, str) and hmac.compare_digest(mac, _mac(secret, nonce, str(rank), body))
    except (ValueError, KeyError, TypeError):
        return f"rank {rank}'s hello is not what a fedseq rank sends"
    if not ok:
        return f"rank {rank} does not know the run's secret"
    if not isinstance(hello, dict) or hello.get("rank") != rank:
        return f"rank {rank}'s hello names another rank"
    return None


def prove_membership(store: Any, rank: int, secret: str, hello: dict[str, Any],
                     timeout: datetime.timedelta) -> None:
    """A rank other than 0: answer rank 0's nonce with `hello` and the proof, then wait for rank
    0's verdict (TransportError when refused, or when the verdict is not rank 0's own)."""
    nonce = _get(store, "fedseq/nonce", timeout).decode()
    body = json.dumps(hello, sort_keys=True)
    store.set(f"fedseq/hello/{rank}", json.dumps({"hello": body,
                                                  "mac": _mac(secret, nonce, str(rank), body)}))
    try:
        msg = json.loads(_get(store, "fedseq/verdict", timeout))
        verdict, mac = str(msg["verdict"]), str(msg["mac"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TransportError("rank 0's verdict is unreadable") from exc
    if not hmac.compare_digest(mac, _mac(secret, nonce, "verdict", verdict)):
        raise TransportError("rank 0's verdict is not signed with this rank's secret (it refused "
                             f"this rank, or runs another run): check {SECRET_ENV}, the same on "
                             "every node")
    if verdict != "ok":
        raise TransportError(f"rank 0 {verdict}")
