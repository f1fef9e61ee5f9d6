"""The `weenv` command: one entry point, subcommands registered by command modules.

This module owns argument parsing, logging set-up and the translation of errors into one-line
messages and exit codes. It must not implement any command itself (apart from `version`):
each command module listed in `COMMAND_MODULES` exposes `register(subparsers) -> None`, which
adds its subcommands with `add_command()` and so sets `func=handler`, where
`handler(args) -> int` returns the exit code. Handlers raise `WeenvError` or `FormatError`
for user-facing failures; `main()` prints them on one line, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence

from weenvfs import __version__
from weenvfs.command_word import EXIT_INTERRUPTED, command_at
from weenvfs.errors import Terminated, UsageError, WeenvError
from weenvfs.format.errors import FormatError

log = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace], int]

# Every subcommand and the module that registers it, in the order of --help (None: built
# in). `weenv COMMAND` imports only COMMAND's module, so that `weenv version` and `weenv run`
# do not pay for the imports of `build` or `convert` (requests, the builder), and `weenv
# mount`'s daemon, which starts the interpreter again, neither (DESIGN.md budgets; issue 13
# asks under 100 ms to parse and dispatch). `weenv --help` and an unknown command import every
# module. A test checks this table against what each module registers; a failing import is a
# bug, never skipped.
COMMANDS: dict[str, str | None] = {
    "version": None,
    "build": "weenvfs.tools.build_commands",
    "compose": "weenvfs.tools.build_commands",
    "convert": "weenvfs.tools.convert_commands",
    "push": "weenvfs.tools.push_commands",
    "ls": "weenvfs.tools.read_commands",
    "inspect": "weenvfs.tools.read_commands",
    "verify": "weenvfs.tools.read_commands",
    "export": "weenvfs.tools.read_commands",
    "gc": "weenvfs.tools.read_commands",
    "mount": "weenvfs.fuse.commands",
    "umount": "weenvfs.fuse.commands",
    "stats": "weenvfs.fuse.commands",
    "mountd": "weenvfs.fuse.commands",
    "cache": "weenvfs.core.commands",
    "hints": "weenvfs.hint_commands",
    "dev": "weenvfs.dev_commands",
    "run": "weenvfs.runtime.commands",
    "sandbox": "weenvfs.runtime.commands",
    "mounts": "weenvfs.runtime.mounts_commands",
    "provision": "weenvfs.provision.commands",
    "snapshotter": "weenvfs.snapshotter.commands",
    "pull": "weenvfs.snapshotter.commands",
    "demo": "weenvfs.demo",
}
# The modules that register subcommands, in the order they appear in --help.
COMMAND_MODULES: tuple[str, ...] = tuple(dict.fromkeys(m for m in COMMANDS.values() if m))

EXIT_INTERNAL = 70  # EX_SOFTWARE from sysexits.h
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE

_FORMATTER = argparse.RawDescriptionHelpFormatter


def _examples_epilog(examples: Sequence[str]) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in examples)


def _common_options(*, top_level: bool) -> argparse.ArgumentParser:
    """Options accepted before and after the subcommand name.

    Subcommand copies default to SUPPRESS so that they do not overwrite a value given before
    the subcommand (argparse copies every attribute of the sub-namespace onto the main one).
    """
    parent = argparse.ArgumentParser(add_help=False)
    default: dict[str, object] = {} if top_level else {"default": argparse.SUPPRESS}
    group = parent.add_argument_group("global options")
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        help="log more: -v info, -vv debug for weenv, -vvv debug for everything",
        **({"default": 0} if top_level else default),
    )
    group.add_argument(
        "--log-file",
        metavar="PATH",
        help="also write the log to PATH (at least at info level)",
        **({"default": None} if top_level else default),
    )
    group.add_argument(
        "--debug",
        action="store_true",
        help="print tracebacks of errors",
        **({"default": False} if top_level else default),
    )
    return parent


def add_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
    examples: Sequence[str],
    func: Handler | None,
) -> argparse.ArgumentParser:
    """Add subcommand `name` with a help text that always ends with examples.

    `examples` are complete command lines (a trailing `# comment` is fine). `func` is the
    handler; pass None only for a command group whose own subcommands set handlers.
    Returns the new parser, to which the caller adds its arguments.
    """
    if not examples:
        raise ValueError(f"command {name!r} needs at least one example")
    parser = subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog=_examples_epilog(examples),
        formatter_class=_FORMATTER,
        parents=[_common_options(top_level=False)],
    )
    parser.set_defaults(func=func, command_parser=parser)
    # Read back by build_parser() to show one example per command in the top-level help.
    parser.weenv_examples = tuple(examples)  # type: ignore[attr-defined]
    return parser


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"weenv {__version__}")
    return 0


def _register_builtin(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(
        subparsers,
        "version",
        help="print the version",
        description="Print the version of weenv.",
        examples=["weenv version"],
        func=_cmd_version,
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Build the complete `weenv` parser from the built-in and registered commands; with
    `command` one of COMMANDS, register only the module that provides it (none for a
    built-in command)."""
    parser = argparse.ArgumentParser(
        prog="weenv",
        description=(
            "WeEnv packages environments as content-addressed layer groups, mounts them\n"
            "lazily over FUSE and sizes the sandboxes that run them."
        ),
        formatter_class=_FORMATTER,
        parents=[_common_options(top_level=True)],
    )
    parser.add_argument("--version", action="version", version=f"weenv {__version__}")
    parser.set_defaults(func=None, command_parser=parser)
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _register_builtin(subparsers)
    known = command in COMMANDS
    module = COMMANDS.get(command or "")
    for name in (() if module is None else (module,)) if known else COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    examples = ["weenv --help", "weenv COMMAND --help"]
    for sub in subparsers.choices.values():
        examples.extend(getattr(sub, "weenv_examples", ())[:1])
    parser.epilog = _examples_epilog(examples)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in `argv` (the first word that is not a global option); `version`
    for `--version`, which needs no command module either."""
    at = command_at(list(argv))
    return None if at is None else "version" if argv[at] == "--version" else argv[at]


# What the node service (`weenv mountd`) runs in processes it forks, besides mount daemons:
# a handed-over `weenv run` (the sandbox's modules: `_cmd_run` imports them where it needs
# them, and nothing else would load them here; ~37 ms of each warm run's fork while they were
# not listed), `weenv sandbox resolve` (runtime/node_resolve.py) and a mount's hint replay,
# `weenv cache warm` (fuse/replay_process.py). The service imports these before it forks, so
# that none pays for their imports; tests/runtime/test_node_run.py holds a run to that.
SERVICE_MODULES = ("weenvfs.runtime.commands", "weenvfs.runtime.environment",
                   "weenvfs.runtime.sandbox", "weenvfs.runtime.tag_guess",
                   "weenvfs.core.commands", "weenvfs.core.warm")
# And `weenv pull` (hand_over.py), on a node that has containerd's `ctr` (which the pull
# runs): grpc, the snapshots API and the registry client, about 90 ms of each pull's start
# and 17 MB of the service's memory, which a node without containerd does not pay; and
# grpc's channel module, which grpc imports only when the first channel is made (~8 ms of
# each pull's child otherwise; importing it starts no thread, so the fork stays safe).
PULL_MODULES = ("weenvfs.snapshotter.commands", "weenvfs.snapshotter.pull",
                "weenvfs.tools.registry_auth", "grpc._channel")


# A command of each module whose commands the node service's forked processes run (mount
# daemons, housekeeping, and what SERVICE_MODULES and PULL_MODULES name): the parser of its
# module is built before the service forks.
SERVICE_COMMANDS = ("mount", "run", "cache", "mounts")
PULL_COMMANDS = ("pull",)
# Parsers built ahead by the node service (`prebuild_parsers`), by command module: argparse
# and gettext spend ~25 ms of CPU building a module's parser, which every mount daemon,
# resolution, hint replay and handed-over `weenv run` it forks would otherwise pay again.
# Each is used once (a parser built for one run of `main` is not shared with a later one).
_prebuilt_parsers: dict[str, argparse.ArgumentParser] = {}


def prebuild_parsers() -> None:
    """Build the parsers of SERVICE_COMMANDS' modules (and PULL_COMMANDS' where `ctr` is)
    now, for the processes this one forks later (`main` takes them)."""
    import shutil

    for command in SERVICE_COMMANDS + (PULL_COMMANDS if shutil.which("ctr") else ()):
        _prebuilt_parsers[str(COMMANDS[command])] = build_parser(command)


def _parser_for(command: str | None) -> argparse.ArgumentParser:
    """The parser of `command`'s module built ahead, else a new one."""
    module = COMMANDS.get(command or "")
    made = _prebuilt_parsers.pop(module, None) if module else None
    return made or build_parser(command)


