"""core/fetcher.py against a real LocalStore (faults injected by FaultyStore in front of it)
and a real ChunkCache: correctness, coalescing, single fetch in and across processes,
priorities, deadline, corruption, retries, prefetch.

Trio code runs through `trio.run` inside plain pytest functions. Ordering tests use a gate in
front of the store (each call waits until the test releases it) instead of timing; deadline
tests use trio's MockClock, so "within the deadline" is checked in virtual time.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from weenvfs.core.cache import TRUST_XATTR, ChunkCache
from weenvfs.core.chunk_plan import ChunkLoc, plan_requests
from weenvfs.core.fetcher import STREAM_CONCURRENCY, Fetcher
from weenvfs.core.range_fetch import INLINE_CODEC_BYTES
from weenvfs.errors import ChunkCorrupt, ChunkUnavailable
from weenvfs.format.digest import digest_bytes
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.local import LocalStore
from weenvfs.store.retry import RetryPolicy

FAST_RETRY = RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.01, max_elapsed=10.0)
CHUNK = 4096


def _read_all(fetcher: Fetcher, locs: Sequence[ChunkLoc]) -> bytes:
    return trio.run(fetcher.read, [(loc, 0, loc.ulen) for loc in locs])


def _plains(pattern: Callable[[int, int], bytes], n: int, size: int = CHUNK) -> list[bytes]:
    return [pattern(1000 + i, size) for i in range(n)]


class Gate:
    """A get_range override that records each call's offset and holds it until released."""

    def __init__(self, inner: LocalStore, hold: Callable[[int], bool] = lambda off: True):
        self.inner = inner
        self.hold = hold
        self.arrived: list[int] = []
        self._events: list[threading.Event] = []
        self._lock = threading.Lock()
        self._open = False

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        event = threading.Event()
        with self._lock:
            self.arrived.append(offset)
            self._events.append(event)
            if self._open or not self.hold(offset):
                event.set()
        event.wait(60)
        return self.inner.get_range(key, offset, length)

    def release(self, n: int) -> None:
        """Let the n-th call (0-based, arrival order) proceed."""
        self._events[n].set()

    def open(self) -> None:
        """Let every held and future call proceed."""
        with self._lock:
            self._open = True
            for event in self._events:
                event.set()

    async def arrivals(self, n: int) -> None:
        """Wait until `n` calls have arrived."""
        with trio.fail_after(20):
            while len(self.arrived) < n:
                await trio.sleep(0.002)


# -- correctness and caching ---------------------------------------------------------------------


def test_random_reads_equal_the_content(small_group, chunk_cache: ChunkCache) -> None:
    store = FaultyStore(small_group.repo.store)
    fetcher = Fetcher(store, chunk_cache)
    rng = random.Random(7)

    async def main() -> None:
        for _ in range(200):
            path, content = rng.choice(sorted(small_group.files.items()))
            offset = rng.randrange(0, len(content) + 100)
            length = rng.randrange(0, 40000)
            got = await fetcher.read(small_group.spans(path, offset, length))
            assert got == content[offset : offset + length], (path, offset, length)

    trio.run(main)
    requests = store.calls["get_range"]
    # Everything is cached now: reading every file again costs no request.
    trio.run(_read_every_file, fetcher, small_group)
    assert store.calls["get_range"] == requests
    snap = fetcher.stats.snapshot()
    assert snap["cache_hits"] > 0 and snap["zero_chunks"] > 0 and snap["errors"] == {}
    json.dumps(snap)


async def _read_every_file(fetcher: Fetcher, group) -> None:
    for path, content in group.files.items():
        assert await fetcher.read(group.spans(path, 0, len(content))) == content


def test_zero_chunks_cost_no_request(small_group, chunk_cache: ChunkCache) -> None:
    store = FaultyStore(small_group.repo.store)
    fetcher = Fetcher(store, chunk_cache)
    holes = small_group.locs(b"holes")
    zero = [loc for loc in holes if loc.blob is None]
    assert zero, "the sparse file should have hole chunks"
    data = trio.run(fetcher.read, [(loc, 0, loc.ulen) for loc in zero])
    assert data == bytes(sum(loc.ulen for loc in zero))
    assert store.calls["get_range"] == 0


