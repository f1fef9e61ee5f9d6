"""The `weenv cache stats` and `weenv cache prune` commands.

Owns: argument parsing and output of the two commands, and size parsing/formatting for them.
Must not: know the cache layout (core/cache.py does); both commands work on a cache that live
mounts are using (prune unlinks, open files keep reading, anything else is fetched again).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from weenvfs.cli import add_command
from weenvfs.core.cache import CACHE_ENV, DEFAULT_CACHE_DIR, ChunkCache, default_cache_dir
from weenvfs.errors import WeenvError
from weenvfs.units import format_size, size_arg

_CACHE_HELP = f"chunk cache folder (default: ${CACHE_ENV}, else {DEFAULT_CACHE_DIR})"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `cache stats` and `cache prune`."""
    group = add_command(
        subparsers,
        "cache",
        help="inspect or shrink the node chunk cache",
        description="The node-local chunk cache shared by every mount on this machine.",
        examples=["weenv cache stats", "weenv cache prune --max-size 5G"],
        func=None,
    )
    commands = group.add_subparsers(title="cache commands", metavar="COMMAND")
    stats = add_command(
        commands,
        "stats",
        help="show the cache's size and contents",
        description="Scan the chunk cache and show how many chunks it holds and their size.",
        examples=["weenv cache stats", "weenv cache stats --json --cache /srv/cache"],
        func=_cmd_stats,
    )
    stats.add_argument("--cache", type=Path, metavar="DIR", help=_CACHE_HELP)
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    prune = add_command(
        commands,
        "prune",
        help="evict least recently used chunks and leftovers of crashed processes",
        description=(
            "Remove temp and lock files left by crashed processes, then evict the least\n"
            "recently used chunks down to --max-size (default: the default cache bound),\n"
            "or every chunk with --all. Safe while mounts run: data they hold open stays\n"
            "readable, anything else is fetched again on use."
        ),
        examples=["weenv cache prune --max-size 5G", "weenv cache prune --all"],
        func=_cmd_prune,
    )
    prune.add_argument("--cache", type=Path, metavar="DIR", help=_CACHE_HELP)
    how = prune.add_mutually_exclusive_group()
    how.add_argument("--max-size", type=size_arg, metavar="SIZE", help="e.g. 5G, 500M")
    how.add_argument("--all", action="store_true", help="remove every cached chunk")


def _open(args: argparse.Namespace) -> ChunkCache:
    return ChunkCache(args.cache or default_cache_dir(), create=False)


def _failed(cache: ChunkCache, what: str, error: OSError) -> WeenvError:
    return WeenvError(f"cannot {what} chunk cache {cache.root}: {error.strerror or error}")


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _cmd_stats(args: argparse.Namespace) -> int:
    cache = _open(args)
    try:
        usage = cache.usage()
    except OSError as e:
        raise _failed(cache, "scan", e) from None
    if args.json:
        print(json.dumps({"path": str(cache.root), **vars(usage)}, sort_keys=True))
        return 0
    print(f"cache       {cache.root}")
    print(f"chunks      {usage.chunks}")
    print(f"size        {format_size(usage.bytes)} ({usage.bytes} bytes)")
    print(f"least used  {_when(usage.oldest_use)}")
    print(f"last used   {_when(usage.newest_use)}")
    print(f"leftovers   {usage.temp_files} temp file(s), {usage.lock_files} lock file(s)")
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    cache = _open(args)
    try:
        result = cache.prune(args.max_size, everything=args.all)
    except OSError as e:
        raise _failed(cache, "prune", e) from None
    print(
        f"removed {result.removed_chunks} chunk(s), {format_size(result.removed_bytes)}; "
        f"{result.chunks_left} chunk(s), {format_size(result.bytes_left)} left"
    )
    return 0
