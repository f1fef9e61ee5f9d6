"""The `weenv` program's entry point (the console script and `python -m weenvfs`).

A command that another process may carry out for this one (`HAND_OVER`: `weenv run` and
`weenv pull`, which the node service runs, hand_over.py) is handed over before
anything else is imported: not the argument parser, logging or the error handling of cli.py,
about 25 ms of a warm `weenv run` that only waits for the service (docs/benchmarks.md), and
for `weenv pull` also grpc's ~90 ms. Every other command, and a hand-over the service did not
take, goes to `cli.main` in this process.

A scripts/setup.sh install puts a native launcher in front of this (native/weenv-launch.c,
its `weenv`): it hands `weenv run` over the same way without starting Python at all (~30 ms
less per warm run) and runs `python -m weenvfs` for everything else, so this module decides
every other case as before.

Must not: import anything at module level beyond the interpreter's cheapest modules (a test
checks what a handed-over run imports), or parse arguments beyond finding the command's name.
"""

from __future__ import annotations

import importlib
import sys

from weenvfs.command_word import EXIT_INTERRUPTED, command_at

# Commands that another process may carry out for this one: the module's `hand_over(argv,
# at)` returns the exit status, or None to run the command here. A module of its own, not the
# command's (`weenv run` would import the runtime's command module for nothing, ~17 ms).
HAND_OVER = {"run": "weenvfs.hand_over", "pull": "weenvfs.hand_over"}


def main() -> int:
    """Run `weenv` with sys.argv: handed over (HAND_OVER) when the command allows it and the
    node service takes it, else in this process (cli.main)."""
    words = sys.argv[1:]
    at = command_at(words)
    module = None if at is None else HAND_OVER.get(words[at])
    if module is not None:
        try:
            status = importlib.import_module(module).hand_over(words, at)
        except KeyboardInterrupt:  # before the command started: nothing to clean up
            print("weenv: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except OSError as error:  # no pipe or descriptor to hand over (EMFILE, ...)
            print(f"weenv: error: cannot hand the command to the node service: {error}",
                  file=sys.stderr)
            return 1
        if status is not None:
            return status
    from weenvfs.cli import main as run_here

    return run_here()