def test_a_fresh_cache_instance_serves_verified_chunks(small_group, tmp_path: Path) -> None:
    store = FaultyStore(small_group.repo.store)
    trio.run(_read_every_file, Fetcher(store, ChunkCache(tmp_path / "c")), small_group)
    calls = store.calls["get_range"]
    # A new process (here: a new instance) re-verifies on first use and fetches nothing.
    fresh = ChunkCache(tmp_path / "c")
    trio.run(_read_every_file, Fetcher(store, fresh), small_group)
    assert store.calls["get_range"] == calls


def test_read_cached_serves_only_chunks_this_process_verified(small_group, tmp_path: Path) -> None:
    store = FaultyStore(small_group.repo.store)
    trio.run(_read_every_file, Fetcher(store, ChunkCache(tmp_path / "c")), small_group)
    fetcher = Fetcher(store, ChunkCache(tmp_path / "c"))  # a new process: nothing verified
    path, content = max(small_group.files.items(), key=lambda item: len(item[1]))
    spans = small_group.spans(path, 0, len(content))
    assert fetcher.read_cached(spans) is None
    assert fetcher.stats.snapshot()["reads"] == 0  # a refusal is not a read
    assert trio.run(fetcher.read, spans) == content
    assert fetcher.read_cached(spans) == content
    snap = fetcher.stats.snapshot()
    assert snap["reads"] == 2 and snap["cache_misses"] == 0
    assert snap["bytes_served"] == 2 * len(content)


