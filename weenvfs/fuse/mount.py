"""The life of one mount inside the process that serves it: set up, serve, tear down.

Owns, in order:
1. `load`: open the store, check it is reachable (fail fast, one line), resolve the
   environment, fetch its manifest and group indexes (nothing else) and compose the tree
   (core/loaded_env.py);
2. `serve`: build the chunk cache, fetcher and reader, then serve on one of two paths: the
   kernel path where it can run (kernel_mount.py: EROFS images over lazily served data
   devices, only data reads reach this process), else the tree over FUSE (`Operations`,
   mounted read-only with pyfuse3); either way pyfuse3's main loop runs under trio together
   with read-ahead, the files a sandbox's build reads first (core/identity_files.py), hint
   replay (mount_replay.py: the hint `config.hint` names, looked up while the image is made,
   then everything with `fetch_all`) and signal handling, and `ready()` is called once the
   mount answers (the daemon reports readiness through a pipe then);
3. teardown: SIGTERM/SIGINT end the main loop (`pyfuse3.terminate`), then
   `pyfuse3.close(unmount=True)` unmounts (a no-op if `fusermount3 -u` already did), the
   fetcher is closed and the pid file removed. A mount that recorded a hint
   (`config.record_tag`) merges it into the environment's hint and publishes it after
   unmounting, writes what it published to `config.record_result` if set, and has the hint
   packed in the background (pack_launch.py).

Must not: parse the command line (commands.py), fork or daemonize (daemon.py), or decide what
the file system looks like (core/tree.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import ChunkLoc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.identity_files import identity_locs
from weenvfs.core.loaded_env import LoadedEnv, open_environment
from weenvfs.core.neighbours import Neighbours
from weenvfs.core.node_copies import note_resolved
from weenvfs.core.node_hints import HintRecorder, publish_env_run
from weenvfs.core.reader import Reader
from weenvfs.core.stats import Stats
from weenvfs.core.tree import FormatError
from weenvfs.errors import WeenvError
from weenvfs.store import open_store

from . import native_devices, pack_launch, writable_stores
from .config import MountConfig
from .mount_replay import MountReplay
from .ops import Operations

log = logging.getLogger(__name__)

FSNAME = "weenv"
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # end the main loop; blocked until it runs
# The kernel's read-ahead for the mount. Its default, 128 KiB, turns a sequential read of one
# 1 MiB chunk into 8 requests through this process; a chunk per request reads 2-3 times faster
# (benchmarks/read.py), and the kernel still starts small for readers that do not stream.
READAHEAD_BYTES = 1 << 20


def load(store_url: str, ref: str, layer: int | None = None,
         cache_dir: Path | None = None) -> LoadedEnv:
    """Open the store at `store_url` and load environment `ref`, or its group `layer` as an
    overlayfs lower layer (see `open_environment`); indexes through the node's copies in
    `cache_dir` (core/node_copies.py)."""
    store = open_store(store_url)
    try:
        env = open_environment(store, ref, layer, cache_dir)
    except BaseException:
        store.close()
        raise
    if cache_dir is not None:  # what the node service preloads for the next mount of `ref`
        note_resolved(cache_dir, store_url, ref, env.digest)
    return env


def mount_options(allow_other: bool) -> set[str]:
    """pyfuse3 mount options: read-only, kernel permission checks, named `weenv`."""
    options = {f"fsname={FSNAME}", f"subtype={FSNAME}", "ro", "default_permissions"}
    if allow_other:
        # Lets sandboxes running as other users in; default_permissions still applies modes.
        options.add("allow_other")
    return options


def stats_document(
    env: LoadedEnv, config: MountConfig, stats: Stats, started: float
) -> dict[str, Any]:
    """What `weenv stats` shows: the fetcher's counters plus facts about the mount."""
    return {
        "mount": {
            "ref": env.ref,
            "manifest": env.digest,
            "groups": env.group_names,
            "layer": env.layer,
            "mountpoint": str(config.mountpoint),
            "store": env.store.url,
            "cache": str(config.cache_dir),
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - started, 3),
        },
        "fetch": stats.snapshot(),
    }


