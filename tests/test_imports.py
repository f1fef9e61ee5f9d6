"""Import boundaries between the rooms of the code (STYLE.md 2.3, DESIGN.md package map).

Walks the AST of every module under format/, tools/ and weenvfs/ and checks each import
against the table below. The table is the contract: change it deliberately, in review.
Imports under `if TYPE_CHECKING:` count too (they still couple the rooms).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Folder on disk -> dotted package it installs as (mirrors pyproject's package-dir).
CODE_ROOTS = {"format": "weenvfs.format", "tools": "weenvfs.tools", "weenvfs": "weenvfs"}

# zstandard and blake3 are the format's own dependencies: rooms that may use the format may
# also call them directly (digests, streaming decompression) without adding weight.
CODEC = frozenset({"zstandard", "blake3"})


@dataclass(frozen=True)
class Rule:
    """What one room may import besides the stdlib and itself."""

    third_party: frozenset[str] = frozenset()
    rooms: frozenset[str] = frozenset()
    # room -> the only modules of that room allowed (e.g. fuse sees the store package only).
    only: tuple[tuple[str, frozenset[str]], ...] = ()


def _rule(third_party: set[str], rooms: set[str], **only: set[str]) -> Rule:
    return Rule(
        frozenset(third_party),
        frozenset(rooms),
        tuple((room, frozenset(mods)) for room, mods in only.items()),
    )


RULES: dict[str, Rule] = {
    "format": _rule({"zstandard", "blake3"}, set()),
    "store": _rule(
        {"boto3", "botocore", "requests", "urllib3"} | CODEC, {"format", "errors", "units"}
    ),
    "core": _rule({"trio"} | CODEC, {"format", "store", "errors", "units"}),
    "fuse": _rule(
        {"pyfuse3", "trio", "setproctitle"}, {"core", "store", "errors", "units"},
        store={"weenvfs.store"},
    ),
    "runtime": _rule({"trio"}, {"core", "fuse", "store", "provision", "errors", "units"}),
    "tools": _rule({"requests", "urllib3"} | CODEC, {"format", "store", "errors", "units"}),
    "provision": _rule({"trio"}, {"units"}),
    # containerd's remote snapshotter (DESIGN.md: on top of runtime and tools, like the CLI):
    # gRPC and protobuf for containerd's API; WeEnv layers mount through the runtime's shared
    # mounts; `weenv pull` reads images through the tools' registry client.
    "snapshotter": _rule({"grpc", "google"}, {"format", "store", "runtime", "fuse", "tools",
                                              "errors", "units"}),
    "errors": _rule(set(), set()),
    "units": _rule(set(), set()),  # byte sizes for humans: stdlib only, shared by every room
    # weenvfs/__init__.py, __main__.py, cli.py and other top-level modules: the top of the graph.
    "top": Rule(frozenset({"*"}), frozenset({"*"})),
}
NODE_ROOMS = {"store", "core", "fuse", "runtime", "provision", "snapshotter"}
# A room's `commands.py` (or `cli_*.py`) registers its subcommands through
# weenvfs.cli.add_command; only those modules of a room may import the CLI (lazily imported by
# cli, so no cycle).
COMMANDS_MODULE = "commands"
# What those modules may import of the top: add_command, and the shared argument types and
# output helpers (stdlib only, so no room gains a dependency through them).
CLI_MODULES = frozenset({"weenvfs.cli", "weenvfs.cli_args"})


def is_commands_module(module: str) -> bool:
    """Whether `module` is a room's command-registration module."""
    last = module.rsplit(".", 1)[-1]
    return last == COMMANDS_MODULE or last.startswith("cli_")


def module_name(path: Path) -> str:
    """Dotted name the file at `path` (relative to ROOT) is installed as."""
    parts = list(path.with_suffix("").parts)
    parts[0:1] = CODE_ROOTS[parts[0]].split(".")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str | None:
    """The room a `weenvfs...` module belongs to; None for modules outside the project."""
    parts = module.split(".")
    if parts[0] != "weenvfs":
        return None
    if len(parts) == 1:
        return "top"
    if parts[1] in ("format", "tools", "errors", "units") or parts[1] in NODE_ROOMS:
        return parts[1]
    return "top"


def _resolve_relative(current: str, is_package: bool, level: int, module: str | None) -> str:
    base = current.split(".") if is_package else current.split(".")[:-1]
    if level - 1 > len(base) - 1:
        raise ValueError(f"relative import beyond the top package in {current}")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_modules(source: str, current: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in `source`, relative ones resolved."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(current, is_package, node.level, node.module)
            else:
                base = node.module or ""
            if base == "weenvfs" or (node.level and node.module is None):
                # `from weenvfs import errors` / `from . import x` name submodules.
                found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, base))
    return found