def test_held_chunk_files_are_bounded_unpinned_and_let_go_when_evicted(
    small_group, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("weenvfs.core.fetcher.HELD_HANDLES", 2)
    cache = ChunkCache(tmp_path / "c")
    fetcher = Fetcher(FaultyStore(small_group.repo.store), cache)
    trio.run(_read_every_file, fetcher, small_group)
    files = sorted(small_group.files.items())
    for path, content in files:
        assert fetcher.read_cached(small_group.spans(path, 0, len(content))) == content
    assert len(fetcher._held) <= 2
    # Held files are not pinned: the bound may evict them, and one found evicted is let go
    # (its disk space freed) and read the slow way, fetched again.
    path, content = files[-1]
    spans = small_group.spans(path, 0, len(content))
    held = [loc for loc, _, _ in spans if loc.digest in fetcher._held]
    assert held and not set(cache._pins)
    for loc in held:
        cache.path(loc.digest).unlink()
    assert fetcher.read_cached(spans) is None
    assert held[0].digest not in fetcher._held
    assert trio.run(fetcher.read, spans) == content
    assert fetcher.read_cached(spans) == content
    assert all(handle.linked() for handle in fetcher._held.values())
    fetcher.close()
    assert not fetcher._held
    with pytest.raises(RuntimeError):
        fetcher.read_cached(spans)


# -- coalescing ----------------------------------------------------------------------------------


def test_four_adjacent_chunks_are_one_request(put_blob, local_store, chunk_cache, pattern) -> None:
    plains = _plains(pattern, 8)
    locs = put_blob(plains)
    store = FaultyStore(local_store)
    assert _read_all(Fetcher(store, chunk_cache), locs[:4]) == b"".join(plains[:4])
    assert store.calls["get_range"] == 1


def test_a_miss_opens_nothing_in_a_thread(put_blob, local_store, chunk_cache, pattern,
                                         monkeypatch) -> None:
    # A chunk that is not cached costs no thread hop to find that out (before and after its
    # lock): on a cold start that is every miss. A file that must be hashed still opens in one.
    plains = _plains(pattern, 2, size=INLINE_CODEC_BYTES + CHUNK)
    locs = put_blob(plains)
    opened_in: list[str] = []
    real_open = ChunkCache.open

    def recording_open(self, digest, ulen, **kwargs):
        opened_in.append(threading.current_thread().name)
        return real_open(self, digest, ulen, **kwargs)

    monkeypatch.setattr(ChunkCache, "open", recording_open)
    assert _read_all(Fetcher(local_store, chunk_cache), locs[:1]) == plains[0]
    main = threading.main_thread().name
    assert all(name == main for name in opened_in), opened_in
    _read_all(Fetcher(local_store, chunk_cache), locs[1:])
    opened_in.clear()
    os.removexattr(chunk_cache.path(locs[1].digest), TRUST_XATTR)  # as if from another boot
    assert _read_all(Fetcher(local_store, ChunkCache(chunk_cache.root)), locs[1:]) == plains[1]
    assert len(opened_in) == 1 and opened_in[0] != main


@pytest.mark.parametrize(("gap", "requests"), [(0, 2), (1 << 20, 1)])
def test_a_gap_above_the_threshold_splits_the_request(
    put_blob, local_store, chunk_cache, pattern, gap: int, requests: int
) -> None:
    plains = _plains(pattern, 8)
    locs = put_blob(plains)
    store = FaultyStore(local_store)
    wanted = [locs[0], locs[1], locs[5], locs[6]]
    data = _read_all(Fetcher(store, chunk_cache, coalesce_gap=gap), wanted)
    assert data == b"".join(plains[i] for i in (0, 1, 5, 6))
    assert store.calls["get_range"] == requests


def test_max_request_bytes_bounds_a_request(put_blob, local_store, chunk_cache, pattern) -> None:
    plains = _plains(pattern, 4)
    locs = put_blob(plains)
    store = FaultyStore(local_store)
    two = locs[0].clen + locs[1].clen
    assert _read_all(Fetcher(store, chunk_cache, max_request_bytes=two), locs) == b"".join(plains)
    assert store.calls["get_range"] == 2


def test_plan_requests_groups_by_blob_and_drops_zero_chunks() -> None:
    def loc(blob: str | None, offset: int, clen: int) -> ChunkLoc:
        return ChunkLoc(digest_bytes(f"{blob}{offset}".encode()), blob, offset, clen, clen)

    a, b = "a" * 64, "b" * 64
    locs = [loc(b, 0, 10), loc(a, 20, 10), loc(a, 0, 10), loc(None, 0, 10), loc(a, 100, 10)]
    runs = plan_requests(locs, gap=10, max_bytes=1000)
    assert [[(c.blob[0], c.offset) for c in run] for run in runs] == [
        [("a", 0), ("a", 20)],
        [("a", 100)],
        [("b", 0)],
    ]


# -- one fetch per chunk ---------------------------------------------------------------------------


def test_concurrent_readers_share_one_fetch(put_blob, local_store, chunk_cache, pattern) -> None:
    plains = _plains(pattern, 2)
    locs = put_blob(plains)
    gate = Gate(local_store)
    store = FaultyStore(local_store, get_range=gate.get_range)
    fetcher = Fetcher(store, chunk_cache)
    results: list[bytes] = []

    async def reader() -> None:
        results.append(await fetcher.read([(locs[0], 0, CHUNK), (locs[1], 0, 10)]))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(reader)
            await gate.arrivals(1)
            await trio.testing.wait_all_tasks_blocked()
            gate.open()

    trio.run(main)
    assert results == [plains[0] + plains[1][:10]] * 16
    assert store.calls["get_range"] == 1


WORKER = """
import hashlib, json, os, sys, time
import trio
from weenvfs.core.cache import TRUST_XATTR, ChunkCache
from weenvfs.core.chunk_plan import ChunkLoc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.range_fetch import INLINE_CODEC_BYTES
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.local import LocalStore

store_dir, cache_dir, calls, gate, digest, blob, offset, clen, ulen = sys.argv[1:]
inner = LocalStore(store_dir)

def get_range(key, off, length):
    with open(calls, "a") as f:
        f.write(f"{os.getpid()} {off}\\n")
    while not os.path.exists(gate):
        time.sleep(0.005)
    return inner.get_range(key, off, length)

fetcher = Fetcher(FaultyStore(inner, get_range=get_range), ChunkCache(cache_dir))
loc = ChunkLoc(bytes.fromhex(digest), blob, int(offset), int(clen), int(ulen))
data = trio.run(fetcher.read, [(loc, 0, loc.ulen)])
print(json.dumps({"sha": hashlib.sha256(data).hexdigest(), "stats": fetcher.stats.snapshot()}))
"""


def _blocked_on_flock(pid: int) -> bool:
    with open("/proc/locks") as f:
        return any("->" in line and f" {pid} " in line for line in f)


def _wait_for(condition: Callable[[], bool], what: str, procs: Sequence[subprocess.Popen]):
    deadline = time.monotonic() + 30
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"worker exited early ({what}): {proc.stderr.read()}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.01)


def test_two_processes_fetch_a_chunk_once(put_blob, local_store, tmp_path, pattern) -> None:
    import hashlib

    plain = pattern(5, 3 * CHUNK)
    (loc,) = put_blob([plain])
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    calls, gate = tmp_path / "calls", tmp_path / "gate"
    argv = [
        sys.executable, str(script), str(local_store.root), str(tmp_path / "cache"),
        str(calls), str(gate), loc.digest.hex(), loc.blob, str(loc.offset), str(loc.clen),
        str(loc.ulen),
    ]  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(first)
        _wait_for(lambda: calls.exists() and calls.read_text().count("\n") == 1,
                  "the first worker asks the store", procs)  # fmt: skip
        second = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(second)
        _wait_for(lambda: _blocked_on_flock(second.pid), "the second worker waits", procs)
        gate.touch()
        outputs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()  # reaps it and closes the pipes
    assert all(p.returncode == 0 for p in procs)
    assert [o["sha"] for o in outputs] == [hashlib.sha256(plain).hexdigest()] * 2
    assert calls.read_text().count("\n") == 1
    assert outputs[1]["stats"]["waited_for_other_process"] == 1
    assert outputs[1]["stats"]["requests"] == 0


def test_a_read_that_waited_for_the_hint_replay_counts_as_its_hit(
    put_blob, local_store, tmp_path, pattern
) -> None:
    """A mount's read waits for a chunk its hint replay (another process: here a second
    fetcher over the same cache folder) is fetching, then takes it from the cache; the
    replay's report comes after. That read used the prefetched chunk: a hint hit, not waste."""
    plain = pattern(7, CHUNK)
    (loc,) = put_blob([plain])
    gate = Gate(local_store)
    replay = Fetcher(FaultyStore(local_store, get_range=gate.get_range),
                     ChunkCache(tmp_path / "cache"))
    mount = Fetcher(local_store, ChunkCache(tmp_path / "cache"))
    mount.stats.prefetch_elsewhere = True

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(replay.prefetch, [loc])
            await gate.arrivals(1)  # the replay holds the chunk's lock, its request held
            nursery.start_soon(_read_expecting, mount, loc, plain)
            with trio.fail_after(20):  # the read waits for the replay's lock
                while _lock_waits().borrowed_tokens == 0:
                    await trio.sleep(0.002)
            gate.open()

    trio.run(main)
    assert mount.stats.waited_for_other == 1 and mount.stats.requests == 0
    mount.stats.record_prefetched(loc.digest, loc.ulen)  # the replay's report
    prefetch = mount.stats.snapshot()["prefetch"]
    assert prefetch["hint_hits"] == 1 and prefetch["waste"] == 0


def test_a_read_that_found_the_hint_replays_chunk_at_its_lock_counts_as_its_hit(
    put_blob, local_store, tmp_path, pattern
) -> None:
    """The read missed; the replay (another process: here a second cache over the same
    folder) cached the chunk and let its lock go before the read took it; the read then finds
    it cached. Also a hint hit once the replay's report comes, not waste."""
    plain = pattern(8, CHUNK)
    (loc,) = put_blob([plain])
    mount = Fetcher(local_store, ChunkCache(tmp_path / "cache"))
    mount.stats.prefetch_elsewhere = True
    real = mount.cache.try_lock

    def try_lock(digest: bytes) -> Any:
        ChunkCache(tmp_path / "cache").insert(digest, plain)  # the replay, just before
        return real(digest)

    mount.cache.try_lock = try_lock  # type: ignore[method-assign]
    assert _read_all(mount, [loc]) == plain
    assert mount.stats.requests == 0 and mount.stats.cache_misses == 1
    mount.stats.record_prefetched(loc.digest, loc.ulen)  # the replay's report
    prefetch = mount.stats.snapshot()["prefetch"]
    assert prefetch["hint_hits"] == 1 and prefetch["waste"] == 0


def _lock_waits() -> trio.CapacityLimiter:
    """The limiter of this trio run's threads waiting for a chunk lock."""
    from weenvfs.core.chunk_locks import _lock_wait_limiter

    return _lock_wait_limiter()


async def _read_expecting(fetcher: Fetcher, loc: ChunkLoc, plain: bytes) -> None:
    assert await fetcher.read([(loc, 0, loc.ulen)]) == plain


# -- priorities ------------------------------------------------------------------------------------


def test_prefetch_yields_while_demand_is_queued(put_blob, local_store, chunk_cache, pattern):
    locs = put_blob(_plains(pattern, 10))
    prefetched, demanded = locs[:6], locs[6:]
    gate = Gate(local_store)
    store = FaultyStore(local_store, get_range=gate.get_range)
    fetcher = Fetcher(
        store, chunk_cache, demand_concurrency=1, prefetch_concurrency=1, max_request_bytes=1
    )
    chunk_cache.maintain()  # size known: no maintenance thread in the middle of the test

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetcher.prefetch, prefetched)
            await gate.arrivals(1)  # the first prefetch request is in flight
            for loc in demanded:
                nursery.start_soon(fetcher.read, [(loc, 0, 1)])
            await gate.arrivals(2)  # one demand request in flight, three queued
            with trio.fail_after(20):
                while fetcher._demand.queued < 3:
                    await trio.sleep(0.002)
            gate.release(0)  # the prefetch request ends while demand is queued
            with trio.fail_after(20):
                while not chunk_cache.contains(prefetched[0].digest):
                    await trio.sleep(0.002)
            await trio.testing.wait_all_tasks_blocked()
            assert fetcher.stats.prefetch_requests == 1  # the next one waits for demand
            gate.open()

    trio.run(main)
    order = gate.arrived
    p = [loc.offset for loc in prefetched]
    d = {loc.offset for loc in demanded}
    assert order[0] == p[0]
    # The three queued demand requests went first: the next prefetch request could only be
    # issued once the last demand request had its slot (after the third one ended).
    assert set(order[1:4]) <= d
    assert [o for o in order[4:] if o not in d] == p[1:]
    assert len(order) == 10


