"""Strings from the wire (device names, errors, stack descriptions, unknown keys) are data wherever
they land: one line of plain text in logs and terminals, a literal cell in markdown and CSV."""

from __future__ import annotations


def printable(value: object, limit: int = 200) -> str:
    """`value` as one line of plain text of at most `limit` characters (plus a count of the rest):
    newlines, ANSI escapes, bidi overrides and every other non-printable character appear as
    their Python escapes, so a sender cannot forge a log line or drive a terminal."""
    text = str(value)
    cut = len(text) - limit
    if cut > 0:
        text = text[:limit]
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return f"{out}...(+{cut} characters)" if cut > 0 else out


def markdown_cell(value: object, limit: int = 200) -> str:
    """`value` as literal text inside a markdown table cell: printable, with every character that
    markdown or HTML would read as syntax there (table bars, emphasis, links, tags, code, math,
    entities) escaped; a cell never starts a line, so heading and list marks are plain."""
    text = printable(value, limit)
    return "".join("\\" + c if c in "\\`*_[]<>|~$&" else c for c in text)


def csv_cell(value: object) -> object:
    """`value` for a CSV cell a spreadsheet opens as data: text that would be read as a formula
    (starting with = + - @, a tab or a carriage return) gets a leading apostrophe; numbers and
    None pass unchanged."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def plot_label(value: object, limit: int = 80) -> str:
    """`value` as a matplotlib label shown as written: printable, `$` escaped (matplotlib would
    read text between two `$` as mathtext, and abort the figure on invalid mathtext)."""
    return printable(value, limit).replace("$", "\\$")
