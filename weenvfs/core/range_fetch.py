"""One ranged request for a run of chunks of one blob: the GET with its slot, timeout and
retries, then each chunk decoded, verified and cached.

Owns: the slot a request waits for (demand or prefetch, fetch_slots.py; a prefetch request
also waits until no demand read is queued), the request timeout and the retry policy of each
priority, verification before anything is cached or handed out (a chunk that fails is
fetched once more on its own: the second fetch rules out a bad response body, then it is
corrupt), decoding inline or in a thread (`INLINE_CODEC_BYTES`), and caching with one retry
after making room on a full disk (a chunk that still cannot be cached is served from memory).

Must not: decide what to fetch, track which chunks are in flight or wake who waits for them
(fetcher.py), or know files.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from enum import IntEnum

import trio

from weenvfs.errors import (
    ChunkCorrupt,
    ChunkUnavailable,
    ObjectMissing,
    StoreError,
    StoreUnavailable,
)
from weenvfs.format.chunk import decode_chunk
from weenvfs.format.errors import FormatError
from weenvfs.format.refs import object_key
from weenvfs.store.base import Store
from weenvfs.store.retry import RetryPolicy

from .cache import DISK_FULL, ChunkCache, ChunkHandle
from .chunk_plan import ChunkLoc
from .fetch_slots import DemandLimiter, Handoff
from .stats import Stats

log = logging.getLogger(__name__)

# Above this many plaintext bytes, decoding/verifying/caching runs in a thread. Below it the
# loop stalls for well under a millisecond; benchmarks/ is where to tune it.
INLINE_CODEC_BYTES = 128 << 10
# Prefetch gives up sooner than demand (nydus: prefetch 1 retry, on-demand 3).
PREFETCH_RETRY = RetryPolicy(max_attempts=2, base_delay=0.2, max_delay=1.0, max_elapsed=5.0)


class Priority(IntEnum):
    DEMAND = 0
    # Read-ahead of a sequential reader (core/reader.py): what its next demand reads will be,
    # so never held back while demand waits (that made a long read one GET at a time).
    STREAM = 1
    PREFETCH = 2
    NEIGHBOURS = 3  # a miss's neighbourhood, fetched undecoded (core/frame_stash.py)


READ_AHEAD = (Priority.STREAM, Priority.PREFETCH)  # counted as prefetch in the stats


Outcome = ChunkHandle | bytes | ChunkUnavailable
# Told each chunk as soon as it is cached (or could not be: it is then served from memory);
# may be called in a worker thread.
OnCached = Callable[[ChunkLoc], None]


class RangeFetcher:
    """Ranged requests against `store` into `cache`, counted in `stats`."""

    def __init__(
        self,
        store: Store,
        cache: ChunkCache,
        stats: Stats,
        *,
        request_timeout: float,
        retry: dict[Priority, RetryPolicy],
        demand: DemandLimiter,
        prefetch: trio.CapacityLimiter,
        stream: trio.CapacityLimiter,
        near: trio.CapacityLimiter,
        cache_error: Callable[[str, OSError], None],
        after_insert: Callable[[], Awaitable[None]],
    ) -> None:
        self.store = store
        self.cache = cache
        self.stats = stats
        self.request_timeout = request_timeout
        self._retry = retry
        self._demand = demand
        self._prefetch = prefetch
        self._stream = stream
        self._near = near
        self._cache_error = cache_error
        self._after_insert = after_insert  # the fetcher's cache maintenance

    async def fetch_run(
        self, run: list[ChunkLoc], priority: Priority, out: dict[bytes, Outcome],
        cached: OnCached | None = None,
    ) -> None:
        """Fetch one coalesced range, verify and cache each chunk; a chunk that fails
        verification is fetched once more on its own before it is declared corrupt.
        `cached(loc)` is called as each chunk is in the cache (see `_decode_sync`)."""
        start = run[0].offset
        end = max(c.offset + c.clen for c in run)
        try:
            data = await self._get_range(run[0].blob, start, end - start, priority)
        except _RangeFailed as e:
            for loc in run:
                out[loc.digest] = ChunkUnavailable(loc.digest.hex(), e.reason)
            return
        for loc, err in await self._decode_and_store(run, data, start, priority, out, cached):
            log.debug(
                "chunk %s failed verification (%s); fetching it again", loc.digest.hex()[:12], err
            )
            self.stats.retries += 1
            try:
                frame = await self._get_range(loc.blob, loc.offset, loc.clen, priority)
            except _RangeFailed as e:
                out[loc.digest] = ChunkUnavailable(loc.digest.hex(), e.reason)
                continue
            for _loc, err2 in await self._decode_and_store([loc], frame, loc.offset, priority, out,
                                                           cached):
                self.stats.record_error("corrupt")
                out[loc.digest] = ChunkCorrupt(loc.digest.hex(), f"{err2} (fetched twice)")

    async def fetch_neighbourhood(self, run: list[ChunkLoc]) -> bytes | None:
        """The blob bytes holding `run`'s frames, undecoded and unverified (the caller keeps
        them until a reader asks, then `decode_frame` verifies), or None when the store did
        not give them (a reader then fetches its chunk itself). Its own slots, not demand's:
        it runs beside the demand read whose miss asked for it, not after."""
        start = run[0].offset
        end = max(c.offset + c.clen for c in run)
        try:
            return await self._get_range(run[0].blob, start, end - start, Priority.NEIGHBOURS)
        except _RangeFailed as e:
            log.debug("neighbourhood %s+%d failed: %s", run[0].blob, start, e.reason)
            return None

    async def decode_frame(
        self, loc: ChunkLoc, frame: bytes | memoryview, priority: Priority,
        out: dict[bytes, Outcome],
    ) -> bool:
        """Decode, verify and cache `loc` from a frame fetched earlier (`fetch_neighbourhood`);
        False if it fails verification (nothing is put in `out`: fetch it from the store)."""
        as_fetched = loc._replace(offset=0, clen=len(frame))
        return not await self._decode_and_store([as_fetched], frame, 0, priority, out)

    async def _get_range(
        self, blob: str | None, offset: int, length: int, priority: Priority
    ) -> bytes:
        """One ranged GET with the request timeout, retried with backoff while the error is
        temporary and the policy allows; raises _RangeFailed otherwise."""
        assert blob is not None
        key = object_key("blobs", blob)
        policy = self._retry[priority]
        first = trio.current_time()
        attempt = 1
        while True:
            err = await self._try_get_range(key, offset, length, priority)
            if isinstance(err, bytes):
                return err
            delay = policy.delay(attempt, random.random())
            elapsed = trio.current_time() - first
            if attempt >= policy.max_attempts or elapsed + delay > policy.max_elapsed:
                self.stats.record_error("unavailable")
                raise _RangeFailed(f"{err} (gave up after {attempt} attempt(s))")
            log.debug("%s %d+%d: %s; retry %d in %.2f s", key, offset, length, err, attempt, delay)
            self.stats.retries += 1
            await trio.sleep(delay)
            attempt += 1

    async def _try_get_range(
        self, key: str, offset: int, length: int, priority: Priority
    ) -> bytes | StoreUnavailable:
        """One attempt: the data, or the temporary error to retry; raises _RangeFailed on a
        permanent one. The slot is taken before the timeout starts (queueing is not a store
        failure) and is held until the thread really ends, even when the call is abandoned."""
        if priority == Priority.PREFETCH:
            await self._demand.wait_idle()
        if priority in READ_AHEAD:
            self.stats.prefetch_requests += 1
        elif priority == Priority.NEIGHBOURS:
            self.stats.neighbour_requests += 1
        limiter = {Priority.DEMAND: self._demand, Priority.STREAM: self._stream,
                   Priority.PREFETCH: self._prefetch, Priority.NEIGHBOURS: self._near}[priority]
        handoff = Handoff(limiter)
        await handoff.acquire()
        self.stats.requests += 1
        start = trio.current_time()
        try:
            with trio.move_on_after(self.request_timeout):
                data = await trio.to_thread.run_sync(
                    self.store.get_range,
                    key,
                    offset,
                    length,
                    abandon_on_cancel=True,
                    limiter=handoff,
                )
                self.stats.record_request(len(data), trio.current_time() - start)
                if priority == Priority.NEIGHBOURS:
                    self.stats.neighbour_bytes += len(data)
                return data
        except StoreUnavailable as e:
            self.stats.record_error("store_unavailable")
            if not e.temporary:
                raise _RangeFailed(str(e)) from None
            return e
        except ObjectMissing as e:
            self.stats.record_error("missing")
            raise _RangeFailed(str(e)) from None
        except (StoreError, ValueError) as e:
            self.stats.record_error("store_error")
            raise _RangeFailed(str(e)) from None
        finally:
            handoff.release_if_unused()
        self.stats.record_error("timeout")
        return StoreUnavailable(f"no answer within {self.request_timeout:g} s", temporary=True)

    async def _decode_and_store(
        self,
        run: list[ChunkLoc],
        data: bytes | memoryview,
        start: int,
        priority: Priority,
        out: dict[bytes, Outcome],
        cached: OnCached | None = None,
    ) -> list[tuple[ChunkLoc, FormatError]]:
        """Decode and verify each chunk of a fetched range, cache the good ones and put their
        plaintext in `out`; return the ones that failed verification."""
        if sum(c.ulen for c in run) <= INLINE_CODEC_BYTES:
            results = self._decode_sync(run, data, start, cached)
        else:
            results = await trio.to_thread.run_sync(self._decode_sync, run, data, start, cached)
        bad = []
        for loc, value in results:
            if isinstance(value, FormatError):
                bad.append((loc, value))
                continue
            plain, cache_error = value
            out[loc.digest] = plain
            self.stats.chunks_fetched += 1
            self.stats.bytes_decompressed += len(plain)
            if priority in READ_AHEAD:
                self.stats.record_prefetched(loc.digest, len(plain))
            if cache_error is not None:
                self._cache_error("cannot write the chunk cache", cache_error)
        await self._after_insert()
        return bad

    def _decode_sync(
        self, run: list[ChunkLoc], data: bytes | memoryview, start: int,
        cached: OnCached | None = None,
    ) -> list[tuple[ChunkLoc, FormatError | tuple[bytes, OSError | None]]]:
        """Each chunk of `run` decoded, verified and cached in turn (possibly in a worker
        thread); `cached(loc)` right after each one's cache write, so that another process
        waiting for that chunk's lock takes it from the cache then, not after the rest of the
        run (a replay's 4 MiB request holds ~13 chunks)."""
        view = memoryview(data)
        results: list[tuple[ChunkLoc, FormatError | tuple[bytes, OSError | None]]] = []
        for loc in run:
            frame = view[loc.offset - start : loc.offset - start + loc.clen]
            try:
                plain = decode_chunk(frame, loc.digest, loc.ulen)
            except FormatError as e:
                results.append((loc, e))
                continue
            results.append((loc, (plain, self._insert(loc.digest, plain))))
            if cached is not None:
                cached(loc)
        return results

    def _insert(self, digest: bytes, plain: bytes) -> OSError | None:
        """Cache `plain`; on a full disk, evict and retry once. The error if it is not cached
        (the read is then served from memory, never failed: the next read fetches it again)."""
        try:
            self.cache.insert(digest, plain)
            return None
        except OSError as e:
            if e.errno not in DISK_FULL:
                return e
        try:
            self.cache.make_room()
            self.cache.insert(digest, plain)
        except OSError as e:
            return e
        return None


class _RangeFailed(Exception):
    """A ranged request failed for good (permanent error or retries exhausted)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
