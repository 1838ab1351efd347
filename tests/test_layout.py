"""The house as designed (server/__init__.py): the packages stand in floors, common under client
under server, and server/'s rooms by role in floors of their own; no import runs up a floor, and
no two rooms import each other. Imports are read from the source (every import statement,
TYPE_CHECKING and function-level ones included), so a lazy import cannot hide a wrong arrow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: server/'s rooms and what each may import besides fedseq.common (server/__init__.py)
ROOMS = {
    "privacy": set(),
    "rounds": {"privacy"},
    "pools": {"privacy", "rounds"},
    "report": {"rounds"},
    "ops": {"privacy", "rounds", "pools", "report"},
    "cli": {"privacy", "rounds", "pools", "report", "ops"},
}
#: the packages: each may import the ones named (fedseq.common imports no other)
PACKAGES = {"common": set(), "client": {"common"}, "server": {"common", "client"}}


def _imports(path: Path) -> list[str]:
    """The fedseq modules a file imports, as dotted names."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [n for n in names if n.startswith("fedseq.")]


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_package_imports_one_above_it(package):
    wrong = [f"{f.relative_to(ROOT)} -> {name}" for f in _files(package) for name in _imports(f)
             if name.split(".")[1] not in PACKAGES[package] | {package}]
    assert not wrong, f"imports that run up a floor: {wrong}"


def test_every_file_of_server_stands_in_a_room():
    loose = [f.name for f in (ROOT / "server").glob("*.py") if f.name != "__init__.py"]
    assert not loose, f"server/ files outside the rooms of server/__init__.py: {loose}"
    assert {d.name for d in (ROOT / "server").iterdir() if d.is_dir() and d.name != "__pycache__"} \
        == set(ROOMS), "a room of server/ that server/__init__.py (and ROOMS here) does not name"


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_room_imports_only_the_rooms_below_it(room):
    wrong = []
    for f in _files(f"server/{room}"):
        for name in _imports(f):
            parts = name.split(".")
            if parts[1] == "server" and len(parts) > 2 and parts[2] != room \
                    and parts[2] not in ROOMS[room]:
                wrong.append(f"{f.relative_to(ROOT)} -> {name}")
    assert not wrong, f"imports that run up a floor or sideways: {wrong}"
    # what may be imported may not import back: the floors are a line, not a circle
    assert all(room not in ROOMS[below] for below in ROOMS[room])


def test_the_room_table_is_the_one_server_init_describes():
    text = (ROOT / "server" / "__init__.py").read_text()
    assert all(f"- {room}/" in text for room in ROOMS)