def test_demand_does_not_wait_for_a_queued_prefetch(put_blob, local_store, chunk_cache, pattern):
    plains = _plains(pattern, 4)
    locs = put_blob(plains)
    gate = Gate(local_store, hold=lambda offset: offset == locs[0].offset)
    store = FaultyStore(local_store, get_range=gate.get_range)
    fetcher = Fetcher(store, chunk_cache, prefetch_concurrency=1, max_request_bytes=1)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetcher.prefetch, locs)
            await gate.arrivals(1)  # prefetch is stuck on chunk 0; chunk 3 is queued behind it
            assert await fetcher.read([(locs[3], 0, CHUNK)]) == plains[3]
            gate.open()

    trio.run(main)
    assert chunk_cache.contains(locs[0].digest)


def test_stream_read_ahead_goes_beside_waiting_demand(put_blob, local_store, chunk_cache,
                                                     pattern) -> None:
    """A sequential reader's read-ahead (`schedule_prefetch(stream=True)`) is its next demand:
    issued while demand reads wait (STREAM_CONCURRENCY requests at once), and a demand read of
    a chunk on its way waits for that request instead of asking the store again."""
    plains = _plains(pattern, 2 + STREAM_CONCURRENCY)
    locs = put_blob(plains)
    ahead, queued = locs[1:-1], locs[-1]  # as many as go out at once: all of them in flight
    gate = Gate(local_store)
    store = FaultyStore(local_store, get_range=gate.get_range)
    fetcher = Fetcher(store, chunk_cache, demand_concurrency=1, max_request_bytes=1)
    chunk_cache.maintain()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.serve)
            nursery.start_soon(_read_expecting, fetcher, locs[0], plains[0])
            await gate.arrivals(1)
            nursery.start_soon(_read_expecting, fetcher, queued, plains[-1])
            with trio.fail_after(20):
                while fetcher._demand.queued < 1:
                    await trio.sleep(0.002)
            assert fetcher.schedule_prefetch(ahead, stream=True)
            await gate.arrivals(1 + len(ahead))  # with demand still queued
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(gate.arrived[1:]) == sorted(loc.offset for loc in ahead)
            assert fetcher._demand.queued == 1
            read = trio.Event()

            async def read_ahead() -> None:
                await _read_expecting(fetcher, ahead[0], plains[1])
                read.set()

            nursery.start_soon(read_ahead)
            await trio.testing.wait_all_tasks_blocked()
            gate.open()
            with trio.fail_after(20):
                await read.wait()  # (not cancelled between its wake-up and its count)
                while not all(chunk_cache.contains(loc.digest) for loc in locs):
                    await trio.sleep(0.002)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sorted(gate.arrived) == sorted(loc.offset for loc in locs)  # each chunk asked once
    assert fetcher.stats.snapshot()["prefetch"]["hint_hits"] == 1  # ahead[0]: read-ahead's


