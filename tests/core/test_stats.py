"""core/stats.py: prefetch accounting (hint hits and waste, whichever order the demand read
and the prefetch's bookkeeping happen in) and the latency histogram's counts per doubling,
which the metrics exporter turns into Prometheus buckets."""

from __future__ import annotations

from weenvfs.core.stats import LatencyHistogram, Stats, doubling_bound

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


def test_demand_before_another_process_reports_its_prefetch_is_a_hit() -> None:
    """A replay in a process of its own reads its chunks through the mount (page-cache
    warm-up) before its report names them; this process has made no prefetch request."""
    stats = Stats()
    stats.prefetch_elsewhere = True
    stats.record_demand_use(A)
    assert stats.prefetch_hint_hits == 0
    stats.record_prefetched(A, 10)
    assert (stats.prefetch_hint_hits, stats.unused_prefetched()) == (1, 0)


def test_unread_prefetch_is_waste_and_demand_without_prefetch_is_no_hit() -> None:
    stats = Stats()
    stats.record_demand_use(A)  # no prefetch at all
    stats.prefetch_requests = 1
    stats.record_prefetched(B, 10)
    assert (stats.prefetch_hint_hits, stats.unused_prefetched()) == (0, 1)


def test_doublings_sum_the_fine_buckets_exactly_at_each_power_of_two() -> None:
    histogram = LatencyHistogram()
    # bucket 0 (<= 10 us), (10, 20] us twice, (40, 80] us, and one past the top bound.
    for seconds in (0.0, 5e-6, 1.1e-5, 2e-5, 7e-5, 10_000.0):
        histogram.add(seconds)
    counts = histogram.doublings()
    assert counts[:4] == [2, 2, 0, 1]
    assert sum(counts) == histogram.count == 6
    assert counts[-1] == 1 and doubling_bound(len(counts) - 2) < 10_000.0
    summary = histogram.summary()
    assert summary["per_doubling"] == counts
    assert summary["total_ms"] == round((5e-6 + 1.1e-5 + 2e-5 + 7e-5 + 10_000.0) * 1000, 3)


def test_doubling_bounds_are_the_fine_bucket_edges() -> None:
    histogram = LatencyHistogram()
    for k in range(1, 26):
        edge = histogram.lowest * histogram.ratio ** (k * histogram.per_doubling)
        assert abs(edge - doubling_bound(k)) < 1e-9 * max(1.0, edge)
    assert doubling_bound(6) == 0.00064 and LatencyHistogram().doublings() == []
