"""Warming the node cache for an environment: its hint's chunks (with `everything`, then
every other chunk) fetched, verified and cached, ahead of or next to its mounts.

Owns: loading what a warm-up needs without composing a tree (the manifest, and the group
indexes through the node's checked copies, node_copies.py), finding the hint as a mount
would (node_hints.py `find_hint`), running the `Prefetcher`, and the progress reports that a
mount reads when its replay runs in a process of its own (fuse/replay_process.py).

Why a process of its own: a replay is CPU work (ranged GETs through boto3, zstd, BLAKE3,
cache writes) that, in the mount daemon, competes for the interpreter lock with the
daemon's answers to the kernel; a cold start waits on those answers. In a separate process
the two run on two cores: the README's cold `weenv run` with a hint took 0.15-0.2 s less
(docs/benchmarks.md). Chunks are shared through the node cache and its cross-process chunk
locks, so neither process fetches what the other has.

With `page_roots` (group position -> the folder where that group is mounted; the mount that
asked for the replay, on the kernel path), the hint's files are also read through those
mounts into the kernel's page cache as their chunks arrive (core/page_warm.py), in a thread
that goes on after the fetching is done.

Reports are JSON lines, one per `REPORT_EVERY` seconds and one with `"done": true` when the
fetching is done (another after the page-cache warm-up, if any): `hints` (what
`Prefetcher.progress` says, with `pages`: what the warm-up did), `fetch` (this process's
counters, `Stats.snapshot`) and `fetched` (the chunks prefetched since the last report, as
`[hex digest, plaintext bytes]`, for the mount's hit and waste accounting). A reader that
goes away ends the warm-up within a report's interval (a write fails with EPIPE), even while
a store request hangs.

Must not: know about FUSE, mounts or the node service.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import Manifest
from weenvfs.store.base import Store
from weenvfs.store.repository import Repository

from .cache import ChunkCache
from .chunk_plan import ChunkLoc
from .fetcher import Fetcher
from .node_copies import load_index, resolve_env
from .node_hints import find_hint
from .page_warm import PageWarmer
from .prefetch import Prefetcher
from .stats import Stats

log = logging.getLogger(__name__)

REPORT_EVERY = 0.1  # seconds between progress reports
# Ranged requests in flight. A mount's fetcher keeps prefetch to 2 so that its demand reads
# find the store free; this process has none, and 4 made the README's cold `weenv run` with
# a hint 1.45 s against 1.63 s with 2 (8: 1.45 s, wider spread; 3 alternating rounds each).
CONCURRENCY = 4


@dataclass(frozen=True)
class WarmTarget:
    """An environment as a warm-up needs it: no composed tree."""

    digest: str
    manifest: Manifest
    indexes: list[GroupIndex]


def load_target(store: Store, ref: str, cache_dir: Path) -> WarmTarget:
    """Resolve `ref` in `store` (node_copies.py `resolve_env`) and load its group indexes
    (each checked, as a mount does)."""
    repo = Repository(store)
    digest, manifest = resolve_env(repo, ref, cache_dir)
    loaded: dict[str, GroupIndex] = {}
    for group in manifest.groups:
        if group.index not in loaded:
            loaded[group.index] = load_index(repo, group.index, cache_dir)
    return WarmTarget(digest, manifest, [loaded[g.index] for g in manifest.groups])


class _ReportingStats(Stats):
    """Stats that also remember which chunks prefetch brought in since the last report."""

    def __init__(self) -> None:
        super().__init__()
        self.new_prefetched: list[tuple[str, int]] = []

    def record_prefetched(self, digest: bytes, nbytes: int = 0) -> None:
        super().record_prefetched(digest, nbytes)
        self.new_prefetched.append((digest.hex(), nbytes))


async def warm(store: Store, cache: ChunkCache, target: WarmTarget, *, hint: str,
               everything: bool, report: Callable[[dict[str, Any]], None] | None = None,
               page_roots: Mapping[int, Path] | None = None) -> dict[str, Any]:
    """Replay the hint `hint` names (`none`: no hint) of `target` into `cache`, then with
    `everything` fetch every other chunk; with `page_roots`, read the hint's files through
    those mounts too (see the module). `report(line)` gets the reports described in the
    module; a BrokenPipeError it raises (the reader left) ends the warm-up and is raised
    again here. Returns the last report."""
    stats = _ReportingStats()
    fetcher = Fetcher(store, cache, stats, prefetch_concurrency=CONCURRENCY)
    prefetcher = Prefetcher(target.indexes, fetcher, fetch_all=everything)
    fetch_done = threading.Event()
    pages: PageWarmer | None = None
    warming: threading.Thread | None = None

    def lookup() -> Any:
        nonlocal pages, warming
        found = find_hint(Repository(store), target.digest, target.manifest, target.indexes,
                          hint)
        if found is not None and found.hint.files and page_roots:
            # Started at once: it opens the mounts and maps the files while chunks arrive.
            pages = PageWarmer(found.hint, target.indexes, page_roots, cache, fetch_done)
            warming = threading.Thread(target=pages.run, name="page-warm", daemon=True)
            warming.start()
        return found

    def line(done: bool) -> dict[str, Any]:
        progress = prefetcher.progress()
        progress["pages"] = None if pages is None else pages.progress
        out = {"hints": progress, "fetch": stats.snapshot(),
               "fetched": stats.new_prefetched, "done": done}
        stats.new_prefetched = []
        if report is not None:
            report(out)
        return out

    gone = False

    async def reports(cancel: trio.CancelScope) -> None:
        nonlocal gone
        while True:
            await trio.sleep(REPORT_EVERY)
            try:
                line(done=False)  # also when nothing moved: a reader that left shows at once
            except BrokenPipeError:
                gone = True
                cancel.cancel()
                return

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.serve)
            nursery.start_soon(reports, nursery.cancel_scope)
            await prefetcher.run(lookup)
            if prefetcher.hint_missing:
                prefetcher.hint_missing = await _refetch(fetcher, prefetcher.hinted)
            fetch_done.set()
            if warming is not None:
                line(done=True)  # the mount may fetch neighbourhoods again from now on
                await trio.to_thread.run_sync(warming.join, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()
    finally:
        fetch_done.set()  # a warm-up still waiting for chunks stops waiting
        fetcher.close()
    if gone:
        raise BrokenPipeError("the reader of the reports went away")
    return line(done=True)


async def _refetch(fetcher: Fetcher, locs: list[ChunkLoc]) -> int:
    """The hinted chunks still missing after the replay: a window leaves a chunk to another
    process that holds its lock (a mount reading it, another warm-up). Wait for those locks,
    fetch what is still missing once more, and return how many are missing after that."""
    cache = fetcher.cache
    for loc in locs:
        if not cache.contains(loc.digest):
            (await cache.lock_async(loc.digest)).release()
    await fetcher.prefetch([loc for loc in locs if not cache.contains(loc.digest)])
    return sum(1 for loc in locs if not cache.contains(loc.digest))


def report_to_fd(fd: int) -> Callable[[dict[str, Any]], None]:
    """A `report` that writes each line to `fd` (a pipe a mount reads)."""

    def write(out: dict[str, Any]) -> None:
        data = memoryview(json.dumps(out, separators=(",", ":")).encode() + b"\n")
        while data:
            data = data[os.write(fd, data):]

    return write
