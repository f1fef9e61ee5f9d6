"""Hint replay: the background task a mount starts to fetch its hinted chunks, in order.

Owns: turning a hint's records into chunk locations (in hint order, zero chunks and repeats
dropped), cutting them into windows of about `window_bytes` of stored data that go to
`Fetcher.prefetch_windows` (which coalesces each window into ranged reads of at most
`request_bytes`, issues nothing while a demand read is queued, and keeps to its own
concurrency limit), and the progress a mount reports. With `fetch_all`, once the hint is
done, every other chunk of the environment follows (passes repeated with back-off for chunks
that failed), so that a long task survives a store outage. The task ends when there is
nothing left to fetch; it never raises into the mount.

No pause between windows (`Fetcher.prefetch_windows`): each window is cut into requests on
its own, and the fetcher's `prefetch_concurrency` workers take the requests of every window
in order, each claiming its chunks only when it is about to fetch them, so a demand read never
waits behind a request that has not started. The replay used to wait for each window's
slowest request before the next window's first; on the reference hint run the workload caught
up with it there (in 2026-12 the replay took 0.48-0.52 s with those pauses, 0.30-0.40 s
without).

Must not: fetch, verify or cache chunks itself (core/fetcher.py), decide which hint to use
(core/node_hints.py `find_hint`, called through the `lookup` it is given), or know FUSE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import trio

from weenvfs.format.digest import short
from weenvfs.format.hints import Hint, HintRecord
from weenvfs.format.index import GroupIndex

from .chunk_plan import ChunkLoc, chunk_loc
from .fetcher import Fetcher
from .node_hints import FoundHint

log = logging.getLogger(__name__)

DEFAULT_WINDOW_BYTES = 32 << 20  # stored bytes handed to one Fetcher.prefetch call
# The first window is small and each next one twice as big, up to DEFAULT_WINDOW_BYTES: a
# demand read of a chunk inside a ranged request waits for the whole request, so the chunks
# a task needs first come in small requests, and the later ones in large ones.
FIRST_WINDOW_BYTES = 1 << 20
# A replay's ranged requests are cut at this many stored bytes (a fetcher's own limit is
# 8 MiB): a chunk is in the cache only once its request has arrived and the chunks before
# it in the request are decoded, and the workload reads right behind the replay. 2 and 4
# MiB measured alike on the reference hint run.
REQUEST_BYTES = 4 << 20
FETCH_ALL_PASSES = 4  # a pass retries what earlier ones could not fetch
FETCH_ALL_BACKOFF = 2.0  # seconds before the second pass; doubles each pass

HintLookup = Callable[[], FoundHint | None]


def hint_locs(records: Sequence[HintRecord], indexes: Sequence[GroupIndex]) -> list[ChunkLoc]:
    """The locations of the chunks `records` name, in record order; zero chunks and repeats
    (the same chunk under two records, or in two groups) dropped."""
    out: dict[bytes, ChunkLoc] = {}
    for rec in records:
        loc = chunk_loc(indexes[rec.group], rec.chunk)
        if loc.blob is not None and loc.digest not in out:
            out[loc.digest] = loc
    return list(out.values())


def replay_locs(hint: Hint, indexes: Sequence[GroupIndex]) -> list[ChunkLoc]:
    """Where a replay fetches the chunks of `hint` from, in record order: its pack (SPEC.md
    9.1, version 3) for the chunks in it, their groups' blobs for the others (`hint_locs`
    without a pack). Same digests and lengths as `hint_locs`, so a chunk the pack cannot
    deliver is fetched from its group's blob afterwards."""
    if hint.pack is None:
        return hint_locs(hint.records, indexes)
    out: dict[bytes, ChunkLoc] = {}
    pack = hint.pack
    for rec, length, offset in zip(hint.records, pack.lengths, pack.offsets(), strict=True):
        loc = chunk_loc(indexes[rec.group], rec.chunk)
        if loc.blob is None or loc.digest in out:
            continue
        out[loc.digest] = loc._replace(blob=pack.blob, offset=offset, clen=length) \
            if length else loc
    return list(out.values())