# -- deadline, errors, retries ---------------------------------------------------------------------


def test_stalled_store_fails_within_the_deadline(put_blob, local_store, chunk_cache, pattern,
                                                 assert_logs) -> None:  # fmt: skip
    (loc,) = put_blob(_plains(pattern, 1))
    store = FaultyStore(local_store, "S*", delay=3.0)
    fetcher = Fetcher(store, chunk_cache, deadline=5.0, request_timeout=1.0)
    elapsed: list[float] = []

    async def main() -> None:
        for _ in range(2):
            start = trio.current_time()
            with pytest.raises(ChunkUnavailable) as caught:
                await fetcher.read([(loc, 0, CHUNK)])
            elapsed.append(trio.current_time() - start)
            assert not isinstance(caught.value, ChunkCorrupt)

    with assert_logs(r"chunk [0-9a-f]{12} is unavailable", count=1):  # once per chunk
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert all(0 < t <= 5.0 for t in elapsed)  # virtual seconds: exact, no timing flakiness
    assert fetcher.stats.snapshot()["errors"]["timeout"] >= 2
    assert not chunk_cache.contains(loc.digest)


def test_temporary_errors_are_retried(put_blob, local_store, chunk_cache, pattern) -> None:
    plains = _plains(pattern, 2)
    locs = put_blob(plains)
    store = FaultyStore(local_store, "EEg")
    fetcher = Fetcher(store, chunk_cache, retry=FAST_RETRY)
    assert _read_all(fetcher, locs) == b"".join(plains)
    assert store.calls["get_range"] == 3
    assert fetcher.stats.retries == 2