def check_import(room: str, current: str, target: str) -> str | None:
    """Why `current` (in `room`) must not import `target`, or None if it may."""
    top = target.split(".")[0]
    if top == "__future__" or top in sys.stdlib_module_names:
        return None
    rule = RULES[room]
    target_room = room_of(target)
    if target_room is None:
        if "*" in rule.third_party or top in rule.third_party:
            return None
        return f"{room} may not import third-party {top!r}"
    if target_room == room or "*" in rule.rooms:
        return None
    if target in CLI_MODULES and is_commands_module(current):
        return None
    if target_room not in rule.rooms:
        return f"{room} may not import {target_room} ({target})"
    allowed = dict(rule.only).get(target_room)
    if allowed is not None and target not in allowed:
        return f"{room} may import only {sorted(allowed)} of {target_room}, not {target}"
    return None


def violations(room: str, current: str, is_package: bool, source: str) -> list[str]:
    """Every boundary violation in one module's source."""
    found = []
    for line, target in imported_modules(source, current, is_package):
        reason = check_import(room, current, target)
        if reason is not None:
            found.append(f"{current}:{line}: {reason}")
    return found


def file_room(relpath: Path) -> str:
    """The room of a code file (path relative to ROOT)."""
    first = relpath.parts[0]
    if first in ("format", "tools"):
        return first
    if len(relpath.parts) == 2:
        return "errors" if relpath.name == "errors.py" else "top"
    room = relpath.parts[1]
    if room not in NODE_ROOMS:
        raise AssertionError(f"{relpath}: unknown room weenvfs/{room}/; add it to RULES")
    return room


def code_files() -> list[Path]:
    """Every .py under the three code folders, relative to ROOT."""
    files = []
    for folder in CODE_ROOTS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files.append(path.relative_to(ROOT))
    return files


def test_code_files_are_found() -> None:
    names = {str(p) for p in code_files()}
    assert {"weenvfs/errors.py", "weenvfs/cli.py", "format/errors.py"} <= names


@pytest.mark.parametrize("relpath", code_files(), ids=str)
def test_module_respects_boundaries(relpath: Path) -> None:
    room = file_room(relpath)
    source = (ROOT / relpath).read_text(encoding="utf-8")
    found = violations(room, module_name(relpath), relpath.name == "__init__.py", source)
    assert not found, "import boundary violations:\n" + "\n".join(found)


# The checker itself, on small sources: it must catch what the table forbids.
@pytest.mark.parametrize(
    ("room", "module", "source", "expected"),
    [
        ("format", "weenvfs.format.index", "import struct, zstandard, blake3", []),
        ("format", "weenvfs.format.index", "import trio", ["third-party 'trio'"]),
        ("format", "weenvfs.format.index", "from weenvfs.store import open_store", ["store"]),
        ("format", "weenvfs.format.index", "from . import errors\nfrom .errors import X", []),
        ("format", "weenvfs.format.index", "from .. import errors", ["may not import errors"]),
        ("store", "weenvfs.store.s3", "import boto3\nfrom ..errors import StoreError", []),
        ("store", "weenvfs.store.s3", "from weenvfs import errors, format", []),
        ("store", "weenvfs.store.s3", "import trio", ["third-party 'trio'"]),
        ("store", "weenvfs.store.s3", "from weenvfs.core import tree", ["may not import core"]),
        ("core", "weenvfs.core.tree", "import pyfuse3", ["third-party 'pyfuse3'"]),
        ("fuse", "weenvfs.fuse.mount", "from weenvfs.store import open_store", []),
        ("fuse", "weenvfs.fuse.mount", "from weenvfs.store.s3 import S3Store", ["only"]),
        ("fuse", "weenvfs.fuse.mount", "import boto3", ["third-party 'boto3'"]),
        ("runtime", "weenvfs.runtime.env", "import boto3", ["third-party 'boto3'"]),
        ("tools", "weenvfs.tools.convert", "from weenvfs.fuse import ops", ["may not import fuse"]),
        ("tools", "weenvfs.tools.commands", "from weenvfs.cli import add_command", []),
        ("tools", "weenvfs.tools.convert", "from weenvfs.cli import add_command", ["cli"]),
        ("tools", "weenvfs.tools.cli_read", "from weenvfs.cli_args import print_json", []),
        ("provision", "weenvfs.provision.commands", "from weenvfs.cli_args import x", []),
        ("provision", "weenvfs.provision.policy", "from weenvfs.cli_args import x", ["top"]),
        ("provision", "weenvfs.provision.policy", "import trio, json", []),
        ("provision", "weenvfs.provision.policy", "from weenvfs.format import x", ["format"]),
        ("errors", "weenvfs.errors", "import requests", ["third-party 'requests'"]),
        ("top", "weenvfs.cli", "import pyfuse3\nfrom weenvfs.runtime import x", []),
    ],
)
def test_checker_catches_violations(
    room: str, module: str, source: str, expected: list[str]
) -> None:
    found = violations(room, module, False, source)
    assert len(found) == len(expected), found
    for message, fragment in zip(found, expected, strict=True):
        assert fragment in message


def test_test_module_basenames_are_unique() -> None:
    """pytest imports test modules by basename (prepend mode): two equal names collide."""
    names = [p.name for p in (ROOT / "tests").rglob("*.py") if p.name != "conftest.py"]
    names = [n for n in names if n != "__init__.py"]
    assert sorted(set(n for n in names if names.count(n) > 1)) == []
