"""How a command of the build side opens the store it names: `open_repo` (a context) and
`with_repo` (a handler that gets the repository), one way for build, compose, convert and
the read commands (ls, inspect, verify, export, gc).

Must not: parse arguments or print.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

from weenvfs.store import open_store
from weenvfs.store.repository import Repository


@contextlib.contextmanager
def open_repo(url: str, *, write: bool = False, check: bool = True) -> Iterator[Repository]:
    """The repository of the store at `url`, checked (for writing with `write`, which also
    makes a missing local store folder), closed at the end."""
    store = open_store(url, create=write)
    try:
        if check:
            store.check(write=write)
        yield Repository(store)
    finally:
        store.close()


def with_repo(fn: Callable[[argparse.Namespace, Repository], int]) -> Callable[..., int]:
    """A handler for `add_command(func=...)` that calls `fn(args, repo)` for `--store`."""

    def handler(args: argparse.Namespace) -> int:
        with open_repo(args.store) as repo:
            return fn(args, repo)

    return handler
