"""The documentation's reference pages, generated from the code so they cannot drift from it:
every configuration key (the pydantic models' fields and descriptions), every command and option
(the CLIs themselves) and the wire protocol's messages (the message models). `docs/hooks.py`
adds them to the MkDocs site at build time; `python docs/reference_pages.py DIR` writes them."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeGuard

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

#: The generated pages: path under docs/ -> the function that writes it.
PAGES = {
    "reference/config.md": "config_page",
    "reference/cli.md": "cli_page",
    "reference/protocol-messages.md": "messages_page",
}


def _type(annotation: Any) -> str:
    """A field's type as a reader says it: `float`, `int or none`, `list of int`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_type(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or none" if type(None) in args else "")
    if origin in (list,):
        return f"list of {_type(args[0])}" if args else "list"
    if origin in (dict,):
        return f"table of {_type(args[0])} to {_type(args[1])}" if args else "table"
    if origin in (tuple,):
        return "(" + ", ".join(_type(a) for a in args) + ")"
    if is_table(annotation):
        return f"table ({annotation.__name__})"
    if annotation is Path:
        return "path"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _limits(field: FieldInfo) -> str:
    """Its constraints: `>= 1`, `< 1`, `at most 100 long`, `matches ^...$`."""
    out = []
    for m in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sign} {getattr(m, attr)}")
        if getattr(m, "max_length", None) is not None:
            out.append(f"at most {m.max_length} long")
        if getattr(m, "pattern", None) is not None:
            out.append(f"matches `{m.pattern}`")
    return ", ".join(out)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(see description)"
        if isinstance(value, BaseModel):
            return "(its table)"
        if isinstance(value, Path):
            return "(see description)"  # a machine's own path: the description says which
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "none"
    return f"`{json.dumps(value) if not isinstance(value, Path) else str(value)}`"


def is_table(annotation: Any) -> TypeGuard[type[BaseModel]]:
    """Whether a field's type is a table of its own (a pydantic model: a config section)."""
    return inspect.isclass(annotation) and issubclass(annotation, BaseModel)


def _text(text: str) -> str:
    """Generated text as Markdown shows it: `<`, `>` and `&` outside code spans escaped, so help
    that says `OUT/<setting>/...` is not read as HTML (a `<s>` struck whole paragraphs through)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    return _text(" ".join(text.split())).replace("|", "\\|")


def field_rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """Every leaf field of `model`, with its dotted key (sections expanded, lists of tables not)."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if is_table(ann):
            rows.extend(field_rows(ann, f"{prefix}{name}."))
        else:
            rows.append((prefix + name, field))
    return rows


#: the keys whose values are registered names, and their registry group
REGISTERED_KEYS = {"algorithm.name": "algorithms", "model.name": "models", "data.dataset": "datasets",
                   "aggregation.rule": "aggregators"}


def _registered(key: str) -> str:
    """The names a registry-checked key takes, from the registry itself (never a copied list):
    here, fedseq's built-ins and whatever plugins the machine that builds the site has."""
    if key not in REGISTERED_KEYS:
        return ""
    from fedseq.common.registry import REGISTRY

    return "one of " + ", ".join(f"`{n}`" for n in REGISTRY.names(REGISTERED_KEYS[key]))


def _table(rows: list[tuple[str, FieldInfo]]) -> list[str]:
    """A Markdown table of fields (dotted key, field)."""
    lines = ["| key | type | default | limits | description |", "| --- | --- | --- | --- | --- |"]
    for key, field in rows:
        limits = _registered(key) or _limits(field)
        lines.append(f"| `{key}` | {_cell(_type(field.annotation))} | {_cell(_default(field))} | "
                     f"{_cell(limits)} | {_cell(field.description or '')} |")
    return lines


def _doc(obj: Any) -> str:
    """A class's docstring as Markdown shows it (escaped: `[algorithm.<name>]`)."""
    return _text(inspect.cleandoc(obj.__doc__ or ""))


def config_page() -> str:
    from fedseq.client.settings import ClientSettings
    from fedseq.common.config import ExperimentConfig

    out = ["# Configuration keys", "",
           "Generated from `common/config.py` and `client/settings.py` when the site is built: a key "
           "added to the code appears here with its description. Give an experiment's keys in its TOML "
           "file (`[train]` then `lr = 0.005`) or on the command line (`--set train.lr=0.005`, a TOML "
           "value; repeatable). A bad key or value stops the command with a one-line message and "
           "exit code 2.", "", "## The experiment (`fedseq-sim`, `fedseq-server start`)", "",
           _doc(ExperimentConfig), ""]
    fields = ExperimentConfig.model_fields
    out += ["### Top level", "",
            *_table([(n, f) for n, f in fields.items() if not is_table(f.annotation)]), ""]
    for name, f in fields.items():
        section = f.annotation
        if not is_table(section):
            continue
        out += [f"### [{name}]", "", _doc(section), "", *_table(field_rows(section, f"{name}.")), ""]
        if name == "algorithm":
            out += _algorithm_tables()
        for sub in _nested_tables(section):
            out += [f"Each entry of a list of `{sub.__name__}`: {_doc(sub)}", "",
                    *_table(field_rows(sub)), ""]
    out += ["## A device (`fedseq-client`)", "",
            "Settings of the device daemon: a TOML file (`--config /etc/fedseq/client.toml`), "
            "`FEDSEQ_<KEY>` environment variables (`FEDSEQ_DEVICE=jetson01`) and flags, in rising "
            "precedence.", "", *_table(field_rows(ClientSettings)), ""]
    return "\n".join(out)


