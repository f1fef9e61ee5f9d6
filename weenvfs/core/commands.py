"""The `weenv cache stats`, `weenv cache prune` and `weenv cache warm` commands.

Owns: argument parsing and output of the three commands, and size parsing/formatting for them.
Must not: know the cache layout (core/cache.py does); both commands work on a cache that live
mounts are using (prune unlinks, open files keep reading, anything else is fetched again).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

from weenvfs.cli import add_command
from weenvfs.cli_args import add_store, page_root, print_json
from weenvfs.core.cache import CACHE_ENV, DEFAULT_CACHE_DIR, ChunkCache, default_cache_dir
from weenvfs.errors import UsageError, WeenvError
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
            "Remove temp and lock files left by crashed processes and week-old mount logs,\n"
            "then evict the least recently used chunks and node files (indexes, EROFS\n"
            "images, layouts) down to --max-size (default: the default cache bound), or\n"
            "all of them with --all. Safe while mounts run: data they hold open stays\n"
            "readable, anything else is fetched again on use."
        ),
        examples=["weenv cache prune --max-size 5G", "weenv cache prune --all"],
        func=_cmd_prune,
    )
    prune.add_argument("--cache", type=Path, metavar="DIR", help=_CACHE_HELP)
    how = prune.add_mutually_exclusive_group()
    how.add_argument("--max-size", type=size_arg, metavar="SIZE", help="e.g. 5G, 500M")
    how.add_argument("--all", action="store_true", help="remove every cached chunk")
    _register_warm(commands)


def _register_warm(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    warm = add_command(
        commands,
        "warm",
        help="fetch an environment's hinted chunks (or all of them) into the cache",
        description=(
            "Fetch, verify and cache the chunks of REF's prefetch hint (tag latest, else the\n"
            "manifest's own), and with --all then every other chunk, so that the node's next\n"
            "cold start of REF reads from the cache. Mounts replay their hint this way by\n"
            "themselves (in a process of their own, started by the node service); this\n"
            "command warms a node ahead of time. Safe next to live mounts: the cache's chunk\n"
            "locks make sure no chunk is fetched twice."
        ),
        examples=["weenv cache warm py:3.11 --store s3://bucket/envs",
                  "weenv cache warm py:3.11 --store /srv/weenv --all --json",
                  "weenv cache warm py:3.11 --store /srv/weenv --pages-through /mnt/py"],
        func=_cmd_warm,
    )
    warm.add_argument("ref", metavar="REF", help="environment NAME[:TAG] or manifest digest")
    add_store(warm, required=True)
    warm.add_argument("--cache", type=Path, metavar="DIR", help=_CACHE_HELP)
    warm.add_argument("--hint", default="latest", metavar="TAG|DIGEST|none",
                      help="the hint to replay (default: tag latest, if it exists)")
    warm.add_argument("--all", action="store_true",
                      help="after the hint, fetch every other chunk of the environment")
    warm.add_argument("--json", action="store_true", help="print the result as JSON")
    # A mount that hands its replay to this command reads JSON-line reports here
    # (core/warm.py); the node service passes the pipe as its readiness fd.
    warm.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    warm.add_argument("--pages-through", action="append", default=[], metavar="[N=]DIR",
                      help="also read the hint's files (of group N, or of every group) "
                           "through the mount at DIR into the page cache as their chunks "
                           "arrive; repeatable (a mount's replay does this itself)")


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
        print_json({"path": str(cache.root), **vars(usage)})
        return 0
    print(f"cache       {cache.root}")
    print(f"chunks      {usage.chunks}")
    print(f"size        {format_size(usage.bytes)} ({usage.bytes} bytes)")
    print(f"node files  {usage.node_files} (indexes, images, layouts), "
          f"{format_size(usage.node_bytes)}")
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
        f"removed {result.removed_chunks} chunk(s) and {result.removed_node_files} node "
        f"file(s), {format_size(result.removed_bytes)}; {result.chunks_left} chunk(s), "
        f"{format_size(result.bytes_left)} left"
    )
    return 0


def _page_roots(values: list[str], groups: int) -> dict[int, Path]:
    """Group position -> folder, from --pages-through (one for every group, then each N)."""
    out: dict[int, Path] = {}
    for group, folder in sorted(map(page_root, values), key=lambda item: item[0] is not None):
        if group is not None and group >= groups:
            raise UsageError(f"--pages-through {group}={folder}: the environment has groups "
                             f"0 to {groups - 1}")
        out.update({group: folder} if group is not None else dict.fromkeys(range(groups),
                                                                            folder))
    return out


def _cmd_warm(args: argparse.Namespace) -> int:
    import trio

    from weenvfs.core.node_hints import check_hint_spec
    from weenvfs.store import open_store

    from .warm import load_target, report_to_fd, warm

    check_hint_spec(args.hint)
    cache_dir = (args.cache or default_cache_dir()).absolute()
    report = report_to_fd(args.ready_fd) if args.ready_fd is not None else _Progress(args.ref)
    with open_store(args.store) as store:
        target = load_target(store, args.ref, cache_dir)  # checks the store if it must
        roots = _page_roots(args.pages_through, len(target.indexes))
        cache = ChunkCache(cache_dir)
        try:
            result = trio.run(functools.partial(warm, store, cache, target, hint=args.hint,
                                                everything=args.all, report=report,
                                                page_roots=roots))
        except BrokenPipeError:
            return 0  # the mount that asked for the replay is gone: nothing left to warm for
    if args.ready_fd is not None:
        return 0
    hints, fetch = result["hints"], result["fetch"]
    summary = {"environment": target.digest, "hint": hints["hint"], "source": hints["source"],
               "hinted_chunks": hints["chunks"], "missing": hints["chunks_missing"],
               "chunks_fetched": fetch["chunks_fetched"], "bytes_fetched": fetch["bytes_fetched"],
               "pages": hints.get("pages"),
               **({"all": hints["fetch_all"]} if "fetch_all" in hints else {})}
    if args.json:
        print_json(summary)
    elif hints["hint"] is None and not args.all:
        print(f"{args.ref} has no prefetch hint ({args.hint}): nothing to warm "
              "(--all fetches every chunk)")
    else:
        print(f"warmed {args.ref}: fetched {fetch['chunks_fetched']} chunk(s), "
              f"{format_size(fetch['bytes_fetched'])} from the store"
              + (f"; {hints['chunks_missing']} hinted chunk(s) could not be fetched"
                 if hints["chunks_missing"] else ""))
    return 1 if hints["chunks_missing"] or result["hints"].get("fetch_all", {}).get("missing") \
        else 0


class _Progress:
    """Progress on stderr, about once a second, while a warm-up runs."""

    def __init__(self, ref: str) -> None:
        self.ref = ref
        self.shown = time.monotonic()

    def __call__(self, line: dict[str, Any]) -> None:
        now = time.monotonic()
        if line["done"] or now - self.shown < 1.0:
            return
        self.shown = now
        hints, fetch = line["hints"], line["fetch"]
        everything = hints.get("fetch_all")
        if everything is not None and hints["state"] == "fetching all":
            done = f"{everything['done']} of {everything['chunks']} chunk(s)"
        else:
            done = f"{hints['chunks_done']} of {hints['chunks']} hinted chunk(s)"
        print(f"weenv: warming {self.ref}: {hints['state']}, {done}, "
              f"{format_size(fetch['bytes_fetched'])} fetched", file=sys.stderr, flush=True)
