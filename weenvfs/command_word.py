"""Where the command is in `weenv`'s arguments, and the exit status of an interrupted run:
what both the entry point (entry.py, before anything is imported) and the CLI (cli.py) need.

Must not: import anything (entry.py's hand-over must stay cheap).
"""

from __future__ import annotations

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def command_at(argv: list[str]) -> int | None:
    """Where in `argv` the subcommand (or `--version`) is, if anywhere."""
    words = iter(enumerate(argv))
    for at, word in words:
        if word == "--version":
            return at
        if word == "--log-file":
            next(words, None)
        elif word == "--" or not word.startswith("-"):
            return None if word == "--" else at
    return None