async def serve(env: LoadedEnv, config: MountConfig,
                ready: Callable[[], None]) -> dict[str, Any]:
    """Mount `env` at `config.mountpoint` and serve it until unmounted or signalled: on the
    kernel path where it can run (kernel_mount.py), else as a tree over FUSE. Returns the
    final statistics document (taken once unmounted: nothing counts after it)."""
    from .kernel_mount import kernel_unavailable

    reason = kernel_unavailable(env, config)
    if reason is not None and config.path == "kernel":
        raise WeenvError(f"the kernel path cannot mount here: {reason}")
    cache = ChunkCache(config.cache_dir, config.cache_size)
    stats = Stats()
    no_merge = {} if config.coalesce else {"coalesce_gap": -1}  # -1: never merge chunks
    fetcher = Fetcher(env.store, cache, stats, deadline=config.deadline, **no_merge)
    # The hint is looked up, and its replay placed (mount_replay.py), while the image is made.
    first = _identity_chunks(env)
    replay = MountReplay(env, config, fetcher, pages=reason is None, first=first)
    replay.start()
    # Neighbourhoods hide a store's latency; a store as near as the local disk has none to
    # hide, and they cost a cold start CPU (decoding 3x what it reads; docs/benchmarks.md).
    neighbours = config.neighbours and not env.store.cheap_requests
    if neighbours:
        fetcher.neighbours = Neighbours(env.tree.groups).around
    reader = Reader(env.tree, fetcher)
    recorder = reader.recorder = HintRecorder() if config.record_tag is not None else None

    async def prefetch() -> None:
        if first:  # what the sandbox's build reads first, asked for as serving starts
            fetcher.schedule_prefetch(first)
        await replay.run()
    started = time.monotonic()
    helper, why_python = (None, None) if reason else native_devices.choose_server()
    path = {"path": "fuse" if reason else "kernel", "fallback_reason": reason,
            "device_server": None if reason else "native" if helper else "python",
            "device_server_reason": why_python,
            "neighbourhoods": neighbours}

    def document() -> dict[str, Any]:
        doc = stats_document(env, config, stats, started)
        doc["mount"].update(path)
        doc["hints"] = replay.progress()
        doc["hints"]["recorded_chunks"] = None if recorder is None else len(recorder)
        return doc

    async def run(announce: Callable[[], Awaitable[None]],
                  stop: Callable[[], Awaitable[None]],
                  main: Callable[[], Awaitable[None]] = pyfuse3.main) -> None:
        await _run(fetcher, announce, stop, prefetch, main)

    try:
        if reason is None:
            await _serve_kernel(env, config, reader, run, document, ready, helper)
        else:
            log.info("serving the tree over FUSE: %s", reason)
            await _serve_tree(env, config, reader, run, document, ready)
    finally:
        fetcher.close()
    final = document()
    if recorder is not None:
        await trio.to_thread.run_sync(_publish_recorded, env, config, recorder)
    return final


async def _serve_kernel(env: LoadedEnv, config: MountConfig, reader: Reader,
                        run: Callable[..., Awaitable[None]],
                        document: Callable[[], dict[str, Any]],
                        ready: Callable[[], None], helper: str | None) -> None:
    from .kernel_mount import prepare_layers, serve_kernel

    layers = await trio.to_thread.run_sync(prepare_layers, env, config, reader)
    await serve_kernel(layers, config, run, document, ready, helper)


async def _serve_tree(env: LoadedEnv, config: MountConfig, reader: Reader,
                      run: Callable[..., Awaitable[None]],
                      document: Callable[[], dict[str, Any]],
                      ready: Callable[[], None]) -> None:
    ops = Operations(env.tree, reader, document)
    try:
        pyfuse3.init(ops, str(config.mountpoint), mount_options(config.allow_other))
    except RuntimeError as error:
        raise WeenvError(f"cannot mount {config.mountpoint}: {error}") from None

    async def announce() -> None:
        await _announce_ready(config.mountpoint, ready)

    async def stop() -> None:
        pyfuse3.terminate()

    try:
        await run(announce, stop)
    finally:
        _teardown(config.mountpoint)


def _identity_chunks(env: LoadedEnv) -> list[ChunkLoc]:
    """The chunks of the files a sandbox's build reads before its command (core/
    identity_files.py), for the mount that replays the environment's hint; advisory: a
    malformed index costs the head start, logged, and fails where it is read."""
    if not env.serves_top:
        return []
    try:
        return identity_locs(env.tree.groups)
    except FormatError as error:
        log.info("not fetching the identity files ahead: %s", error)
        return []


