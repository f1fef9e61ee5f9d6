"""Import boundaries between the rooms of the code (STYLE.md 2.3, DESIGN.md package map).

Walks the AST of every module under format/, tools/ and weenvfs/ and checks each import
against the table below. The table is the contract: change it deliberately, in review.

- Every file has a room: a folder's room, or for a file at the top of weenvfs/ its entry in
  `TOP_FILES` (a new top-level file fails until it is given one).
- `from package import name` counts as an import of `package.name` when that is a module,
  so `from weenvfs.store import s3` is an import of the S3 backend, not of the store package.
- Every import counts: inside functions and under `if TYPE_CHECKING:` too (they still couple
  the rooms).
- Command modules (a room's `commands.py` or `*_commands.py`, and every module the CLI's dispatch
  table `weenvfs.cli.COMMANDS` names) are the top of their room: only command modules of the
  same package may import one (the Python API never depends on the CLI). They alone may import
  the CLI modules (`add_command`, the shared argument helpers) and `weenvfs.errors` (what
  `main()` turns into one-line messages), and only names those modules define themselves:
  a name the CLI imported from elsewhere is taken from its own module.
- No import cycles, counting imports inside functions: a lazy import may keep start-up fast
  (the module it names is loaded on first use), never hold a cycle together. The one import
  by name is the CLI's dispatch table (`importlib` over `weenvfs.cli.COMMANDS`): `weenv
  COMMAND` loads only COMMAND's module, which registers itself through `add_command`. That
  edge is not an import statement, so it is neither seen here nor a cycle at import time.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from weenvfs.cli import COMMANDS

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


NODE_ROOMS = {"store", "core", "fuse", "runtime", "provision", "snapshotter"}
RULES: dict[str, Rule] = {
    "format": _rule({"zstandard", "blake3"}, set()),
    "store": _rule(
        {"boto3", "botocore", "requests", "urllib3"} | CODEC, {"format", "errors", "units"}
    ),
    "core": _rule({"trio"} | CODEC, {"format", "store", "errors", "units"}),
    # prometheus_client: the node's metrics (fuse/metrics.py, fuse/exporter.py), which the
    # node service and, above the runtime, the containerd snapshotter serve.
    "fuse": _rule(
        {"pyfuse3", "trio", "setproctitle", "prometheus_client"},
        {"core", "store", "errors", "units", "native", "cgroups", "switches"},
        store={"weenvfs.store"},
    ),
    "runtime": _rule({"trio"}, {"core", "fuse", "store", "provision", "errors", "units",
                                "native", "cgroups", "switches"}),
    # The build side; it publishes each group's EROFS image over the groups below it exactly
    # as a node derives it (SPEC.md 15.9), so it uses the node's derivation, and nothing else
    # of the core (docs/design-notes.md).
    "tools": _rule({"requests", "urllib3"} | CODEC,
                   {"format", "store", "core", "errors", "units", "switches"},
                   core={"weenvfs.core.kernel_image"}),
    "provision": _rule({"trio"}, {"units"}),
    # containerd's remote snapshotter (DESIGN.md: on top of runtime and tools, like the CLI):
    # gRPC and protobuf for containerd's API; WeEnv layers mount through the runtime's shared
    # mounts; `weenv pull` reads images through the tools' registry client; its Prometheus
    # metrics (its own calls and snapshots, and the node's through fuse/metrics.py).
    "snapshotter": _rule({"grpc", "google", "prometheus_client"},
                         {"format", "store", "runtime", "fuse", "tools", "errors", "units"}),
    "errors": _rule(set(), set()),
    "units": _rule(set(), set()),  # byte sizes for humans: stdlib only, shared by every room
    "native": _rule(set(), set()),  # where the native programs are: stdlib only, for any room
    "cgroups": _rule(set(), set()),  # where this process's cgroups are: stdlib only
    # The node's on/off environment variables: stdlib only (the stand-in reads them), and the
    # usage error it raises for a bad value.
    "switches": _rule(set(), {"errors"}),
    # weenvfs/__init__.py: the version only; importing it must not pull in anything.
    "package": _rule(set(), set()),
    # The `weenv` entry point and its shared argument helpers: they load command modules by
    # name only (COMMANDS), so that `weenv COMMAND` imports nothing it does not run.
    "cli": _rule(set(), {"package", "errors", "format"}, format={"weenvfs.format.errors"}),
    # Command modules at the top of the package (`weenv hints`, `weenv dev`, `weenv demo`): on
    # top of the node side and the build side, like the CLI; no library of their own.
    "top": _rule(set(), {"format", "store", "core", "fuse", "runtime", "tools", "provision",
                         "errors", "units", "native"}),
    # The stand-in of a command the node service carries out (hand_over.py): the service's
    # socket client, and its own module only when no service answers (to start one).
    "stand-in": _rule(set(), {"fuse", "switches"},
                      fuse={"weenvfs.fuse.node_socket", "weenvfs.fuse.mountd"}),
}
# The room of each file at the top of weenvfs/ (a new file there needs an entry).
TOP_FILES = {
    "__init__.py": "package",
    "__main__.py": "cli",
    "cli.py": "cli",
    "cli_args.py": "cli",
    "entry.py": "cli",
    "command_word.py": "cli",
    "hand_over.py": "stand-in",
    "errors.py": "errors",
    "units.py": "units",
    "native_programs.py": "native",
    "cgroup_places.py": "cgroups",
    "switches.py": "switches",
    "hint_commands.py": "top",
    "dev_commands.py": "top",
    "demo.py": "top",
}
# A room's `commands.py` (or `*_commands.py`) registers its subcommands through
# weenvfs.cli.add_command (lazily imported by cli, by name, so no cycle).
COMMANDS_MODULE = "commands"
# What command modules may import besides their room's rules: add_command, the shared argument
# types and output helpers (stdlib only, so no room gains a dependency through them), and the
# errors main() reports on one line.
CLI_MODULES = frozenset({"weenvfs.cli", "weenvfs.cli_args"})
COMMAND_EXTRAS = CLI_MODULES | {"weenvfs.errors"}


def is_commands_module(module: str) -> bool:
    """Whether `module` is a command-registration module (by its name or the CLI's table)."""
    if module in CLI_MODULES:
        return False
    last = module.rsplit(".", 1)[-1]
    return last == COMMANDS_MODULE or last.endswith("_commands") or module in COMMANDS.values()


def package_of(module: str) -> str:
    """The package a module belongs to (a package's __init__ belongs to itself's parent)."""
    return module.rsplit(".", 1)[0] if "." in module else module


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
        return TOP_FILES["__init__.py"]
    if parts[1] in ("format", "tools") or parts[1] in NODE_ROOMS:
        return parts[1]
    if len(parts) == 2 and f"{parts[1]}.py" in TOP_FILES:
        return TOP_FILES[f"{parts[1]}.py"]
    return f"unknown ({module})"


def code_files() -> list[Path]:
    """Every .py under the three code folders, relative to ROOT."""
    files = []
    for folder in CODE_ROOTS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files.append(path.relative_to(ROOT))
    return files


MODULES = frozenset(module_name(p) for p in code_files())


def file_room(relpath: Path) -> str:
    """The room of a code file (path relative to ROOT)."""
    first = relpath.parts[0]
    if first in ("format", "tools"):
        return first
    if len(relpath.parts) == 2:
        if relpath.name not in TOP_FILES:
            raise AssertionError(f"{relpath}: no room; give it one in TOP_FILES")
        return TOP_FILES[relpath.name]
    room = relpath.parts[1]
    if room not in NODE_ROOMS:
        raise AssertionError(f"{relpath}: unknown room weenvfs/{room}/; add it to RULES")
    return room


@dataclass(frozen=True)
class Import:
    """One imported module: where, and the names taken from it (`from X import a, b`)."""

    line: int
    target: str
    names: tuple[str, ...] = ()
    in_function: bool = False


def _resolve_relative(current: str, is_package: bool, level: int, module: str | None) -> str:
    base = current.split(".") if is_package else current.split(".")[:-1]
    if level - 1 > len(base) - 1:
        raise ValueError(f"relative import beyond the top package in {current}")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of `tree`, and whether it sits inside a function."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def imported_modules(
    source: str, current: str, is_package: bool, known: frozenset[str] = MODULES
) -> list[Import]:
    """Every module `source` imports, relative names resolved; `from P import m` is an import
    of module `P.m` when `known` has it (a submodule), else of `P` with the names taken."""
    found: list[Import] = []
    for node, lazy in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, alias.name, (), lazy) for alias in node.names)
            continue
        if node.level:
            base = _resolve_relative(current, is_package, node.level, node.module)
        else:
            base = node.module or ""
        names = []
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                found.append(Import(node.lineno, f"{base}.{alias.name}", (), lazy))
            else:
                names.append(alias.name)
        if names:
            found.append(Import(node.lineno, base, tuple(names), lazy))
    return sorted(found, key=lambda imp: imp.line)