def test_retries_run_out(put_blob, local_store, chunk_cache, pattern, assert_logs) -> None:
    (loc,) = put_blob(_plains(pattern, 1))
    store = FaultyStore(local_store, "E*")
    fetcher = Fetcher(store, chunk_cache, retry=FAST_RETRY)
    with assert_logs("gave up after 4 attempt", count=1), pytest.raises(ChunkUnavailable):
        _read_all(fetcher, [loc])
    assert store.calls["get_range"] == 4


@pytest.mark.parametrize("code", ["M", "P"])
def test_permanent_errors_fail_at_once(put_blob, local_store, chunk_cache, pattern, assert_logs,
                                       code: str) -> None:  # fmt: skip
    (loc,) = put_blob(_plains(pattern, 1))
    store = FaultyStore(local_store, code)
    with assert_logs("is unavailable", count=1), pytest.raises(ChunkUnavailable):
        _read_all(Fetcher(store, chunk_cache, retry=FAST_RETRY), [loc])
    assert store.calls["get_range"] == 1


def test_corrupt_chunk_is_retried_once_then_reported_once(
    put_blob, local_store, chunk_cache, pattern, assert_logs
) -> None:
    (loc,) = put_blob(_plains(pattern, 1))
    store = FaultyStore(local_store, "C*")
    fetcher = Fetcher(store, chunk_cache, retry=FAST_RETRY)
    with assert_logs(r"chunk [0-9a-f]{12} is corrupt", count=1):
        for _ in range(2):
            with pytest.raises(ChunkCorrupt):
                _read_all(fetcher, [loc])
    assert store.calls["get_range"] == 4  # each read: the fetch and one retry
    assert not chunk_cache.contains(loc.digest)
    assert fetcher.stats.snapshot()["errors"]["corrupt"] == 2


