"""Argument types and output helpers shared by every command module of `weenv`.

Owns:
- the `[OPTIONS] REF [COMMAND [ARG...]]` shape of `weenv run`, `weenv hints record` and
  `weenv sandbox exec` (as `docker run [OPTIONS] IMAGE [COMMAND] [ARG...]`): options go
  before REF, everything after REF is the command; `--` before the command is accepted, and
  so is the older `REF [OPTIONS] -- COMMAND` form (options after REF only with a `--`);
- `--store` (one option, one check that it was given, with a hint when it was given after
  REF, where it belongs to the command);
- argparse `type=` functions (`positive`, `non_negative`, `port`, `env_pair`; sizes are
  `weenvfs.units.size_arg`), `page_root` (`--pages-through [N=]DIR` of `weenv mount` and
  `weenv cache warm`) and `print_json`, the one way commands print JSON.

Must not: import anything beyond the stdlib and `weenvfs.errors` (it is imported by `weenv
run` and `weenv mount` before they start: DESIGN.md's start-up budget), or know any command.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError

COMMAND_METAVAR = "COMMAND"


def positive(text: str) -> float:
    """A number > 0 (seconds, cores)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def non_negative(text: str) -> float:
    """A number >= 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port number, 1 to 65535."""
    value = int(text) if text.isdigit() else 0
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {text!r}")
    return value


def env_pair(text: str) -> tuple[str, str | None]:
    """`KEY=VALUE` (an environment variable), or `KEY` alone: its value in this process's
    environment, as `docker run -e KEY` (None where it is not set: `env_dict` leaves it out)."""
    key, sep, value = text.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE or KEY, got {text!r}")
    return key, value if sep else os.environ.get(key)


def env_dict(pairs: list[tuple[str, str | None]]) -> dict[str, str]:
    """The variables of `-e` options (`env_pair`), the last of a name winning; a `KEY` that
    was not set is left out."""
    out: dict[str, str] = {}
    for key, value in pairs:
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def page_root(value: str) -> tuple[int | None, Path]:
    """`[N=]DIR` of --pages-through: (group position, or None for every group, and an
    absolute folder); UsageError otherwise (a one-line error, not argparse's usage)."""
    group, sep, folder = value.partition("=")
    if not sep:
        group, folder = "", value
    if group and not group.isdigit() or not folder or not Path(folder).is_absolute():
        raise UsageError(f"--pages-through: {value!r}: expected [N=]DIR with DIR absolute")
    return (int(group) if group else None), Path(folder)


def add_store(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """`--store URL`. With `required`, argparse enforces it; commands of the REF + COMMAND
    shape check it in `split_command` instead (the older form gives it after REF)."""
    p.add_argument("--store", required=required, metavar="URL",
                   help="store URL (file:///path, s3://bucket/prefix, http://...) or directory")


def print_json(document: Any) -> None:
    """Print `document` as indented JSON with sorted keys (every command's `--json`); ASCII
    escapes only, so names that are not UTF-8 travel as surrogate escapes (\\udcXX)."""
    print(json.dumps(document, indent=2, sort_keys=True))


# -- [OPTIONS] REF [COMMAND [ARG...]] ---------------------------------------------------------


def add_ref_and_command(p: argparse.ArgumentParser, name: str, metavar: str, help: str) -> None:
    """Positional `name` (REF or ID) followed by the command: everything after it."""
    p.add_argument(name, metavar=metavar, help=help)
    command = p.add_argument("command", nargs=argparse.REMAINDER,
                             metavar=f"{COMMAND_METAVAR} [ARG...]",
                             help="the command and its arguments: every word after " + metavar)
    command.required = False  # argparse counts it as required when REF is missing too


def split_command(args: argparse.Namespace, name: str, *, store: bool = False) -> list[str]:
    """The command of `args` (parsed by a parser built with `add_ref_and_command`).

    Options between `name` and a `--` (the older form), or options alone after `name`, are
    parsed into `args`; options followed by a command without `--` are refused (the first
    option would be taken as a program name, and the user meant otherwise).
    With `store`, `--store` must have been given.
    """
    command = list(args.command)
    given = getattr(args, name)  # (a failed parse of the options below may overwrite it)
    if command[:1] == ["--"]:
        command = command[1:]
    elif command and command[0].startswith("-"):
        # The older form: options after REF, then `--` and the command (or no command).
        cut = command.index("--") if "--" in command else len(command)
        try:
            _parse_options(args, command[:cut], given)
        except UsageError:
            if cut < len(command):
                raise
            raise UsageError(
                f"{command[0]} after {given}: options go before "
                f"{name.upper()}, everything after it is the command "
                f"(usage: {args.command_parser.prog} [OPTIONS] {name.upper()} [COMMAND...])"
            ) from None
        command = command[cut + 1 :]
    if store and not args.store:
        where = " (before REF: everything after REF is the command)" if "--store" in command else ""
        raise UsageError(f"--store is required{where}")
    return command


def _parse_options(args: argparse.Namespace, options: list[str], positional: str) -> None:
    """Parse `options` given after the positional into `args`; argparse's complaint, or a
    word that is no option's value, becomes one UsageError (printed once by main())."""
    parser: argparse.ArgumentParser = args.command_parser
    saved = {key: getattr(args, key) for key in ("command", "command_parser")}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args([*options, "--", positional], namespace=args)
        if args.command:  # a word of `options` was taken as the positional
            raise UsageError(f"unexpected words: {' '.join(options)}")
    except SystemExit:
        lines = err.getvalue().strip().splitlines() or ["bad options"]
        message = lines[-1].split(": error: ", 1)[-1]
        raise UsageError(f"{message} (in: {' '.join(options)})") from None
    finally:
        for key, value in saved.items():
            setattr(args, key, value)