def _reexported(module: str) -> frozenset[str]:
    """Names that `module` (a project module) binds by importing them at module level."""
    path = ROOT / "weenvfs" / (module.split(".", 1)[1].replace(".", "/") + ".py")
    names = set()
    for node, lazy in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if not lazy:
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names - {"annotations"})


REEXPORTED = {module: _reexported(module) for module in CLI_MODULES}


def check_import(room: str, current: str, imp: Import) -> str | None:
    """Why `current` (in `room`) must not make import `imp`, or None if it may."""
    target = imp.target
    top = target.split(".")[0]
    if top == "__future__" or top in sys.stdlib_module_names:
        return None
    rule = RULES[room]
    target_room = room_of(target)
    if target_room is None:
        if top in rule.third_party:
            return None
        return f"{room} may not import third-party {top!r}"
    commands = is_commands_module(current)
    foreign = not commands or package_of(current) != package_of(target)
    if is_commands_module(target) and target != current and foreign:
        return (f"only command modules of {package_of(target)} may import the command "
                f"module {target}")
    if target in REEXPORTED:
        through = sorted(set(imp.names) & REEXPORTED[target])
        if through:
            return f"take {', '.join(through)} from its own module, not through {target}"
    if target_room == room or (commands and target in COMMAND_EXTRAS):
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
    for imp in imported_modules(source, current, is_package):
        reason = check_import(room, current, imp)
        if reason is not None:
            found.append(f"{current}:{imp.line}: {reason}")
    return found


