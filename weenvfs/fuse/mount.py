"""The life of one mount inside the process that serves it: set up, serve, tear down.

Owns, in order:
1. `load`: open the store, check it is reachable (fail fast, one line), resolve the
   environment, fetch its manifest and group indexes (nothing else) and compose the tree
   (core/environment.py);
2. `serve`: build the chunk cache, fetcher, reader and `Operations`, mount read-only with
   pyfuse3 and run its main loop under trio, together with read-ahead and signal handling;
   once the kernel has answered a `stat` of the mount point through this very loop, call
   `ready()` (the daemon reports readiness through a pipe then);
3. teardown: SIGTERM/SIGINT end the main loop (`pyfuse3.terminate`), then
   `pyfuse3.close(unmount=True)` unmounts (a no-op if `fusermount3 -u` already did), the
   fetcher is closed and the pid file removed.

Must not: parse the command line (commands.py), fork or daemonize (daemon.py), or decide what
the file system looks like (core/tree.py).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from weenvfs.core.cache import ChunkCache
from weenvfs.core.environment import Environment, open_environment
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.reader import Reader
from weenvfs.core.stats import Stats
from weenvfs.errors import WeenvError
from weenvfs.store import open_store

from .ops import Operations

log = logging.getLogger(__name__)

FSNAME = "weenv"


@dataclass(frozen=True)
class MountConfig:
    """Everything a mount needs besides the environment itself."""

    mountpoint: Path
    cache_dir: Path
    cache_size: int
    deadline: float
    allow_other: bool = False


def load(store_url: str, ref: str) -> Environment:
    """Open the store at `store_url` and load environment `ref` (see `open_environment`)."""
    store = open_store(store_url)
    try:
        return open_environment(store, ref)
    except BaseException:
        store.close()
        raise


def mount_options(allow_other: bool) -> set[str]:
    """pyfuse3 mount options: read-only, kernel permission checks, named `weenv`."""
    options = {f"fsname={FSNAME}", f"subtype={FSNAME}", "ro", "default_permissions"}
    if allow_other:
        # Lets sandboxes running as other users in; default_permissions still applies modes.
        options.add("allow_other")
    return options


def stats_document(
    env: Environment, config: MountConfig, stats: Stats, started: float
) -> dict[str, Any]:
    """What `weenv stats` shows: the fetcher's counters plus facts about the mount."""
    return {
        "mount": {
            "ref": env.ref,
            "manifest": env.digest,
            "groups": env.group_names,
            "mountpoint": str(config.mountpoint),
            "store": env.store.url,
            "cache": str(config.cache_dir),
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - started, 3),
        },
        "fetch": stats.snapshot(),
    }


async def serve(env: Environment, config: MountConfig, ready: Callable[[], None]) -> None:
    """Mount `env` at `config.mountpoint` and serve it until unmounted or signalled."""
    cache = ChunkCache(config.cache_dir, config.cache_size)
    stats = Stats()
    fetcher = Fetcher(env.store, cache, stats, deadline=config.deadline)
    reader = Reader(env.tree, fetcher)
    started = time.monotonic()
    ops = Operations(env.tree, reader, lambda: stats_document(env, config, stats, started))
    try:
        pyfuse3.init(ops, str(config.mountpoint), mount_options(config.allow_other))
    except RuntimeError as error:
        fetcher.close()
        raise WeenvError(f"cannot mount {config.mountpoint}: {error}") from None
    try:
        await _run(config.mountpoint, fetcher, ready)
    finally:
        _teardown(fetcher, config.mountpoint)


async def _run(mountpoint: Path, fetcher: Fetcher, ready: Callable[[], None]) -> None:
    """pyfuse3's main loop with read-ahead, signal handling and the readiness probe."""
    async with trio.open_nursery() as nursery:
        await nursery.start(fetcher.serve)  # read-ahead and cache eviction
        nursery.start_soon(_terminate_on_signals)
        nursery.start_soon(_announce_ready, mountpoint, ready)
        await pyfuse3.main()
        # The main loop ends when the file system is unmounted or terminate() was called.
        nursery.cancel_scope.cancel()


async def _terminate_on_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s, unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


async def _announce_ready(mountpoint: Path, ready: Callable[[], None]) -> None:
    """Call `ready()` once a stat of the mount point has gone through this very process."""
    await trio.to_thread.run_sync(os.stat, mountpoint)
    log.info("mounted at %s", mountpoint)
    ready()


def _teardown(fetcher: Fetcher, mountpoint: Path) -> None:
    """Unmount (a no-op when already unmounted) and release everything, in that order."""
    try:
        pyfuse3.close(unmount=True)
    finally:
        fetcher.close()
        log.info("unmounted %s", mountpoint)