def test_a_bad_body_once_is_repaired_by_the_retry(put_blob, local_store, chunk_cache, pattern):
    plains = _plains(pattern, 3)
    locs = put_blob(plains)
    store = FaultyStore(local_store, "C")  # corrupts the middle of the coalesced range
    fetcher = Fetcher(store, chunk_cache)
    assert _read_all(fetcher, locs) == b"".join(plains)
    assert store.calls["get_range"] == 2  # the range, then the one damaged chunk alone
    assert all(chunk_cache.contains(loc.digest) for loc in locs)


# -- prefetch ------------------------------------------------------------------------------------


def test_prefetch_fills_the_cache_and_counts_hint_hits(
    put_blob, local_store, chunk_cache, pattern
) -> None:
    plains = _plains(pattern, 6)
    locs = put_blob(plains)
    store = FaultyStore(local_store)
    fetcher = Fetcher(store, chunk_cache)
    trio.run(fetcher.prefetch, locs)
    calls = store.calls["get_range"]
    assert all(chunk_cache.contains(loc.digest) for loc in locs)
    assert _read_all(fetcher, locs[:4]) == b"".join(plains[:4])
    assert store.calls["get_range"] == calls
    prefetch = fetcher.stats.snapshot()["prefetch"]
    assert prefetch["chunks"] == 6 and prefetch["hint_hits"] == 4


def test_windows_are_prefetched_without_a_pause_between_them(
    put_blob, local_store, chunk_cache, pattern
) -> None:
    """The next window's first request goes out while the last one of a window is still
    in flight (a replay used to wait for each window's slowest request); each window is
    reported done once, after its own requests."""
    locs = put_blob(_plains(pattern, 6))
    windows = [locs[:2], locs[2:4], locs[4:]]
    gate = Gate(local_store, hold=lambda offset: offset == locs[1].offset)
    store = FaultyStore(local_store, get_range=gate.get_range)
    fetcher = Fetcher(store, chunk_cache, prefetch_concurrency=2, max_request_bytes=1)
    done: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetcher.prefetch_windows, windows,
                               lambda window: done.append(windows.index(window)))
            await gate.arrivals(6)  # every request went out while chunk 1's was held
            # the unheld windows finish on their own; arriving is not finishing, so wait
            with trio.fail_after(20):
                while sorted(done) != [1, 2]:
                    await trio.sleep(0.002)
            assert not chunk_cache.contains(locs[1].digest)
            gate.open()

    trio.run(main)
    assert sorted(gate.arrived) == [loc.offset for loc in locs]
    assert sorted(done) == [0, 1, 2] and done[-1] == 0
    assert all(chunk_cache.contains(loc.digest) for loc in locs)