def test_code_files_are_found() -> None:
    names = {str(p) for p in code_files()}
    assert {"weenvfs/errors.py", "weenvfs/cli.py", "format/errors.py"} <= names


def test_every_top_level_file_has_a_room() -> None:
    on_disk = {p.name for p in (ROOT / "weenvfs").glob("*.py")}
    assert on_disk == set(TOP_FILES), "give every file at the top of weenvfs/ a room"
    assert set(TOP_FILES.values()) <= set(RULES)


@pytest.mark.parametrize("relpath", code_files(), ids=str)
def test_module_respects_boundaries(relpath: Path) -> None:
    room = file_room(relpath)
    source = (ROOT / relpath).read_text(encoding="utf-8")
    found = violations(room, module_name(relpath), relpath.name == "__init__.py", source)
    assert not found, "import boundary violations:\n" + "\n".join(found)


# -- cycles -----------------------------------------------------------------------------------

Graph = dict[str, dict[str, Import]]


def import_graph() -> Graph:
    """module -> {project module it imports: the first such import}, lazy imports included."""
    graph: Graph = {}
    for relpath in code_files():
        current = module_name(relpath)
        source = (ROOT / relpath).read_text(encoding="utf-8")
        edges: dict[str, Import] = {}
        for imp in imported_modules(source, current, relpath.name == "__init__.py"):
            if imp.target in MODULES and imp.target != current:
                edges.setdefault(imp.target, imp)
        graph[current] = edges
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def describe_cycle(graph: Graph, group: list[str]) -> str:
    """One cycle through the first module of `group`, each step with its line."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for succ in sorted(graph[node]):
            if succ == start:
                path = [*paths[node], start]
                steps = []
                for a, b in zip(path, path[1:], strict=False):
                    imp = graph[a][b]
                    where = " (in a function)" if imp.in_function else ""
                    steps.append(f"{a}:{imp.line}{where} -> {b}")
                return "; ".join(steps)
            if succ in members and succ not in paths:
                paths[succ] = [*paths[node], succ]
                queue.append(succ)
    raise AssertionError(f"no cycle through {start}")


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = [f"{', '.join(group)}: {describe_cycle(graph, group)}"
              for group in strongly_connected(graph)]
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(cycles)


def test_cycle_check_catches_a_cycle_held_by_a_lazy_import() -> None:
    sources = {
        "weenvfs.tools.image_source": "def f():\n    from .registry import RegistrySource\n",
        "weenvfs.tools.registry": "from .image_source import ImageSource\n",
        "weenvfs.tools.layers": "from .image_source import Layer\n",
    }
    graph = {
        module: {imp.target: imp for imp in imported_modules(source, module, False)}
        for module, source in sources.items()
    }
    groups = strongly_connected(graph)
    assert groups == [["weenvfs.tools.image_source", "weenvfs.tools.registry"]]
    assert describe_cycle(graph, groups[0]) == (
        "weenvfs.tools.image_source:2 (in a function) -> weenvfs.tools.registry; "
        "weenvfs.tools.registry:1 -> weenvfs.tools.image_source"
    )


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
        # A submodule named in `from P import m` is an import of P.m, in a function too.
        ("fuse", "weenvfs.fuse.mountd", "def f():\n    from weenvfs.store import s3", ["only"]),
        ("fuse", "weenvfs.fuse.mount", "from weenvfs import store", []),
        ("fuse", "weenvfs.fuse.mount", "import boto3", ["third-party 'boto3'"]),
        ("fuse", "weenvfs.fuse.metrics", "from prometheus_client import core", []),
        ("core", "weenvfs.core.stats", "import prometheus_client", ["'prometheus_client'"]),
        ("runtime", "weenvfs.runtime.env", "import boto3", ["third-party 'boto3'"]),
        # The Python API must not depend on the CLI: no command module of another package.
        ("runtime", "weenvfs.runtime.mounts", "from weenvfs.fuse.commands import mount_args",
         ["command module weenvfs.fuse.commands"]),
        ("runtime", "weenvfs.runtime.mounts", "from weenvfs.fuse.config import mount_args", []),
        ("runtime", "weenvfs.runtime.environment", "from .commands import x", ["command"]),
        ("runtime", "weenvfs.runtime.commands", "from .mounts_commands import x", []),
        ("top", "weenvfs.hint_commands", "from weenvfs.fuse.commands import mount_args",
         ["command"]),
        ("top", "weenvfs.hint_commands", "from weenvfs.fuse import daemon\nimport boto3",
         ["boto3"]),
        ("tools", "weenvfs.tools.convert", "from weenvfs.fuse import ops", ["may not import fuse"]),
        ("tools", "weenvfs.tools.commands", "from weenvfs.cli import add_command", []),
        ("tools", "weenvfs.tools.convert", "from weenvfs.cli import add_command", ["cli"]),
        ("tools", "weenvfs.tools.read_commands", "from weenvfs.cli_args import print_json", []),
        ("tools", "weenvfs.tools.read_commands", "from weenvfs.tools.build_commands import x", []),
        ("provision", "weenvfs.provision.commands", "from weenvfs.cli_args import x", []),
        ("provision", "weenvfs.provision.commands", "from weenvfs.errors import UsageError", []),
        # The CLI is no back door: what it imported is taken from its own module.
        ("provision", "weenvfs.provision.commands", "from weenvfs.cli import UsageError",
         ["take UsageError from its own module"]),
        ("provision", "weenvfs.provision.policy", "from weenvfs.cli_args import x", ["cli"]),
        ("provision", "weenvfs.provision.policy", "from weenvfs.errors import X", ["errors"]),
        ("provision", "weenvfs.provision.policy", "import trio, json", []),
        ("provision", "weenvfs.provision.policy", "from weenvfs.format import x", ["format"]),
        ("errors", "weenvfs.errors", "import requests", ["third-party 'requests'"]),
        # Top-level files have rooms of their own.
        ("units", "weenvfs.units", "from weenvfs.store import open_store", ["store"]),
        ("package", "weenvfs", "from weenvfs import errors", ["errors"]),
        ("cli", "weenvfs.cli", "from weenvfs import __version__\nimport importlib", []),
        ("cli", "weenvfs.cli", "from weenvfs.format.errors import FormatError", []),
        ("cli", "weenvfs.cli", "import pyfuse3\nfrom weenvfs.runtime import x",
         ["third-party 'pyfuse3'", "may not import runtime"]),
        ("cli", "weenvfs.cli", "from weenvfs.fuse.commands import register", ["command"]),
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