def _algorithm_tables() -> list[str]:
    """Every [algorithm.<name>] table, from the registry's parameter models, and the former flat
    keys that still map to them."""
    from fedseq.common.algorithms import ALGORITHMS
    from fedseq.common.config import FORMER_KEYS

    out = []
    for name, cls in ALGORITHMS.items():
        if cls.params_model is not None:
            out += [f"#### [algorithm.{name}]", "",
                    *_table(field_rows(cls.params_model, f"algorithm.{name}.")), ""]
    out += ["Former keys: a config that uses one of these flat `[algorithm]` keys keeps working; "
            "its value moves to the table(s) named.", "",
            "| former key | now |", "| --- | --- |",
            *(f"| `algorithm.{k}` | {', '.join(f'`algorithm.{t}`' for t in v)} |"
              for k, v in FORMER_KEYS.items()), ""]
    return out


def _nested_tables(model: type[BaseModel]) -> list[type[BaseModel]]:
    """Models inside lists of `model`'s fields ([fleet]'s devices)."""
    found = []
    for f in model.model_fields.values():
        for arg in typing.get_args(f.annotation):
            if is_table(arg):
                found.append(arg)
    return found


def _click_params(cmd: Any, ctx: Any) -> list[str]:
    lines = ["| argument or option | description |", "| --- | --- |"]
    for p in cmd.params:
        if getattr(p, "hidden", False):
            continue
        if p.param_type_name == "argument":
            names, help_ = f"`{(p.name or '').upper()}`" + (" ..." if p.nargs == -1 else ""), p.help or ""
        else:
            names, help_ = p.get_help_record(ctx)
            names = f"`{names}`"
        lines.append(f"| {_cell(names)} | {_cell(help_)} |")  # help_ says a default there is
    return lines


def _click_command(name: str, cmd: Any, level: int) -> list[str]:
    """A typer (click) command's section; a group's commands each in a section of its own."""
    ctx = typer.Context(cmd)
    out = [f"{'#' * level} `{name}`", ""]
    if cmd.help:
        out += [_text(inspect.cleandoc(cmd.help).split("\f")[0]), ""]
    if hasattr(cmd, "list_commands"):  # a group
        for sub_name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, sub_name)
            if sub is not None and not sub.hidden:
                out += _click_command(f"{name} {sub_name}", sub, min(level + 1, 4))
        return out
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    return [*out, "```", f"{name} {usage}", "```", "", *_click_params(cmd, ctx), ""]


def _argparse_command(name: str, parser: argparse.ArgumentParser) -> list[str]:
    out = [f"## `{name}`", "", _text(parser.description or ""), "", "```",
           " ".join(parser.format_usage().split())[len("usage: "):], "```", "",
           "| argument or option | values | default | description |", "| --- | --- | --- | --- |"]
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        names = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest.upper()}`"
        values = ", ".join(f"`{c}`" for c in a.choices) if a.choices else \
            (getattr(a.type, "__name__", "") if a.type else ("flag" if a.nargs == 0 else "text"))
        default = "" if a.default in (None, argparse.SUPPRESS) else f"`{a.default}`"
        out.append(f"| {names} | {_cell(values)} | {_cell(default)} | {_cell(a.help or '')} |")
    return [*out, ""]


def cli_page() -> str:
    from fedseq.client.cli import parser
    from fedseq.server.cli.commands import server_app, sim
    from fedseq.server.cli.tools import app as tools_app

    sim_app = typer.Typer(add_completion=False)
    sim_app.command()(sim)
    out = ["# Commands", "",
           "Generated from the command-line interfaces themselves when the site is built (typer for "
           "the coordinator's commands, argparse for the device's). Every command also answers "
           "`--help`.", ""]
    out += _click_command("fedseq-sim", typer.main.get_command(sim_app), 2)
    out += _click_command("fedseq-server", typer.main.get_command(server_app), 2)
    out += _click_command("fedseq", typer.main.get_command(tools_app), 2)
    out += _argparse_command("fedseq-client", parser())
    return "\n".join(out)


def messages_page() -> str:
    from fedseq.common.protocol import messages

    models: list[type[BaseModel]] = [
        m for m in vars(messages).values()
        if isinstance(m, type) and issubclass(m, messages.Message) and m is not messages.Message]
    models.sort(key=lambda m: inspect.getsourcelines(m)[1])
    out = ["# Protocol messages", "",
           f"Generated from `common/protocol/messages.py` when the site is built (protocol version "
           f"{messages.PROTOCOL_VERSION}). Every JSON message carries `v`, the protocol version, and "
           "refuses unknown fields; a message that fails validation is refused in one line and "
           "changes nothing. Which topic carries which message, and the tensor frames, are in "
           "[the protocol](../protocol.md).", "", _doc(messages.Message), ""]
    for m in models:
        schema = json.dumps(m.model_json_schema(), indent=1, sort_keys=True)
        out += [f"## {m.__name__}", "", _doc(m), "", *_table(field_rows(m)), "",
                '??? note "JSON schema"', "", "    ```json",
                *("    " + line for line in schema.splitlines()), "    ```", ""]
    return "\n".join(out)


def write(folder: Path) -> list[Path]:
    """Write every generated page under `folder` (docs/); the paths written."""
    written = []
    for rel, func in PAGES.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(globals()[func]() + "\n")
        written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover - a maintainer's look at the pages
    for p in write(Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")):
        print(p)