def service_modules() -> tuple[str, ...]:
    """What the node service imports for the commands it forks (see SERVICE_MODULES)."""
    return SERVICE_MODULES + pull_modules()


def pull_modules() -> tuple[str, ...]:
    """PULL_MODULES where `ctr` is installed, else none."""
    import shutil

    return PULL_MODULES if shutil.which("ctr") else ()


class _LogSetup:
    """Handlers and levels installed by main(), undone on exit.

    main() runs in-process in tests, so it must leave the logging tree as it found it.
    """

    def __init__(self) -> None:
        self.handlers: list[logging.Handler] = []
        self.levels = {name: logging.getLogger(name).level for name in ("", "weenvfs")}

    def undo(self) -> None:
        for handler in self.handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)


def _open_log_file(path: str) -> logging.Handler:
    try:
        return logging.FileHandler(path)
    except OSError as error:
        raise UsageError(f"cannot open log file {path}: {error.strerror}") from None


class _ConsoleFormatter(logging.Formatter):
    """Without -v only warnings and errors reach the console: said as the command's own lines
    (`weenv: warning: ...`), as its errors are; with -v, levels and loggers as a log has them."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return f"weenv: {record.levelname.lower()}: {message}"


def _setup_logging(setup: _LogSetup, verbose: int, log_file: str | None) -> None:
    """Attach a stderr handler (and a file handler) to the root logger, recorded in `setup`."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    root = logging.getLogger()
    file_handler = None if log_file is None else _open_log_file(log_file)
    # The log file gets at least info; third-party libraries (boto3, urllib3) are very chatty
    # at debug, so only -vvv lets their debug records through.
    wanted = level if file_handler is None else min(level, logging.INFO)
    root.setLevel(logging.DEBUG if verbose >= 3 else max(wanted, logging.INFO))
    logging.getLogger("weenvfs").setLevel(wanted)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    console.setFormatter(_ConsoleFormatter() if verbose == 0
                         else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    setup.handlers.append(console)
    if file_handler is not None:
        file_handler.setLevel(min(level, logging.INFO))
        file_handler.setFormatter(
            logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        )
        setup.handlers.append(file_handler)
    for handler in setup.handlers:
        root.addHandler(handler)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _silence_stdout() -> None:
    # After EPIPE, Python would fail again flushing stdout at exit; point it at /dev/null.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class _ParseExit(Exception):
    """argparse finished early (help, version, usage error) with this exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version and usage errors
        code = stop.code
        raise _ParseExit(code if isinstance(code, int) else (0 if code is None else 2)) from None


def _dispatch(args: argparse.Namespace) -> int:
    if args.func is None:
        args.command_parser.print_help(sys.stderr)
        print(f"{args.command_parser.prog}: error: a command is required", file=sys.stderr)
        return 2
    with terminated_on_signals():
        return int(args.func(args))


@contextlib.contextmanager
def terminated_on_signals(even_ignored: bool = False) -> Iterator[None]:
    """SIGTERM and SIGHUP (unless ignored, as under nohup, or `even_ignored`) raise
    `Terminated`, a KeyboardInterrupt: every command cleans up on them as on Ctrl-C (its
    staging folders, a recording's mount and child, a half-made export) and exits 128 + the
    signal. Services (mountd, the snapshotter, a mount's daemon) set handlers of their own
    inside this."""

    def handler(signum: int, frame: object) -> None:
        raise Terminated(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)
           if even_ignored or signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _internal(error: Exception) -> str:
    return (f"internal error: {type(error).__name__}: {_one_line(error)}"
            " (run with --debug for the traceback)")


def _failed(what: str, code: int, as_json: bool) -> int:
    """Say `weenv: WHAT` on stderr and, for a command run with --json, also as one JSON line
    on stdout (`{"error": WHAT, "exit_code": CODE}`: a script reading the output finds the
    failure where it looks); return `code`."""
    print(f"weenv: {what}", file=sys.stderr)
    if as_json:
        with contextlib.suppress(OSError):
            print(json.dumps({"error": what.removeprefix("error: "), "exit_code": code},
                             sort_keys=True), flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run `weenv` with `argv` (default: sys.argv[1:]) in this process and return the exit
    code. The program's entry point is entry.py, which may hand a command over to another
    process first (`weenv run` to the node service, whose process then calls this)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # until the arguments are parsed
    as_json = "--json" in argv  # likewise: a failure is also a JSON line on stdout
    logs = _LogSetup()
    try:
        args = _parse(_parser_for(_command_of(argv)), argv)
        debug, as_json = args.debug, bool(getattr(args, "json", False))
        _setup_logging(logs, args.verbose, args.log_file)
        return _dispatch(args)
    except _ParseExit as stop:
        return stop.code
    except (WeenvError, FormatError) as error:
        if debug:
            traceback.print_exc()
        return _failed(f"error: {_one_line(error)}", int(getattr(error, "exit_code", 1)),
                       as_json)
    except Terminated as stop:
        return _failed(stop.why or f"terminated by {signal.Signals(stop.signum).name}",
                       128 + stop.signum, as_json)
    except KeyboardInterrupt:
        return _failed("interrupted", EXIT_INTERRUPTED, as_json)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as error:
        if debug:
            traceback.print_exc()
        if error.filename is None or error.strerror is None:  # not about a path given: a bug
            return _failed(_internal(error), EXIT_INTERNAL, as_json)
        # A path that cannot be used (a file where a folder must be, no permission): the
        # node's or the caller's setting, told as such, not as an internal error.
        problem = ("exists and is not a folder" if error.errno == errno.EEXIST
                   else error.strerror.lower())
        return _failed(f"error: {error.filename}: {problem}", 1, as_json)
    except Exception as error:
        if debug:
            traceback.print_exc()
        return _failed(_internal(error), EXIT_INTERNAL, as_json)
    finally:
        logs.undo()
