"""The fetcher: gets chunks into the node cache and serves chunk bytes to readers (trio).

Owns: what to fetch and who waits for it: the cache lookups of a read, one fetch per chunk
however many readers wait (in this process: flights; across processes: the cache's chunk
locks), the ranged requests chunk_plan.py groups (adjacent chunks of one blob in one request,
small gaps read through), priorities (demand before prefetch; read-ahead and prefetch
workers), the overall deadline, cache maintenance, and error reporting once per chunk. One
request itself (its slot, timeout, retries, verification, decoding, caching) is
range_fetch.py's. Must not: know files, inodes or FUSE (the reader maps file offsets to
`ChunkLoc`s), or touch cache files directly (see cache.py).

Trio discipline: code between two `await`s is atomic, which is what keeps `_flights` (digest
-> the in-process fetch that owns it) consistent without locks. Calls sent to threads: every
store call (abandoned at its timeout, so a stuck call never holds up a read); the cache's
blocking lock wait (abandoned at the deadline, releasing the lock if it is acquired later);
decoding, verifying and caching ranges above `INLINE_CODEC_BYTES` and first-use verification
of big cached chunks. Everything smaller runs inline: a thread hop costs more than the work.

Errors: a read raises `ChunkCorrupt` when a chunk fails verification twice (the second fetch
rules out a bad response body), and `ChunkUnavailable` on a permanent store error, when
retries run out, or at the deadline. The fetcher logs each failing chunk once (ERROR for
corrupt, WARNING for unavailable); callers should not log these again above DEBUG.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import trio

from weenvfs.core.cache import HASHES, MISSING, ChunkCache, ChunkHandle
from weenvfs.core.chunk_locks import ChunkLock
from weenvfs.core.chunk_plan import (
    DEFAULT_COALESCE_GAP,
    DEFAULT_MAX_REQUEST_BYTES,
    ChunkLoc,
    Span,
    plan_requests,
)
from weenvfs.core.fetch_slots import DemandLimiter, NoLock
from weenvfs.core.frame_stash import STASH_TTL, FrameBytes, FrameStash
from weenvfs.core.range_fetch import (
    INLINE_CODEC_BYTES,
    PREFETCH_RETRY,
    READ_AHEAD,
    Outcome,
    Priority,
    RangeFetcher,
)
from weenvfs.core.stats import Stats
from weenvfs.errors import (
    ChunkCorrupt,
    ChunkUnavailable,
)
from weenvfs.store.base import Store
from weenvfs.store.retry import RetryPolicy

log = logging.getLogger(__name__)

MAX_BACKGROUND_PREFETCH = 64  # read-ahead batches queued or running at once
# Requests in flight at once for sequential readers' read-ahead (`schedule_prefetch(stream=
# True)`), which, unlike other prefetch, does not wait for demand reads to go idle.
STREAM_CONCURRENCY = 4
STREAM_REQUEST_BYTES = 4 << 20  # a stream's batch cut into requests of at most this
# Neighbourhood requests in flight at once (core/frame_stash.py), and how they are cut: holes
# of cached or in-flight chunks up to NEAR_GAP are read through, no request beyond NEAR_BYTES.
NEAR_CONCURRENCY = 4
NEAR_GAP = 1 << 20
NEAR_BYTES = 16 << 20
# A neighbourhood that fails is not retried: the readers that wanted it fetch for themselves.
NEAR_RETRY = RetryPolicy(max_attempts=1)
# How far around a miss to reach: as far as the store sends in NEAR_SECONDS at the rate it
# sent the last neighbourhoods (loopback: the neighbours.py bound; a slow link: less, so that
# neighbourhoods do not take the bandwidth demand reads need), never under NEAR_MIN_REACH,
# where it starts (a 100 Mbit/s link measured 30% slower starting at 2 MiB).
NEAR_SECONDS = 0.05
NEAR_MIN_REACH = 256 << 10
# A chunk a neighbourhood brought asks for its own only from this share of that response at
# either end (`_widen`): where a reader walking on through the blob leaves what was fetched.
WIDEN_FROM_SHARE = 0.25
# Verified cached chunks `read_cached` keeps open between reads: a kernel reading a file
# page by page asks for the same chunk many times, and an open, fstat and close per request
# was a third of the daemon's time on a cached read. Held files are not pinned (the cache's
# bound may evict them); one found evicted is closed and read the slow way.
HELD_HANDLES = 64

@dataclass(eq=False)
class _Flight:
    """One in-process fetch of a chunk that other readers may wait for."""

    priority: Priority
    event: trio.Event
    plain: bytes | None = None
    error: ChunkUnavailable | None = None


@dataclass(eq=False)
class _Window:
    """A window of `Fetcher.prefetch_windows` and how many of its requests have not ended."""

    chunks: Sequence[ChunkLoc]
    running: int


class Fetcher:
    """Serves chunk bytes from the node cache, fetching what is missing from `store`."""

    def __init__(
        self,
        store: Store,
        cache: ChunkCache,
        stats: Stats | None = None,
        *,
        demand_concurrency: int = 8,
        prefetch_concurrency: int = 2,
        deadline: float = 30.0,
        request_timeout: float = 10.0,
        coalesce_gap: int = DEFAULT_COALESCE_GAP,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        retry: RetryPolicy | None = None,
        prefetch_retry: RetryPolicy = PREFETCH_RETRY,
    ) -> None:
        self.store = store
        self.cache = cache
        self.stats = stats if stats is not None else Stats()
        self.deadline = deadline
        self.coalesce_gap = coalesce_gap
        self.max_request_bytes = max_request_bytes
        self._demand = DemandLimiter(demand_concurrency)
        self._prefetch_workers = prefetch_concurrency
        self._ranges = RangeFetcher(
            store, cache, self.stats, request_timeout=request_timeout,
            retry={Priority.DEMAND: retry or RetryPolicy(), Priority.STREAM: prefetch_retry,
                   Priority.PREFETCH: prefetch_retry, Priority.NEIGHBOURS: NEAR_RETRY},
            demand=self._demand, prefetch=trio.CapacityLimiter(prefetch_concurrency),
            stream=trio.CapacityLimiter(STREAM_CONCURRENCY),
            near=trio.CapacityLimiter(NEAR_CONCURRENCY),
            cache_error=self._cache_error, after_insert=self._schedule_maintenance,
        )
        self._flights: dict[bytes, _Flight] = {}
        self._reported: set[bytes] = set()
        self._cache_errors: set[int] = set()
        self._nursery: trio.Nursery | None = None
        self._background = 0
        # Chunks stored next to one a reader waited for (core/neighbours.py); fetched in the
        # background at once, as a cold reader with no hint is likely to want them next, and
        # kept undecoded until one is read (core/frame_stash.py).
        self.neighbours: Callable[[ChunkLoc, int], Sequence[ChunkLoc]] | None = None
        self._stash = FrameStash(stats=self.stats)
        # Told of every neighbourhood that arrives (blob digest, start, compressed bytes): the
        # native device server serves misses from them too (fuse/native_devices.py). What it
        # returns, if anything, holds the same bytes and is kept instead of them (the memory
        # both share; a copy that differs only fails verification, never serves).
        self.on_stashed: Callable[[str, int, bytes], FrameBytes | None] | None = None
        self._near_tasks = 0
        self.near_reach = NEAR_MIN_REACH
        self._maintaining = False
        self._closed = False
        self._held: OrderedDict[bytes, ChunkHandle] = OrderedDict()

    # -- public API ---------------------------------------------------------------------------

    async def read(self, spans: Sequence[Span]) -> bytes:
        """Bytes [start, end) of each span's chunk plaintext, concatenated.

        Fetches missing chunks (demand priority), verifies and caches them, and waits at most
        `deadline` seconds. Raises ChunkCorrupt / ChunkUnavailable; never returns unverified
        bytes. All-zero chunks cost no I/O.
        """
        if self._closed:
            raise RuntimeError("Fetcher is closed")
        self.stats.reads += 1
        out: dict[bytes, Outcome] = {}
        started = time.monotonic()
        waited = True  # until _load says otherwise (a deadline cancels it while waiting)
        try:
            with trio.move_on_after(self.deadline):
                if len(spans) != 1 or not await self._load_stashed(spans[0][0], out):
                    waited = await self._load([s[0] for s in spans], Priority.DEMAND, out,
                                              count=True)
            if waited:
                self.stats.read_waits.add(time.monotonic() - started)
            data = self._assemble(spans, out)
        finally:
            for value in out.values():
                if isinstance(value, ChunkHandle):
                    value.close()
        self.stats.bytes_served += len(data)
        return data

    def read_cached(self, spans: Sequence[Span]) -> bytes | None:
        """What `read(spans)` returns, at once, when every chunk of `spans` is cached and was
        verified by this process already; None when one is not (then `await read(spans)`).

        The common request of a warm reader, served without a task, a cancel scope or a file
        opened per request (the kernel path sends one per page range of a file). Counted in
        `stats` exactly as `read` counts a read that found everything cached.
        """
        if self._closed:
            raise RuntimeError("Fetcher is closed")
        handles: dict[bytes, Outcome] = {}
        for loc, start, end in spans:
            if loc.blob is None or end <= start or loc.digest in handles:
                continue
            handle = self._held_handle(loc)
            if handle is None:
                self._trim_held()
                return None
            handles[loc.digest] = handle
        self.stats.reads += 1
        for loc in {loc.digest: loc for loc, _, _ in spans if loc.digest in handles}.values():
            self._count_lookup(loc, True)
        try:
            data = self._assemble(spans, handles)
        finally:
            self._trim_held()  # after the read, which may use more than HELD_HANDLES
        self.stats.bytes_served += len(data)
        return data

    def verified_file(self, loc: ChunkLoc) -> int | None:
        """A new descriptor (the caller's to close) of `loc`'s cached file if it is cached
        and verified in this process, else None: for a server of cached reads outside this
        process (fuse/native_devices.py), which must serve nothing this process did not
        verify."""
        handle = self._held_handle(loc)
        if handle is None:
            return None
        try:
            return os.dup(handle.fileno())
        finally:
            self._trim_held()

    def _held_handle(self, loc: ChunkLoc) -> ChunkHandle | None:
        """An open handle on `loc` if it is cached and verified in this process, kept open
        for the next read (`read_cached` closes the least recently used beyond HELD_HANDLES
        once its read is done)."""
        handle = self._held.get(loc.digest)
        if handle is not None:
            if handle.linked():
                self._held.move_to_end(loc.digest)
                return handle
            del self._held[loc.digest]  # evicted: free its disk space, fetch it again
            handle.close()
        if not self.cache.is_verified(loc.digest):
            return None
        handle = self.cache.open(loc.digest, loc.ulen, pin=False)  # verified: no data read
        if handle is None:
            return None
        self._held[loc.digest] = handle
        return handle

    def _trim_held(self) -> None:
        while len(self._held) > HELD_HANDLES:
            self._held.popitem(last=False)[1].close()

    async def prefetch(self, locs: Sequence[ChunkLoc]) -> None:
        """Bring `locs` into the cache at low priority: at most `prefetch_concurrency`
        requests, none issued while demand reads are queued, fewer retries. Chunks already
        cached or being fetched are skipped; failures are counted, never raised."""
        await self.prefetch_windows([locs])

    async def prefetch_windows(
        self, windows: Iterable[Sequence[ChunkLoc]],
        done: Callable[[Sequence[ChunkLoc]], None] | None = None,
        request_bytes: int | None = None,
        priority: Priority = Priority.PREFETCH,
    ) -> None:
        """`prefetch` of several windows in their order, with no pause at a window's end:
        each window is cut into ranged requests of at most `request_bytes` on its own (sorted
        by place within it, so a window bounds how far a request reorders), and the
        `prefetch_concurrency` workers take the requests of every window one after the other.
        `done(window)` once each request of that window has ended. `Priority.STREAM`: a
        sequential reader's read-ahead, with STREAM_CONCURRENCY workers, not held back while
        demand reads wait."""
        limit = request_bytes or self.max_request_bytes
        queue: deque[tuple[list[ChunkLoc], _Window]] = deque()
        for chunks in windows:
            todo = [c for c in chunks if c.blob is not None and not self.cache.contains(c.digest)]
            runs = plan_requests(todo, self.coalesce_gap, limit)
            window = _Window(chunks, len(runs))
            queue.extend((run, window) for run in runs)
            if not runs and done is not None:
                done(chunks)

        def ended(window: _Window) -> None:
            window.running -= 1
            if not window.running and done is not None:
                done(window.chunks)

        workers = STREAM_CONCURRENCY if priority == Priority.STREAM else self._prefetch_workers
        async with trio.open_nursery() as nursery:
            for _ in range(min(workers, len(queue))):
                nursery.start_soon(self._prefetch_worker, queue, ended, priority)

    def schedule_prefetch(self, locs: Sequence[ChunkLoc], *, stream: bool = False) -> bool:
        """Start `prefetch(locs)` in the background (read-ahead) and return at once; `stream`:
        at `Priority.STREAM` (a sequential reader's next chunks), not held back by demand.

        Needs `serve()` running; returns False (and counts a drop) when it is not, or when
        MAX_BACKGROUND_PREFETCH batches are already queued. Chunks already cached cost no
        task: the kernel is asked to read their files into memory in the background instead,
        so that a reader streaming a cached file does not wait for the disk chunk by chunk.
        """
        locs = [c for c in locs if c.blob is not None and not self.cache.advise(c.digest)]
        if not locs:
            return True
        if self._nursery is None or self._background >= MAX_BACKGROUND_PREFETCH:
            self.stats.prefetch_dropped += 1
            return False
        self._background += 1
        self._nursery.start_soon(self._background_prefetch, list(locs),
                                 Priority.STREAM if stream else Priority.PREFETCH)
        return True

    def advise(self, locs: Sequence[ChunkLoc]) -> None:
        """Ask the kernel to read the cached files of `locs` into memory in the background;
        chunks not cached are left alone (`schedule_prefetch` fetches from the store)."""
        for loc in locs:
            if loc.blob is not None:
                self.cache.advise(loc.digest)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run background work (read-ahead, cache eviction) until cancelled. Use
        `await nursery.start(fetcher.serve)`; without it, eviction runs inline after fetches."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:  # drop neighbourhoods nobody read (their memory) now and then
                    await trio.sleep(STASH_TTL / 2)
                    self._stash.sweep()
            finally:
                self._nursery = None

    def close(self) -> None:
        """Refuse further reads and close the held chunk files. The store and the cache
        belong to the caller."""
        self._closed = True
        while self._held:
            self._held.popitem()[1].close()

    def _widen(self, claimed: Sequence[ChunkLoc]) -> None:
        """Fetch the neighbourhoods of chunks a demand read is about to wait for: of each one
        no neighbourhood brings, and of one a neighbourhood brought only when it lies in the
        outer quarters of that response, so that a reader walking on through the blob finds
        the next stretch on its way. From the middle of a response a neighbourhood asks for
        little but its edges, a request each: on the reference workload 25 of 57
        neighbourhood requests, for no fewer waits (docs/design-notes.md)."""
        if self.neighbours is None:
            return
        missed = [loc for loc in claimed if not self._stash.covers(loc.digest)
                  or self._stash.at_edge(loc.digest, WIDEN_FROM_SHARE)]
        if missed:
            self._fetch_neighbours(missed)

    def _fetch_neighbours(self, missed: Sequence[ChunkLoc]) -> None:
        """Start fetching, undecoded, the neighbourhoods of the chunks a demand read is about
        to wait for (not chunks cached, in flight or already stashed or on their way)."""
        assert self.neighbours is not None
        if self._nursery is None:
            return  # no background: the read itself is all a caller without serve() gets
        near = {n.digest: n for loc in missed for n in self.neighbours(loc, self.near_reach)
                if n.digest not in self._flights and not self._stash.covers(n.digest)}
        todo = [n for n in near.values() if not self.cache.contains(n.digest)]
        for run in plan_requests(todo, NEAR_GAP, NEAR_BYTES):
            if self._near_tasks >= MAX_BACKGROUND_PREFETCH:
                self.stats.prefetch_dropped += 1
                return
            self._near_tasks += 1
            self._nursery.start_soon(self._stash_run, run, self._stash.begin(run))

    async def _stash_run(self, run: list[ChunkLoc], event: trio.Event) -> None:
        data = None
        started = trio.current_time()
        try:
            data = await self._ranges.fetch_neighbourhood(run)
            if data is not None:
                self._time_neighbourhood(len(data), trio.current_time() - started)
        finally:  # also when cancelled: nobody may wait on `event` forever
            self._near_tasks -= 1
            if data is None:
                self._stash.fail(run, event)
            else:
                shared = None
                if self.on_stashed is not None and run[0].blob is not None:
                    shared = self.on_stashed(run[0].blob, run[0].offset, data)
                self._stash.land(run, event, data if shared is None else shared, run[0].offset)

    def _time_neighbourhood(self, nbytes: int, seconds: float) -> None:
        """Set the reach from the rate of a neighbourhood that just arrived (half of the
        window on each side of the miss): down to it at once, up half way (one fast
        response says less about the link than one slow one)."""
        if nbytes < NEAR_MIN_REACH:
            return  # too small to time a link by: latency, not bandwidth
        reach = int(nbytes / max(seconds, 1e-4) * NEAR_SECONDS / 2)
        if reach > self.near_reach:
            reach = (self.near_reach + reach) // 2
        self.near_reach = max(NEAR_MIN_REACH, reach)

    async def _from_stash(self, loc: ChunkLoc, priority: Priority,
                          out: dict[bytes, Outcome]) -> None:
        """Serve `loc` from a neighbourhood fetched earlier (waiting for it if it is on its
        way), verified as any fetched frame; from the store if it is not there or is bad."""
        frame = await self._stash.take(loc)
        if frame is not None:
            if await self._ranges.decode_frame(loc, frame, priority, out):
                self.stats.neighbour_hits += 1
                return
            self.stats.retries += 1  # a bad body: the store's own copy decides
        await self._ranges.fetch_run([loc], priority, out)

    # -- loading: cache, in-process flights, cross-process locks --------------------------------

    async def _load(
        self,
        locs: Sequence[ChunkLoc],
        priority: Priority,
        out: dict[bytes, Outcome],
        count: bool = False,
    ) -> bool:
        """Fill `out[digest]` for every non-zero chunk of `locs` with a handle, the plaintext
        or the error that prevents serving it; whether that meant waiting for a fetch."""
        claims: list[tuple[ChunkLoc, _Flight]] = []
        waits: list[tuple[ChunkLoc, _Flight]] = []
        for loc in {c.digest: c for c in locs if c.blob is not None}.values():
            if loc.digest in out:
                continue
            handle = await self._open_cached(loc)
            if count:
                self._count_lookup(loc, handle is not None)
            if handle is not None:
                out[loc.digest] = handle
            elif loc.digest in self._flights:
                waits.append((loc, self._flights[loc.digest]))
            else:
                claims.append(self._claim(loc, priority))
        if count and claims:
            self._widen([loc for loc, _flight in claims])
        if not claims and not waits:
            return False
        try:
            async with trio.open_nursery() as nursery:
                if claims:
                    nursery.start_soon(self._fetch_claimed, claims, priority, out)
                for loc, flight in waits:
                    nursery.start_soon(self._await_flight, loc, flight, priority, out)
        finally:
            self._settle(claims, out)  # a no-op unless the fetch task never got to run
        return True

    async def _load_stashed(self, loc: ChunkLoc, out: dict[bytes, Outcome]) -> bool:
        """Serve a demand miss whose frame a neighbourhood already brought, the commonest miss
        of a cold start with no hint (~150 of ~180 on the reference workload), without the
        tasks of `_load`: claim it, take its cross-process lock, then decode, verify and cache
        it in one thread hop (`_from_stash`, which falls back to the store for a bad frame).
        With `_widen`, ~5% off the README's first run (docs/design-notes.md). False, having
        done nothing, for any other chunk (cached, in flight, not stashed, locked elsewhere)."""
        if (loc.blob is None or loc.digest in self._flights or not self._stash.holds(loc.digest)
                or self.cache.open_cost(loc.digest) != MISSING):
            return False
        lock = self._try_lock(loc)
        if lock is None:
            return False  # another process fetches it: `_load` waits for its lock
        self._count_lookup(loc, False)
        claim = self._claim(loc, Priority.DEMAND)
        try:
            self._widen([loc])
            await self._from_stash(loc, Priority.DEMAND, out)
        finally:
            self._settle([claim], out)
            lock.release()
        return True

    def note_fetched_elsewhere(self, loc: ChunkLoc, clen: int, seconds: float) -> None:
        """Count a demand miss another program of this mount served (the native device
        server fetched `loc`'s frame of `clen` bytes from a local blob file or a neighbourhood
        this fetcher brought, verified and cached it in `seconds`) as if this fetcher had:
        stats, the cache's size bound, and a stashed frame taken (with the next neighbourhood
        asked for when it lay near the edge of its own, as `_widen` does)."""
        edge = self._stash.at_edge(loc.digest, WIDEN_FROM_SHARE)
        if self._stash.discard(loc.digest):
            self.stats.neighbour_hits += 1
            if edge and self.neighbours is not None:
                self._fetch_neighbours([loc])
        self.stats.cache_misses += 1
        self.stats.requests += 1
        self.stats.record_request(clen, seconds)
        self.stats.chunks_fetched += 1
        self.stats.bytes_decompressed += loc.ulen
        self.stats.read_waits.add(seconds)
        self.cache.note_inserted(loc.ulen)
        if (not self._closed and not self._maintaining and self._nursery is not None
                and self.cache.needs_maintenance()):
            self._nursery.start_soon(self._schedule_maintenance)

    def _claim(self, loc: ChunkLoc, priority: Priority) -> tuple[ChunkLoc, _Flight]:
        """Make this task the in-process fetcher of `loc` (the caller checked nobody is)."""
        flight = self._flights[loc.digest] = _Flight(priority, trio.Event())
        return loc, flight

    def _settle(self, claims: list[tuple[ChunkLoc, _Flight]], out: dict[bytes, Outcome]) -> None:
        """Publish the outcome of claimed fetches and wake their waiters (idempotent)."""
        for loc, flight in claims:
            if self._flights.get(loc.digest) is flight:
                del self._flights[loc.digest]
            if not flight.event.is_set():
                value = out.get(loc.digest)
                flight.plain = value if isinstance(value, bytes) else None
                flight.error = value if isinstance(value, ChunkUnavailable) else None
                flight.event.set()

    def _count_lookup(self, loc: ChunkLoc, hit: bool) -> None:
        if hit:
            self.stats.cache_hits += 1
            self.stats.record_demand_use(loc.digest)
        else:
            self.stats.cache_misses += 1

    async def _open_cached(self, loc: ChunkLoc) -> ChunkHandle | None:
        # Opening reads and hashes the chunk only if nobody verified it in this boot: only
        # then is it worth a thread (a hop costs more than a trusted open). A chunk that is
        # not cached at all, every miss of a cold start (twice: before and after its lock),
        # must not pay one either (~0.3 ms each on the reference workload's 178 misses).
        if loc.ulen > INLINE_CODEC_BYTES:
            cost = self.cache.open_cost(loc.digest)
            if cost == MISSING:
                return None
            if cost == HASHES:
                return await trio.to_thread.run_sync(self.cache.open, loc.digest, loc.ulen)
        return self.cache.open(loc.digest, loc.ulen)

    async def _await_flight(
        self, loc: ChunkLoc, flight: _Flight, priority: Priority, out: dict[bytes, Outcome]
    ) -> None:
        """Wait for another task's fetch of `loc`; take its result, or try again ourselves
        if it was cancelled or was a prefetch that gave up."""
        await flight.event.wait()
        if flight.plain is not None:
            out[loc.digest] = flight.plain
            if priority == Priority.DEMAND and flight.priority in READ_AHEAD:
                self.stats.record_demand_use(loc.digest)  # prefetch got there first: a hit
        elif flight.error is not None and (
            isinstance(flight.error, ChunkCorrupt) or flight.priority <= priority
        ):
            out[loc.digest] = flight.error
        else:
            await self._load([loc], priority, out)

    async def _fetch_claimed(
        self,
        claims: list[tuple[ChunkLoc, _Flight]],
        priority: Priority,
        out: dict[bytes, Outcome],
    ) -> None:
        """Fetch chunks this task claimed in-process, sharing the work with other processes
        through the cache's chunk locks; settle the claims whatever happens."""
        try:
            held, contended = [], []
            for loc, _flight in claims:
                lock = self._try_lock(loc)
                if lock is not None:
                    held.append((loc, lock))
                else:
                    contended.append(loc)
            async with trio.open_nursery() as nursery:
                if held:
                    nursery.start_soon(self._fetch_locked, held, priority, out)
                if priority == Priority.DEMAND:  # prefetch leaves them to the other process
                    for loc in contended:
                        nursery.start_soon(self._fetch_after_wait, loc, priority, out)
        finally:
            self._settle(claims, out)

    def _try_lock(self, loc: ChunkLoc) -> ChunkLock | NoLock | None:
        """The chunk's cross-process lock, None if another process holds it; a cache that
        cannot lock (full disk, permissions) costs cross-process sharing, not the read."""
        try:
            return self.cache.try_lock(loc.digest)
        except OSError as e:
            self._cache_error("cannot lock in the chunk cache", e)
            return NoLock()

    async def _fetch_locked(
        self,
        held: list[tuple[ChunkLoc, ChunkLock | NoLock]],
        priority: Priority,
        out: dict[bytes, Outcome],
    ) -> None:
        """Fetch chunks whose cross-process locks we hold (re-checking the cache first: another
        process may have stored them since we looked), then release the locks."""
        try:
            todo = []
            for loc, _lock in held:
                handle = await self._open_cached(loc)
                if handle is not None:
                    self._stored_elsewhere(loc, priority)
                    out[loc.digest] = handle
                else:
                    todo.append(loc)
            stashed: list[ChunkLoc] = []
            asked: list[ChunkLoc] = []
            for loc in todo:
                (stashed if self._stash.covers(loc.digest) else asked).append(loc)
            runs = plan_requests(asked, self.coalesce_gap, self.max_request_bytes)
            locks = {loc.digest: lock for loc, lock in held}

            def cached(loc: ChunkLoc) -> None:
                # Another process waiting for this chunk finds it in the cache now.
                locks[loc.digest].release()

            async with trio.open_nursery() as nursery:
                for loc in stashed:
                    nursery.start_soon(self._from_stash, loc, priority, out)
                for run in runs:
                    nursery.start_soon(self._ranges.fetch_run, run, priority, out, cached)
        finally:
            for _loc, lock in held:
                lock.release()

    async def _fetch_after_wait(
        self, loc: ChunkLoc, priority: Priority, out: dict[bytes, Outcome]
    ) -> None:
        """Another process is fetching `loc`: wait for its lock (holding nothing else, so no
        deadlock), then use its result, or fetch it ourselves if it failed."""
        lock: ChunkLock | NoLock
        try:
            lock = await self.cache.lock_async(loc.digest)
        except OSError as e:
            self._cache_error("cannot lock in the chunk cache", e)
            lock = NoLock()
        try:
            handle = await self._open_cached(loc)
            if handle is not None:
                self.stats.waited_for_other += 1
                self._stored_elsewhere(loc, priority)
                out[loc.digest] = handle
            else:
                await self._ranges.fetch_run([loc], priority, out)
        finally:
            lock.release()

    def _stored_elsewhere(self, loc: ChunkLoc, priority: Priority) -> None:
        """`loc` missed, and another process cached it meanwhile: a demand read that uses it
        used that process's fetch. When the other process is this mount's hint replay, that
        is a hint hit once the replay's report names the chunk, not waste."""
        if priority == Priority.DEMAND:
            self.stats.record_demand_use(loc.digest)

    # -- prefetch -----------------------------------------------------------------------------

    async def _prefetch_worker(
        self, queue: deque[tuple[list[ChunkLoc], _Window]], ended: Callable[[_Window], None],
        priority: Priority,
    ) -> None:
        """Take runs one by one; claim their chunks only when about to fetch them, so a demand
        read never waits behind a prefetch that has not started yet. `ended(window)` after
        each run."""
        while queue:
            run, window = queue.popleft()
            try:
                await self._prefetch_run(run, priority)
            finally:
                ended(window)

    async def _prefetch_run(self, run: list[ChunkLoc], priority: Priority) -> None:
        if priority == Priority.PREFETCH:
            await self._demand.wait_idle()
        claims = [
            self._claim(loc, priority)
            for loc in run
            if loc.digest not in self._flights and not self.cache.contains(loc.digest)
        ]
        if not claims:
            return
        out: dict[bytes, Outcome] = {}
        try:
            await self._fetch_claimed(claims, priority, out)
        finally:
            self._settle(claims, out)
            for value in out.values():
                if isinstance(value, ChunkHandle):
                    value.close()
                elif isinstance(value, ChunkUnavailable):
                    log.debug("prefetch of %s failed: %s", value.digest[:12], value.reason)

    async def _background_prefetch(self, locs: list[ChunkLoc], priority: Priority) -> None:
        try:
            await self.prefetch_windows(
                [locs], priority=priority,
                request_bytes=STREAM_REQUEST_BYTES if priority == Priority.STREAM else None)
        except Exception as e:  # read-ahead must never take the serving nursery down
            log.warning("read-ahead of %d chunk(s) failed: %s", len(locs), e)
        finally:
            self._background -= 1

    # -- results, errors, maintenance ----------------------------------------------------------

    def _assemble(self, spans: Sequence[Span], out: dict[bytes, Outcome]) -> bytes:
        parts = []
        for loc, start, end in spans:
            if end <= start:
                continue
            if loc.blob is None:
                self.stats.zero_chunks += 1
                parts.append(bytes(end - start))
                continue
            value = out.get(loc.digest)
            if value is None:
                self.stats.record_error("deadline")
                value = ChunkUnavailable(
                    loc.digest.hex(), f"not fetched within the {self.deadline:g} s deadline"
                )
            if isinstance(value, ChunkUnavailable):
                self._report(value)
                raise type(value)(value.digest, value.reason)
            parts.append(
                value.read(start, end) if isinstance(value, ChunkHandle) else value[start:end]
            )
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _report(self, err: ChunkUnavailable) -> None:
        """Log a failing chunk the first time it fails in this process."""
        digest = bytes.fromhex(err.digest)
        if digest in self._reported:
            return
        self._reported.add(digest)
        if isinstance(err, ChunkCorrupt):
            log.error("%s", err)
        else:
            log.warning("%s", err)

    def _cache_error(self, what: str, err: OSError) -> None:
        self.stats.record_error("cache")
        if err.errno not in self._cache_errors:
            self._cache_errors.add(err.errno or 0)
            log.warning("%s %s: %s", what, self.cache.root, err.strerror or err)

    async def _schedule_maintenance(self) -> None:
        if self._maintaining or not self.cache.needs_maintenance():
            return
        self._maintaining = True
        if self._nursery is not None:
            self._nursery.start_soon(self._maintain)
        else:
            await self._maintain()

    async def _maintain(self) -> None:
        # Loop: inserts that arrive while evicting were not scheduled (the flag was set), so
        # re-check before letting go, or the cache could stay over its bound after the last
        # fetch. Stop when a pass frees nothing: only pinned chunks are left over the bound.
        try:
            while self.cache.needs_maintenance():
                result = await trio.to_thread.run_sync(self.cache.maintain)
                if result is None or not result.removed_chunks:
                    break  # under the bound, another process evicts, or only pins are left
        except OSError as e:
            self._cache_error("cannot evict from the chunk cache", e)
        finally:
            self._maintaining = False
