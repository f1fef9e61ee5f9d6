#!/usr/bin/env python3
"""Check that this machine has every command the project runs, from a listed package.

Two checks, each failing with one line per problem and a non-zero exit:
1. every command named in scripts/debian-packages.txt is on PATH (the install worked);
2. every command that the code, tests or benchmarks run (a literal `which("X")` or an argv
   list starting with `"X",`) and that resolves to a file of a Debian package comes from a
   package in that list, or from one the base system always has (priority required or
   important). A command found only because someone installed its package by hand fails.
   A command that only benchmarks/ runs may instead come from a package in
   scripts/bench-packages.txt (what `scripts/setup.sh --test` and `--bench` add:
   scripts/bench-peers.sh); the tests run those commands only through benchmarks/ code (the
   eStargz peer's smoke test).
Standard library only: it runs before the venv exists.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIST = REPO / "scripts" / "debian-packages.txt"
BENCH_LIST = REPO / "scripts" / "bench-packages.txt"
SCANNED = ("weenvfs", "format", "tools", "tests", "benchmarks")
BENCH_ONLY = "benchmarks"
SBIN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Words that the scan finds in argv-shaped lists but that are not commands we run.
NOT_COMMANDS = {"write"}  # a pytest parametrize list in tests/store/test_local.py
_COMMAND = re.compile(rb"""(?:which\(\s*|\[\s*)"([a-z][a-z0-9.+_-]*)"\s*[,)]""")


def _search_path() -> str:
    """PATH as the tests see it, then the sbin folders a non-login root shell may lack."""
    return os.environ.get("PATH", "") + ":" + SBIN


def read_list(path: Path = LIST) -> dict[str, list[str]]:
    """package -> the commands it provides that we run."""
    packages: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            packages[words[0]] = [w for w in words[1:] if w != "-"]
    return packages


def commands_used(root: Path = REPO, folders: tuple[str, ...] = SCANNED) -> set[str]:
    """Command names the project's source in `folders` runs (see the module docstring)."""
    found: set[str] = set()
    for folder in folders:
        for path in (root / folder).rglob("*.py"):
            found.update(m.decode() for m in _COMMAND.findall(path.read_bytes()))
    return found


def _dpkg_owner(path: str) -> str | None:
    real = os.path.realpath(path)
    for candidate in dict.fromkeys((path, real, real.replace("/usr/", "/", 1))):
        done = subprocess.run(["dpkg-query", "-S", candidate], capture_output=True, text=True,
                              check=False)
        if done.returncode == 0 and ":" in done.stdout:
            return done.stdout.split(":", 1)[0].split(",")[0].strip()
    return None


def _priority(package: str) -> str:
    done = subprocess.run(["dpkg-query", "-W", "-f=${Priority}", package],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip()


def problems(root: Path | None = None) -> list[str]:
    """One line per missing command or unlisted package (in the source under `root`)."""
    root = root or REPO
    listed = read_list()
    bench = read_list(BENCH_LIST) if BENCH_LIST.exists() else {}
    used = commands_used(root)
    bench_only = used - commands_used(root, tuple(f for f in SCANNED if f != BENCH_ONLY))
    out = []
    for package, commands in listed.items():
        out += [f"missing command {c} (Debian package {package}): run scripts/setup.sh"
                for c in commands if shutil.which(c, path=_search_path())
                is None]
    provided = {c for commands in listed.values() for c in commands}
    for command in sorted(used - provided - NOT_COMMANDS):
        path = shutil.which(command, path=_search_path())
        if path is None:
            continue  # not a command at all (an argv list of words), or not run here
        owner = _dpkg_owner(path)
        if owner is None or owner in listed or _priority(owner) in ("required", "important"):
            continue
        if owner in bench and command in bench_only:
            continue
        out.append(f"command {command} comes from Debian package {owner}, which "
                   f"scripts/debian-packages.txt does not list"
                   + (" (scripts/bench-packages.txt serves benchmarks/ only)"
                      if owner in bench else ""))
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(f"check_requirements: {line}", file=sys.stderr)
    if not found:
        print("check_requirements: every command the project runs is installed and listed")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
