"""Prefetch accounting in core/stats.py: hint hits and waste, whichever order the demand read
and the prefetch's bookkeeping happen in."""

from __future__ import annotations

from weenvfs.core.stats import Stats

A, B = b"a" * 32, b"b" * 32


def test_demand_after_prefetch_is_a_hit() -> None:
    stats = Stats()
    stats.prefetch_requests = 1
    stats.record_prefetched(A, 10)
    stats.record_demand_use(A)
    assert (stats.prefetch_hint_hits, stats.unused_prefetched()) == (1, 0)


def test_demand_between_cache_write_and_prefetch_record_is_a_hit_not_waste() -> None:
    stats = Stats()
    stats.prefetch_requests = 1
    stats.record_demand_use(A)  # hit the cache the prefetch's thread had just written
    stats.record_prefetched(A, 10)
    assert (stats.prefetch_hint_hits, stats.unused_prefetched()) == (1, 0)


def test_unread_prefetch_is_waste_and_demand_without_prefetch_is_no_hit() -> None:
    stats = Stats()
    stats.record_demand_use(A)  # no prefetch at all
    stats.prefetch_requests = 1
    stats.record_prefetched(B, 10)
    assert (stats.prefetch_hint_hits, stats.unused_prefetched()) == (0, 1)
