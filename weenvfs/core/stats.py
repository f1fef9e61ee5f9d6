"""Counters and a fetch-latency histogram of one fetcher, as a JSON-able snapshot.

Owns: what is counted (bytes and chunks fetched, store requests, cache hits and misses, bytes
served, errors by kind, prefetch effect) and how latency percentiles are estimated (a
logarithmic histogram: bounded memory, about 9% relative error, no sampling bias). Must not:
do I/O, log, or know how fetching works; the fetcher decides what to record.

Not thread-safe by design: the fetcher records from the trio thread only (results of worker
threads are recorded after the thread returns), so plain integer updates suffice.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

# Demand reads that hit a chunk brought in by prefetch count as hint hits. Remembering every
# prefetched digest forever would grow without bound; the oldest are forgotten beyond this.
_PREFETCH_MEMORY = 1 << 16
# The shortest duration a LatencyHistogram tells apart: everything up to it shares bucket 0.
LOWEST_S = 1e-5


def doubling_bound(k: int) -> float:
    """The upper bound in seconds of doubling `k` of `LatencyHistogram.doublings` (the
    exporter's histogram buckets, docs/metrics.md): LOWEST_S * 2**k, exact to 10 us."""
    return round(LOWEST_S * 2.0**k, 5)


class LatencyHistogram:
    """Durations in log-spaced buckets: `per_doubling` buckets per factor of two.

    Bucket i holds durations in (lowest * r**(i-1), lowest * r**i] with r = 2**(1/per_doubling);
    a percentile is reported as its bucket's upper bound, so it never understates.
    """

    def __init__(self, lowest: float = LOWEST_S, highest: float = 600.0, per_doubling: int = 8):
        self.lowest = lowest
        self.per_doubling = per_doubling
        self.ratio = 2.0 ** (1.0 / per_doubling)
        self.buckets = [0] * (int(math.log(highest / lowest, self.ratio)) + 2)
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        """Record one duration (negative values count as zero)."""
        seconds = max(seconds, 0.0)
        index = 0
        if seconds > self.lowest:
            index = min(
                math.ceil(math.log(seconds / self.lowest, self.ratio)), len(self.buckets) - 1
            )
        self.buckets[index] += 1
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def percentile(self, q: float) -> float | None:
        """The duration below which a fraction `q` (0..1) of the recorded ones fall, or None."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for index, n in enumerate(self.buckets):
            seen += n
            if seen >= rank:
                return min(self.lowest * self.ratio**index, self.max)
        return self.max

    def doublings(self) -> list[int]:
        """Counts per factor of two: entry 0 holds durations up to `lowest`, entry k those in
        (lowest * 2**(k-1), lowest * 2**k], the last one also everything longer; trailing
        empty entries are left out. Exact sums of the fine buckets, so a scraper can turn
        them into cumulative buckets (fuse/metrics.py) without re-estimating anything."""
        out: list[int] = []
        for index, n in enumerate(self.buckets):
            if n:
                k = -(-index // self.per_doubling)
                out.extend([0] * (k + 1 - len(out)))
                out[k] += n
        return out

    def summary(self) -> dict[str, Any]:
        """count, mean and p50/p90/p99/max in milliseconds (None when nothing was recorded),
        the exact total, and the counts per doubling (`doublings`)."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000.0, 3)

        return {
            "count": self.count,
            "mean_ms": ms(self.total / self.count) if self.count else None,
            "p50_ms": ms(self.percentile(0.50)),
            "p90_ms": ms(self.percentile(0.90)),
            "p99_ms": ms(self.percentile(0.99)),
            "max_ms": ms(self.max) if self.count else None,
            "total_ms": round(self.total * 1000.0, 3),
            "per_doubling": self.doublings(),
        }


class Stats:
    """Everything a fetcher counts. Attributes are public counters; `snapshot()` reports them."""

    def __init__(self) -> None:
        self.reads = 0  # demand read() calls
        self.bytes_served = 0  # bytes returned by read()
        self.cache_hits = 0  # chunks a demand read found verified in the node cache
        self.cache_misses = 0  # chunks a demand read had to fetch or wait for
        self.zero_chunks = 0  # all-zero chunks served without I/O
        self.requests = 0  # store get_range calls (each attempt, retries included)
        self.retries = 0  # attempts after a temporary failure or a corrupt body
        self.bytes_fetched = 0  # compressed bytes received from the store
        self.chunks_fetched = 0  # chunks fetched, verified and stored
        self.bytes_decompressed = 0  # plaintext bytes of those chunks
        self.waited_for_other = 0  # chunks another process fetched while this one waited
        self.errors: Counter[str] = Counter()  # kind -> count (timeout, unavailable, corrupt..)
        self.latency = LatencyHistogram()  # of successful store requests
        # Demand reads that waited for a fetch (theirs or one in flight), and for how long:
        # the time a cold reader stalls, what prefetch and neighbourhoods are there to cut.
        self.read_waits = LatencyHistogram()
        self.prefetch_requests = 0
        self.prefetched_chunks = 0
        self.prefetched_bytes = 0  # plaintext bytes of those chunks
        self.prefetch_hint_hits = 0  # demand reads served by a chunk prefetch brought
        self.prefetch_dropped = 0  # read-ahead batches dropped (too many in flight)
        # Another process prefetches for this consumer (fuse/replay_process.py): its reports
        # name the chunks it brought after this process may already have read them.
        self.prefetch_elsewhere = False
        # Neighbourhoods of misses, fetched undecoded (core/frame_stash.py): requests, their
        # compressed bytes (also in bytes_fetched), and chunks readers then took from them.
        self.neighbour_requests = 0
        self.neighbour_bytes = 0
        self.neighbour_hits = 0
        # Counted by the stash (core/frame_stash.py): frames dropped unread (age, bound), and
        # frames held unread now, to be read or dropped (a gauge, not a counter).
        self.neighbour_unused_bytes = 0
        self.neighbour_held_bytes = 0
        self._prefetched: OrderedDict[bytes, None] = OrderedDict()
        # Chunks demand used before their prefetch was recorded: the prefetch's decoder thread
        # writes the cache before the trio task records the chunk, and a demand read may hit
        # the cache in between. That is still a hit, not waste.
        self._used_early: OrderedDict[bytes, None] = OrderedDict()
        # The latest counters of another process fetching for the same mount (a hint replay
        # of its own, fuse/replay_process.py), added to these in `snapshot`.
        self._other: dict[str, Any] = {}

    def record_request(self, nbytes: int, seconds: float) -> None:
        """One successful store request of `nbytes` that took `seconds`."""
        self.bytes_fetched += nbytes
        self.latency.add(seconds)

    def record_error(self, kind: str) -> None:
        """One failure of `kind` (e.g. 'timeout', 'unavailable', 'corrupt', 'missing')."""
        self.errors[kind] += 1

    def record_prefetched(self, digest: bytes, nbytes: int = 0) -> None:
        """A chunk (`nbytes` of plaintext) that prefetch brought into the cache."""
        self.prefetched_chunks += 1
        self.prefetched_bytes += nbytes
        if self._used_early.pop(digest, 0) is None:
            self.prefetch_hint_hits += 1
            return
        self._prefetched[digest] = None
        if len(self._prefetched) > _PREFETCH_MEMORY:
            self._prefetched.popitem(last=False)

    def record_demand_use(self, digest: bytes) -> None:
        """A demand read used `digest`: a hint hit if prefetch brought it (counted once)."""
        if self._prefetched.pop(digest, 0) is None:
            self.prefetch_hint_hits += 1
        elif self.prefetch_requests or self.prefetch_elsewhere:  # it may be about to record it
            self._used_early[digest] = None
            if len(self._used_early) > _PREFETCH_MEMORY:
                self._used_early.popitem(last=False)

    def unused_prefetched(self, digests: Iterable[bytes] | None = None) -> int:
        """Waste: prefetched chunks no demand read has used (yet), among `digests` if given.
        Computed when asked; chunks forgotten beyond the bounded memory do not count."""
        if digests is None:
            return len(self._prefetched)
        return sum(1 for d in digests if d in self._prefetched)

    def add_other(self, snapshot: Mapping[str, Any]) -> None:
        """Count the store traffic of another process fetching for the same consumer:
        `snapshot` is its latest cumulative `snapshot()` (replaces the previous one). Its
        request, byte and error counters are added to ours; its latency histogram is not."""
        self._other = dict(snapshot)

    def _plus(self, key: str, value: int) -> int:
        other = self._other.get(key, 0)
        return value + (other if isinstance(other, int) else 0)

    def snapshot(self) -> dict[str, Any]:
        """All counters as a JSON-able dict (a copy: later updates do not change it)."""
        errors = Counter(self.errors)
        other_errors = self._other.get("errors", {})
        if isinstance(other_errors, dict):
            errors.update({k: v for k, v in other_errors.items() if isinstance(v, int)})
        other_prefetch = self._other.get("prefetch", {})
        other_requests = other_prefetch.get("requests", 0) if isinstance(other_prefetch,
                                                                          dict) else 0
        return {
            "reads": self.reads,
            "bytes_served": self.bytes_served,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "zero_chunks": self.zero_chunks,
            "requests": self._plus("requests", self.requests),
            "retries": self._plus("retries", self.retries),
            "bytes_fetched": self._plus("bytes_fetched", self.bytes_fetched),
            "chunks_fetched": self._plus("chunks_fetched", self.chunks_fetched),
            "bytes_decompressed": self._plus("bytes_decompressed", self.bytes_decompressed),
            "waited_for_other_process": self._plus("waited_for_other_process",
                                                   self.waited_for_other),
            "fetch_latency": self.latency.summary(),
            "read_waits": {**self.read_waits.summary(),
                           "total_s": round(self.read_waits.total, 3)},
            "errors": dict(sorted(errors.items())),
            "prefetch": {
                "requests": self.prefetch_requests + (other_requests
                                                      if isinstance(other_requests, int) else 0),
                "chunks": self.prefetched_chunks,
                "bytes": self.prefetched_bytes,
                "hint_hits": self.prefetch_hint_hits,
                "waste": self.unused_prefetched(),
                "dropped": self.prefetch_dropped,
            },
            "neighbourhoods": {
                "requests": self.neighbour_requests,
                "bytes": self.neighbour_bytes,
                "hits": self.neighbour_hits,
                "unused_bytes": self.neighbour_unused_bytes,
                "held_bytes": self.neighbour_held_bytes,
            },
        }