async def _run(
    fetcher: Fetcher,
    announce: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    prefetch: Callable[[], Awaitable[None]] | None = None,
    main: Callable[[], Awaitable[None]] = pyfuse3.main,
) -> None:
    """The mount's FUSE server (`main`: pyfuse3's main loop, or the kernel path's native
    device server's channel) with read-ahead, hint replay, signal handling (`stop`) and the
    readiness announcement. Once it returns, SIGTERM and SIGINT are ignored: the teardown
    that follows (unmounting, closing the cache) must not be cut short by a late signal."""
    try:
        await _run_loop(fetcher, announce, stop, prefetch, main)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


async def _run_loop(
    fetcher: Fetcher,
    announce: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    prefetch: Callable[[], Awaitable[None]] | None,
    main: Callable[[], Awaitable[None]],
) -> None:
    announced = trio.Event()

    async def announce_once() -> None:
        try:
            await announce()
        finally:
            announced.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(fetcher.serve)  # read-ahead and cache eviction
        if prefetch is not None:
            nursery.start_soon(prefetch)
        nursery.start_soon(_stop_on_signals, stop, announced)
        nursery.start_soon(announce_once)
        await main()
        # The main loop ends when the file system is unmounted or terminate() was called.
        nursery.cancel_scope.cancel()


async def _stop_on_signals(stop: Callable[[], Awaitable[None]], announced: trio.Event) -> None:
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        # Blocked while the mount was being set up (commands.py): delivered now, if any came.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        async for signum in signals:
            log.info("received %s, unmounting", signal.Signals(signum).name)
            # The announcement's syscalls (mount(2), the first stat) wait for this loop to
            # answer the requests they cause: ending it before they return would leave them,
            # and the superblock locks they hold (every sync(2) of the node), hanging.
            await announced.wait()
            await stop()
            return


async def _announce_ready(mountpoint: Path, ready: Callable[[], None]) -> None:
    """Call `ready()` once a stat of the mount point has gone through this very process."""
    st = await trio.to_thread.run_sync(os.stat, mountpoint)
    set_readahead(st.st_dev, READAHEAD_BYTES)
    log.info("mounted at %s", mountpoint)
    ready()


def set_readahead(st_dev: int, nbytes: int) -> bool:
    """Set the kernel's read-ahead of the mount with device number `st_dev` to `nbytes`
    (through sysfs: root only; False, logged at debug level, where that is not allowed)."""
    path = f"/sys/class/bdi/{os.major(st_dev)}:{os.minor(st_dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(nbytes // 1024))
    except OSError as e:
        log.debug("cannot set the read-ahead in %s: %s", path, e.strerror or e)
        return False
    return True


def _teardown(mountpoint: Path) -> None:
    """Unmount (a no-op when already unmounted)."""
    pyfuse3.close(unmount=True)
    log.info("unmounted %s", mountpoint)


def _publish_recorded(env: LoadedEnv, config: MountConfig, recorder: HintRecorder) -> None:
    """Merge what this mount read into the environment's hint `config.record_tag` and
    publish it; a failure is logged (the mount itself went fine). Writes the outcome to
    `config.record_result` when set."""
    assert config.record_tag is not None
    run = recorder.records()
    outcome: dict[str, Any] = {"manifest": env.digest, "tag": config.record_tag,
                               "recorded": len(run), "hint": None, "records": 0, "files": 0}
    try:
        published = publish_env_run(env, run, config.record_tag, replace=config.record_replace,
                                    files=recorder.files())
    except (WeenvError, FormatError, OSError) as e:
        log.warning("cannot publish the recorded hint: %s", e)
        outcome["error"] = str(e)
        writable_stores.forget(env.store)  # if the run trusted a memo, the next one asks
    else:
        if published is not None:
            outcome["hint"], outcome["records"] = published[0], len(published[1].records)
            outcome["files"] = len(published[1].files)
            outcome["packing"] = pack_launch.launch(env, config, published[0])
    if config.record_result is not None:
        tmp = config.record_result.with_name(f".{config.record_result.name}.{os.getpid()}")
        tmp.write_text(json.dumps(outcome, sort_keys=True))
        tmp.replace(config.record_result)
