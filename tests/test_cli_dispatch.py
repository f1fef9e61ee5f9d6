"""`weenv` imports a command's module only when that command runs (issue 13: `weenv run` and
`weenv version` must not pay for importing every command), while `weenv --help` still lists
every command. Structural checks only: which modules a fresh interpreter imported, never a
timing."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weenvfs import cli

COMMAND_MODULES = frozenset(cli.COMMAND_MODULES)
HEAVY = ("trio", "pyfuse3", "requests", "boto3", "zstandard", "weenvfs.core", "weenvfs.tools",
         "weenvfs.store", "weenvfs.provision.sidecar")


def _registered(module: str) -> set[str]:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    importlib.import_module(module).register(subparsers)
    return set(subparsers.choices)


def test_every_registered_command_is_in_the_table_with_its_module() -> None:
    table = {name: module for module in cli.COMMAND_MODULES for name in _registered(module)}
    assert table == {k: v for k, v in cli.COMMANDS.items() if v is not None}


def _imported(*argv: str) -> tuple[int, set[str]]:
    code = (
        "import sys\n"
        "from weenvfs import cli\n"
        f"code = cli.main({list(argv)!r})\n"
        f"print(code, *sorted(m for m in sys.modules if m in {sorted(COMMAND_MODULES)!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    words = done.stdout.splitlines()[-1].split()  # after any --help text
    return int(words[0]), set(words[1:])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("version",), set()),
        (("--version",), set()),
        # the runtime takes mount_args from fuse/config.py, never from the mount commands
        (("run", "--help"), {"weenvfs.runtime.commands"}),
        (("-v", "mount", "--help"), {"weenvfs.fuse.commands"}),
        (("sandbox", "ls", "--help"), {"weenvfs.runtime.commands"}),
        (("inspect", "--help"), {"weenvfs.tools.read_commands"}),
    ],
)
def test_a_command_imports_only_its_module(argv: tuple[str, ...], expected: set[str]) -> None:
    code, modules = _imported(*argv)
    assert code == 0
    assert modules == expected


def _heavy_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter has imported after running `code`."""
    code += ("\nimport json, sys\n"
             f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({HEAVY!r}))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    return list(json.loads(done.stdout))


def test_run_parses_without_the_heavy_libraries() -> None:
    assert _heavy_after(
        "from weenvfs import cli\n"
        "argv = ['run', '--store', '/s', 'env:t', 'true']\n"
        "cli.build_parser(cli._command_of(argv)).parse_args(argv)"
    ) == []


def test_what_run_executes_imports_no_store_or_codec() -> None:
    """`weenv run` from an S3 store has the node service resolve (runtime/node_resolve.py):
    the store, the format's codecs and the core are then never needed in its process."""
    assert _heavy_after(
        "import weenvfs.runtime.commands, weenvfs.runtime.environment, weenvfs.runtime.sandbox"
    ) == []


# The whole of what a handed-over `weenv run` may import of the project (entry.py): the
# node service carries the command out; this process only asks it and waits.
STAND_IN = {"weenvfs", "weenvfs.entry", "weenvfs.command_word", "weenvfs.fuse",
            "weenvfs.fuse.node_socket", "weenvfs.hand_over", "weenvfs.switches"}
# Modules the stand-in must not load: the CLI's parser, logging, JSON and typing.
NOT_IN_STAND_IN = ("argparse", "logging", "json", "typing", "weenvfs.cli")


def test_a_handed_over_run_imports_only_its_stand_in() -> None:
    """`weenv run` handed to the node service (entry.HAND_OVER, weenvfs/hand_over.py): its
    process imports the socket code only, none of the CLI or the runtime."""
    code = ("import importlib, sys\n"
            "before = set(sys.modules)\n"
            "from weenvfs import entry\n"
            "for name in entry.HAND_OVER.values():\n"
            "    importlib.import_module(name)\n"
            "print(' '.join(sorted(set(sys.modules) - before)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    loaded = set(done.stdout.split())
    assert {name for name in loaded if name.startswith("weenvfs")} == STAND_IN
    assert not [name for name in NOT_IN_STAND_IN if name in loaded]


def test_the_program_goes_to_the_cli_when_no_service_takes_the_run(tmp_path: Path) -> None:
    """With the node service switched off, `weenv run` is parsed and run by cli.main in the
    same process: a bad option is reported as by any command."""
    env = {**os.environ, "WEENV_NODE_RUN": "off"}
    done = subprocess.run([sys.executable, "-m", "weenvfs", "run", "--no-such-option", "e:1",
                           "true"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=60)
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-option" in done.stderr


def test_top_level_help_still_lists_every_command() -> None:
    done = subprocess.run([sys.executable, "-m", "weenvfs", "--help"], capture_output=True,
                          text=True, check=True, timeout=60)
    for name in cli.COMMANDS:
        assert f"\n    {name} " in done.stdout or f"\n    {name}\n" in done.stdout, name


def test_an_unknown_command_gets_the_complete_parser() -> None:
    done = subprocess.run([sys.executable, "-m", "weenvfs", "mout"], capture_output=True,
                          text=True, check=False, timeout=60)
    assert done.returncode == 2 and "invalid choice" in done.stderr and "mount" in done.stderr


def test_parsers_built_ahead_are_taken_once_each_and_parse_like_fresh_ones(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The node service builds the parsers of what its forked processes run before it forks
    (`cli.prebuild_parsers`); `main` takes the one of its command, once."""
    monkeypatch.setattr(cli, "_prebuilt_parsers", {})
    cli.prebuild_parsers()
    assert {cli.COMMANDS[c] for c in cli.SERVICE_COMMANDS} <= set(cli._prebuilt_parsers)
    assert cli.COMMANDS["sandbox"] in cli._prebuilt_parsers  # `run`'s module: one parser
    ahead = cli._prebuilt_parsers["weenvfs.runtime.mounts_commands"]
    monkeypatch.setenv("WEENV_ENVS_ROOT", str(tmp_path / "envs"))
    assert cli.main(["mounts", "ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert "weenvfs.runtime.mounts_commands" not in cli._prebuilt_parsers
    assert cli._parser_for("mounts") is not ahead
    fresh = cli.build_parser("mount")
    argv = ["mount", "env:v1", str(tmp_path / "mp"), "--store", "/srv/s", "--layer", "2"]
    ahead_args, fresh_args = (vars(p.parse_args(argv)) for p in (cli._parser_for("mount"),
                                                                   fresh))
    for args in (ahead_args, fresh_args):
        del args["command_parser"]
    assert ahead_args == fresh_args and ahead_args["layer"] == 2
