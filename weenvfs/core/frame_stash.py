"""Compressed frames fetched around a demand miss, kept undecoded until a reader asks.

A cold reader with no hint reads files in bursts near each other in a blob (core/neighbours.py),
so the fetcher reads the neighbourhood of every chunk a reader waits for. Measured on the
reference workload (issue 13), the wider that neighbourhood the fewer the waits (512 KiB on
each side: 72; 4 MiB: 21), but most of it is never read (73% at 512 KiB), and decoding,
verifying and caching every neighbour took the CPU the reader and the store needed: waits
grew from ~5 ms (one ranged GET on an idle node) to ~17 ms. A range of a blob costs little
more to fetch wide than narrow (loopback SeaweedFS: 300 KiB 4.4 ms, 4 MiB 8.7 ms); what costs
is the work after it. So a neighbourhood's response is kept here as it arrived (or as a
mapping of the copy handed to the native device server), and a frame is decoded, verified and
cached only when a reader (or read-ahead) asks for its chunk; nothing unverified ever leaves
(the fetcher verifies what `take` returns, as any fetched frame).

Owns: the responses (bounded in bytes, least recently arrived dropped first, each dropped
`STASH_TTL` seconds after it arrived), which chunk frames they hold, the requests still in
flight (so a reader waits for the one already fetching its chunk instead of asking again), and
the fetcher's counts of frame bytes held unread and dropped unread (its `Stats`).
Must not: fetch, decode or verify (fetcher.py and range_fetch.py do).
"""

from __future__ import annotations

import mmap
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from .chunk_plan import ChunkLoc
from .stats import Stats

# Compressed bytes of responses kept at once, per fetcher (one per mount daemon): a cold
# start of the reference image fetched ~150 MB of neighbourhoods at a 4 MiB reach.
STASH_BYTES = 192 << 20
# A neighbourhood is read soon after its miss or not at all: the burst of a cold start is over
# within seconds, and a daemon that stays mounted should not hold the memory (measured: 174 MiB
# PSS after the reference workload's first run, 78 MiB once dropped). Idle shared mounts are
# evicted past a memory bound (runtime/mounts.py): several cold starts in a row must not
# push warm mounts out for memory they hold for nothing.
STASH_TTL = 10.0

# A response's bytes: as received, or a mapping of the same bytes shared with the native
# device server (fuse/native_devices.py: one copy in memory, not two).
FrameBytes = bytes | mmap.mmap


@dataclass(eq=False)
class _Response:
    """One neighbourhood response: blob bytes [start, start + len(data))."""

    data: FrameBytes
    start: int
    arrived: float
    frames: set[bytes] = field(default_factory=set)  # digests not taken yet


