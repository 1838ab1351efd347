"""One error hierarchy per boundary. Each message is one line saying what is wrong and how to fix it.

Every CLI ends a FedseqError with one line, `error: <message>`, and exit code 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class FedseqError(Exception):
    """Base of every error fedseq raises on purpose."""


class ConfigError(FedseqError):
    """A config file, key, value or command-line option is unusable."""


class DatasetError(FedseqError):
    """A dataset file is missing or malformed."""


class ProtocolError(FedseqError):
    """A message or tensor frame failed validation."""


class TransportError(FedseqError):
    """The broker or a peer could not be reached or misbehaved."""


class LoginRefused(TransportError):
    """The broker answered, and said no: retrying with the same credentials will not help."""


class AggregationError(FedseqError):
    """A round's aggregate is not finite: the round is refused and the global model kept."""


class ValidationProblem(NamedTuple):
    """The first problem of a pydantic ValidationError, ready for a one-line message."""

    where: str  # dotted location, "" for the whole object
    msg: str  # pydantic's message, cleaned up; with the offending value where it helps
    kind: str  # pydantic's error type, e.g. "missing", "extra_forbidden"
    more: str  # " (+N more)" when there are further problems, else ""


def validation_problem(exc: Any) -> ValidationProblem:
    """What is wrong, first, in a pydantic ValidationError (the four places that turn one into a
    one-line error, config, settings, wire messages and a received run config, share this)."""
    errors = exc.errors()
    err = errors[0]
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling)"
    elif err["type"] == "value_error" and msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    elif "input" in err and not isinstance(err["input"], dict) and err["type"] != "missing":
        got = repr(err["input"])
        msg = f"{msg} (got {got[:80]}{'...' if len(got) > 80 else ''})"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return ValidationProblem(".".join(str(p) for p in err["loc"]), msg, err["type"], more)
