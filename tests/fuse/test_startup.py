"""What `weenv mount` imports before it starts its daemon, and the CLI's fast path.

Owns: the structural side of the mount start-up budget (DESIGN.md: mount to first `stat /`
under 300 ms, proven by benchmarks/mount.py): the parent of a background mount must not import
trio, pyfuse3, the store backends or the build side, and `cli.COMMANDS` must name the
module that really registers each command. No timing here (never a timing assertion in a test).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from weenvfs import cli

HEAVY = ("trio", "pyfuse3", "requests", "boto3", "zstandard", "weenvfs.core", "weenvfs.tools",
         "weenvfs.store")


def _registered(module: str) -> set[str]:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    __import__(module, fromlist=["register"]).register(subparsers)
    return set(subparsers.choices)


MOUNT_COMMANDS = {k: v for k, v in cli.COMMANDS.items() if v == "weenvfs.fuse.commands"}


@pytest.mark.parametrize(("command", "module"), sorted(MOUNT_COMMANDS.items()))
def test_fast_commands_name_their_module(command: str, module: str) -> None:
    assert module in cli.COMMAND_MODULES
    assert command in _registered(module)
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert command in sub.choices


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["mount", "a", "b"], "mount"),
        (["-vv", "--log-file", "mount", "umount", "x"], "umount"),
        (["--log-file=x.log", "--debug", "stats", "x"], "stats"),
        (["--help"], None),
        (["--", "mount"], None),
        ([], None),
    ],
)
def test_command_of_skips_global_options(argv: list[str], command: str | None) -> None:
    assert cli._command_of(argv) == command


def test_mount_parent_imports_nothing_heavy(tmp_path: Path) -> None:
    """Parse `weenv mount` and build its config as the parent does; list heavy modules."""
    code = (
        "import sys\n"
        "from weenvfs import cli\n"
        "from weenvfs.fuse import commands\n"
        f"argv = ['mount', 'env:t', {str(tmp_path)!r}, '--store', '/nowhere', '--cache', '/c']\n"
        "args = cli.build_parser(cli._command_of(argv)).parse_args(argv)\n"
        "commands._config(args)\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_command_still_parses_with_all_modules() -> None:
    # No command (or an unknown one) gets the complete parser.
    parser = cli.build_parser(None)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for module in cli.COMMAND_MODULES:
        assert _registered(module) <= set(sub.choices)