def all_locs(indexes: Sequence[GroupIndex], skip: set[bytes] | None = None) -> list[ChunkLoc]:
    """Every stored chunk of every group (lowest group first, chunk-table order), except the
    digests in `skip`."""
    seen = set(skip or ())
    out = []
    for index in indexes:
        for n in range(index.header.chunk_count):
            loc = chunk_loc(index, n)
            if loc.blob is not None and loc.digest not in seen:
                seen.add(loc.digest)
                out.append(loc)
    return out


def windows(
    locs: Sequence[ChunkLoc], window_bytes: int, first_bytes: int | None = None
) -> Iterator[list[ChunkLoc]]:
    """`locs` in order, cut into runs of stored bytes: the first at most `first_bytes`
    (default `window_bytes`), each next one at most twice the last, never above
    `window_bytes`; at least one chunk each."""
    limit = min(first_bytes or window_bytes, window_bytes)
    window: list[ChunkLoc] = []
    size = 0
    for loc in locs:
        if window and size + loc.clen > limit:
            yield window
            window, size = [], 0
            limit = min(2 * limit, window_bytes)
        window.append(loc)
        size += loc.clen
    if window:
        yield window


class Prefetcher:
    """Replays a hint (then, with `fetch_all`, everything) through `fetcher`."""

    def __init__(
        self,
        indexes: Sequence[GroupIndex],
        fetcher: Fetcher,
        *,
        fetch_all: bool = False,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        first_window_bytes: int = FIRST_WINDOW_BYTES,
        request_bytes: int = REQUEST_BYTES,
    ) -> None:
        self.indexes = indexes
        self.fetcher = fetcher
        self.fetch_all = fetch_all
        self.window_bytes = window_bytes
        self.first_window_bytes = first_window_bytes
        self.request_bytes = request_bytes
        self.state = "starting"
        self.found: FoundHint | None = None
        self.hinted: list[ChunkLoc] = []
        self.hint_done = 0  # hinted chunks whose window has been through the fetcher
        self.hint_missing = 0  # hinted chunks still not cached after their window
        self.hint_seconds: float | None = None
        self.all_total = self.all_done = self.all_missing = self.all_passes = 0
        self._digests: set[bytes] = set()

    async def run(self, lookup: HintLookup) -> None:
        """Find the hint with `lookup` (in a thread: it reads the store), replay it, then
        fetch everything else if asked. Failures are logged; nothing is raised."""
        started = time.monotonic()
        try:
            self.state = "looking up"
            self.found = await trio.to_thread.run_sync(lookup)
            if self.found is not None:
                await self._replay(self.found)
                self.hint_seconds = round(time.monotonic() - started, 3)
            if self.fetch_all:
                await self._fetch_everything()
            self.state = "done" if self.found is not None or self.fetch_all else "no hint"
        except Exception as e:  # advisory work: the mount goes on without it
            self.state = "failed"
            log.warning("prefetch stopped: %s", e)

    async def _replay(self, found: FoundHint) -> None:
        self.hinted = hint_locs(found.hint.records, self.indexes)
        self._digests = {loc.digest for loc in self.hinted}
        self.state = "replaying"
        order = replay_locs(found.hint, self.indexes)
        log.info("replaying hint %s (%s): %d chunks, %d bytes stored%s", short(found.digest),
                 found.source, len(order), sum(c.clen for c in order),
                 "" if found.hint.pack is None else f", pack {short(found.hint.pack.blob)}")
        # A hint names what the workload reads: the neighbourhoods of misses meanwhile
        # (core/neighbours.py) would be fetched for nothing (measured: no read used one, a few
        # MB more fetched). Not so for the seed: it names the start-up only, and the
        # workload's own reads miss from the start (with them, a seeded first run of the
        # reference workload took 0.86-0.91x as long).
        neighbours = self.fetcher.neighbours
        if not found.partial:
            self.fetcher.neighbours = None
        try:
            await self._prefetch(order, self._hint_window_done)
            if found.hint.pack is not None and self.hint_missing:
                await self._unpacked()
        finally:
            self.fetcher.neighbours = neighbours
        log.info("hint %s replayed: %d of %d chunks not cached", short(found.digest),
                 self.hint_missing, len(self.hinted))

    def _hint_window_done(self, window: Sequence[ChunkLoc], missing: int) -> None:
        self.hint_done += len(window)
        self.hint_missing += missing

    async def _unpacked(self) -> None:
        """The hinted chunks the pack did not deliver (its blob missing or damaged: each
        frame is verified like any other), fetched once more from their groups' blobs."""
        cache = self.fetcher.cache
        todo = [loc for loc in self.hinted if not cache.contains(loc.digest)]
        log.info("%d hinted chunks not delivered by the pack: from their blobs", len(todo))
        self.hint_missing = 0

        def done(window: Sequence[ChunkLoc], missing: int) -> None:
            self.hint_missing += missing

        await self._prefetch(todo, done)

    async def _fetch_everything(self) -> None:
        todo = all_locs(self.indexes, self._digests)
        self.all_total = len(todo)
        self._warn_if_too_big(todo)
        self.state = "fetching all"
        delay = FETCH_ALL_BACKOFF
        for attempt in range(FETCH_ALL_PASSES):
            if attempt:
                log.info("fetch-all: %d chunks failed; pass %d in %g s", len(todo),
                         attempt + 1, delay)
                await trio.sleep(delay)
                delay *= 2
            self.all_passes += 1
            self.all_done = self.all_total - len(todo)
            self.all_missing = 0
            await self._prefetch(todo, self._all_window_done)
            todo = [loc for loc in todo if not self.fetcher.cache.contains(loc.digest)]
            if not todo:
                log.info("fetch-all: all %d chunks cached", self.all_total)
                return
        log.warning("fetch-all: %d chunks could not be fetched; reads of them still need "
                    "the store", len(todo))

    def _all_window_done(self, window: Sequence[ChunkLoc], missing: int) -> None:
        self.all_done += len(window) - missing
        self.all_missing += missing

    def _warn_if_too_big(self, todo: Sequence[ChunkLoc]) -> None:
        total = sum(c.ulen for c in todo) + sum(c.ulen for c in self.hinted)
        if total > self.fetcher.cache.max_bytes:
            log.warning("fetch-all: the environment (%d bytes) exceeds the cache bound (%d "
                        "bytes); a store outage may still fail reads", total,
                        self.fetcher.cache.max_bytes)

    async def _prefetch(
        self, locs: Sequence[ChunkLoc], done: Callable[[Sequence[ChunkLoc], int], None]
    ) -> None:
        """Hand `locs` to the fetcher in windows, in order (see the module doc);
        `done(window, chunks still missing)` after each."""
        cache = self.fetcher.cache

        def window_done(window: Sequence[ChunkLoc]) -> None:
            done(window, sum(1 for loc in window if not cache.contains(loc.digest)))

        await self.fetcher.prefetch_windows(
            windows(locs, self.window_bytes, self.first_window_bytes), window_done,
            self.request_bytes)

    def progress(self) -> dict[str, Any]:
        """What `weenv stats` shows under `hints`: the hint, replay progress, waste (hinted
        chunks prefetched that no read has used so far, computed now)."""
        found = self.found
        out: dict[str, Any] = {
            "state": self.state,
            "hint": None if found is None else found.digest,
            "source": None if found is None else found.source,
            "partial": found is not None and found.partial,
            "chunks": len(self.hinted),
            "bytes": sum(c.ulen for c in self.hinted),
            "chunks_done": self.hint_done,
            "chunks_missing": self.hint_missing,
            "replay_s": self.hint_seconds,
            "waste": self.fetcher.stats.unused_prefetched(self._digests),
            "replayer": "mount daemon",
        }
        if self.fetch_all:
            out["fetch_all"] = {
                "chunks": self.all_total,
                "done": self.all_done,
                "missing": self.all_missing,
                "passes": self.all_passes,
            }
        return out
