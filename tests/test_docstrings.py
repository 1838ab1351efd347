"""Every public definition of fedseq says what it is (issue 81): each public class and function of
common/, server/ and client/, and each public method and property of a public class, has a
docstring, its own or the one of the definition it implements (a pool's `train` reads
`ClientPool.train`'s). And no function is longer than 60 lines, its signature included."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import fedseq.client
import fedseq.common
import fedseq.server

ROOT = Path(__file__).resolve().parent.parent
LONGEST = 60


def _modules():
    for package in (fedseq.common, fedseq.server, fedseq.client):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            yield importlib.import_module(info.name)


def _inherited(cls: type, name: str) -> str | None:
    for base in cls.__mro__[1:]:
        if name in vars(base):
            member = vars(base)[name]
            doc = (member.fget if isinstance(member, property) else member).__doc__
            if doc:
                return doc
    return None


def _undocumented(module) -> list[str]:
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if not inspect.getdoc(obj):
            out.append(f"{module.__name__}.{name}")
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():
            func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            # a def in the class body (not a dataclass field holding a function)
            if attr.startswith("_") or not inspect.isfunction(func) \
                    or func.__qualname__ != f"{obj.__qualname__}.{attr}":
                continue
            if not (func.__doc__ or _inherited(obj, attr)):
                out.append(f"{module.__name__}.{name}.{attr}")
    return out


def test_every_public_definition_has_a_docstring():
    missing = [m for module in _modules() for m in _undocumented(module)]
    assert not missing, f"public definitions without a docstring: {missing}"


def test_no_function_is_longer_than_60_lines():
    long = []
    for package in ("common", "server", "client"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > LONGEST:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions over {LONGEST} lines: {long}"