class FrameStash:
    """Frames of neighbourhood responses, by chunk digest, and the requests in flight."""

    def __init__(self, limit: int = STASH_BYTES, ttl: float = STASH_TTL,
                 clock: Callable[[], float] = time.monotonic, stats: Stats | None = None) -> None:
        self.limit = limit
        self.ttl = ttl
        self._clock = clock
        self.stats = stats if stats is not None else Stats()
        self._responses: OrderedDict[_Response, None] = OrderedDict()  # by arrival
        self._frames: dict[bytes, tuple[_Response, ChunkLoc]] = {}
        self._pending: dict[bytes, trio.Event] = {}
        self.bytes = 0  # compressed bytes held

    @property
    def unread_bytes(self) -> int:
        """Compressed bytes of the frames held and not taken yet."""
        return self.stats.neighbour_held_bytes

    @property
    def unused_bytes(self) -> int:
        """Compressed bytes of frames dropped without being taken (waste)."""
        return self.stats.neighbour_unused_bytes

    def covers(self, digest: bytes) -> bool:
        """Whether `digest`'s frame is held or on its way."""
        return digest in self._frames or digest in self._pending

    def holds(self, digest: bytes) -> bool:
        """Whether `digest`'s frame has arrived (`take` returns it without waiting)."""
        return digest in self._frames

    def at_edge(self, digest: bytes, share: float) -> bool:
        """Whether `digest`'s frame has arrived and starts or ends within `share` of the
        length of the response that brought it from that response's ends (where a reader
        walking on through the blob leaves what was fetched)."""
        held = self._frames.get(digest)
        if held is None:
            return False
        response, frame = held
        margin = share * len(response.data)
        return (frame.offset - response.start < margin
                or response.start + len(response.data) - (frame.offset + frame.clen) < margin)

    def begin(self, run: Sequence[ChunkLoc]) -> trio.Event:
        """Mark the chunks of `run` as on their way; `land` or `fail` must follow."""
        event = trio.Event()
        for loc in run:
            self._pending.setdefault(loc.digest, event)
        return event

    def land(self, run: Sequence[ChunkLoc], event: trio.Event, data: FrameBytes,
             start: int) -> None:
        """The response for `run` (blob bytes from `start`) arrived: hold its frames."""
        self._sweep()
        response = _Response(data, start, self._clock())
        for loc in run:
            if self._pending.get(loc.digest) is event:
                del self._pending[loc.digest]
            inside = loc.offset >= start and loc.offset + loc.clen <= start + len(data)
            if inside and loc.digest not in self._frames:
                self._frames[loc.digest] = (response, loc)
                response.frames.add(loc.digest)
                self.stats.neighbour_held_bytes += loc.clen
        event.set()
        if response.frames:
            self._responses[response] = None
            self.bytes += len(data)
            while self.bytes > self.limit and self._responses:
                self._drop(next(iter(self._responses)))

    def fail(self, run: Sequence[ChunkLoc], event: trio.Event) -> None:
        """The request for `run` failed: readers waiting on it fetch for themselves."""
        for loc in run:
            if self._pending.get(loc.digest) is event:
                del self._pending[loc.digest]
        event.set()

    async def take(self, loc: ChunkLoc) -> memoryview | None:
        """`loc`'s frame, unverified (waiting for its request if one is in flight), removed
        from the stash; None when it is not here (then fetch it from the store)."""
        event = self._pending.get(loc.digest)
        if event is not None:
            await event.wait()
        held = self._pop(loc.digest)
        if held is None:
            return None
        # `frame` may be the same chunk stored at another place (a chunk two groups share):
        # decoding verifies it against the digest either way.
        response, frame = held
        at = frame.offset - response.start
        return memoryview(response.data)[at:at + frame.clen]

    def discard(self, digest: bytes) -> bool:
        """Drop `digest`'s frame, which was used elsewhere (not waste); whether it was held."""
        return self._pop(digest) is not None

    def _pop(self, digest: bytes) -> tuple[_Response, ChunkLoc] | None:
        """Remove `digest`'s frame (its response goes once it has no frame left)."""
        held = self._frames.pop(digest, None)
        if held is not None:
            self.stats.neighbour_held_bytes -= held[1].clen
            held[0].frames.discard(digest)
            if not held[0].frames:
                self._forget(held[0])
        return held

    def sweep(self) -> None:
        """Drop responses older than the TTL (the fetcher calls this now and then)."""
        self._sweep()

    def _sweep(self) -> None:
        now = self._clock()
        while self._responses:
            oldest = next(iter(self._responses))
            if now - oldest.arrived < self.ttl:
                break
            self._drop(oldest)

    def _drop(self, response: _Response) -> None:
        for digest in response.frames:
            held = self._frames.pop(digest, None)
            if held is not None:
                self.stats.neighbour_held_bytes -= held[1].clen
                self.stats.neighbour_unused_bytes += held[1].clen
        response.frames.clear()
        self._forget(response)

    def _forget(self, response: _Response) -> None:
        if response in self._responses:
            del self._responses[response]
            self.bytes -= len(response.data)