def test_a_chunk_lock_is_let_go_as_soon_as_its_chunk_is_cached(
    put_blob, local_store, chunk_cache, pattern, monkeypatch
) -> None:
    """One request of three chunks: while its last chunk is decoded, another process could
    take the first one from the cache already (its lock is free), not only after the whole
    request (a replay's request holds several megabytes)."""
    from weenvfs.core import range_fetch

    locs = put_blob(_plains(pattern, 3))
    seen: list[tuple[bool, bool]] = []
    real = range_fetch.decode_chunk

    def decode(frame: bytes, digest: bytes, length: int) -> bytes:
        if digest == locs[2].digest:
            first, last = chunk_cache.try_lock(locs[0].digest), chunk_cache.try_lock(digest)
            seen.append((first is not None, last is not None))
            for lock in (first, last):
                if lock is not None:
                    lock.release()
        return real(frame, digest, length)

    monkeypatch.setattr(range_fetch, "decode_chunk", decode)
    fetcher = Fetcher(local_store, chunk_cache)
    trio.run(fetcher.prefetch, locs)
    assert fetcher.stats.requests == 1
    assert seen == [(True, False)]  # the first chunk's lock free, the one decoded held
    assert all(chunk_cache.contains(loc.digest) for loc in locs)


def test_prefetch_failures_are_not_raised(put_blob, local_store, chunk_cache, pattern) -> None:
    locs = put_blob(_plains(pattern, 2))
    store = FaultyStore(local_store, "P*")
    fetcher = Fetcher(store, chunk_cache)
    trio.run(fetcher.prefetch, locs)
    assert not any(chunk_cache.contains(loc.digest) for loc in locs)


def test_schedule_prefetch_needs_serve(put_blob, local_store, chunk_cache, pattern) -> None:
    locs = put_blob(_plains(pattern, 3))
    fetcher = Fetcher(FaultyStore(local_store), chunk_cache)

    async def main() -> None:
        assert not fetcher.schedule_prefetch(locs)
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.serve)
            assert fetcher.schedule_prefetch(locs)
            with trio.fail_after(20):
                while not all(chunk_cache.contains(loc.digest) for loc in locs):
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert fetcher.stats.snapshot()["prefetch"]["dropped"] == 1


# -- cache bound ---------------------------------------------------------------------------------


def test_reads_keep_the_cache_within_its_bound(put_blob, local_store, tmp_path, pattern) -> None:
    plains = _plains(pattern, 40)
    locs = put_blob(plains)
    cache = ChunkCache(tmp_path / "small", max_bytes=10 * CHUNK)
    fetcher = Fetcher(FaultyStore(local_store), cache)

    async def main() -> None:
        for loc, plain in zip(locs, plains, strict=True):
            assert await fetcher.read([(loc, 0, CHUNK)]) == plain
            assert cache.usage().bytes <= 10 * CHUNK

    trio.run(main)


def test_eviction_keeps_up_with_inserts_during_its_passes(
    put_blob, local_store, tmp_path, pattern
) -> None:
    """Chunks inserted while an eviction pass runs (other fetches finishing) are evicted by
    further passes, however many it takes, before maintenance lets go."""
    plains = _plains(pattern, 30)
    locs = put_blob(plains[:1])
    late = iter(plains[1:])

    class BusyCache(ChunkCache):
        passes = 0

        def maintain(self):  # type: ignore[no-untyped-def]
            result = super().maintain()
            if self.passes < 8:  # two more chunks land after each of the first 8 passes
                self.passes += 1
                for plain in (next(late), next(late)):
                    self.insert(digest_bytes(plain), plain)
            return result

    cache = BusyCache(tmp_path / "small", max_bytes=10 * CHUNK)
    for plain in plains[20:]:  # over the bound before the fetch
        cache.insert(digest_bytes(plain), plain)
    fetcher = Fetcher(FaultyStore(local_store), cache)
    assert trio.run(fetcher.read, [(locs[0], 0, CHUNK)]) == plains[0]
    assert cache.passes == 8
    assert cache.usage().bytes <= 10 * CHUNK
