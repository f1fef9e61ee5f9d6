"""core/neighbours.py: the chunks stored beside a chunk in its blob, from real built groups,
and the fetcher fetching the neighbourhood of a chunk a reader waited for (real LocalStore,
real ChunkCache)."""

from __future__ import annotations

import time

import pytest
import trio
from support.trees import file

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import chunk_loc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.neighbours import Neighbours
from weenvfs.errors import StoreUnavailable
from weenvfs.store.faulty import FaultyStore

CHUNK = 16 << 10  # conftest's chunk size: one file of this size is one chunk


def _frames(index):
    """Every non-zero chunk of `index` as a ChunkLoc, in blob order."""
    locs = [chunk_loc(index, n) for n in range(index.header.chunk_count)]
    return sorted((loc for loc in locs if loc.blob is not None), key=lambda c: (c.blob, c.offset))


def test_around_returns_the_frames_within_reach_in_blob_order(repo, build_group, pattern):
    specs = [file(f"f{i:02d}", pattern(i, CHUNK)) for i in range(12)]
    group = build_group(repo, specs, "row")
    frames = _frames(group.index)
    assert len({loc.blob for loc in frames}) == 1 and len(frames) == 12
    middle = frames[6]
    # Incompressible chunks: each frame is a little over CHUNK bytes.
    reach = 2 * CHUNK + 100
    near = Neighbours([group.index], reach).around(middle)
    assert near == [loc for loc in frames if loc != middle
                    and loc.offset + loc.clen <= middle.offset + middle.clen + reach
                    and loc.offset >= middle.offset - reach]
    assert frames[4] in near and frames[8] in near  # two on each side
    assert frames[3] not in near and frames[9] not in near
    assert Neighbours([group.index], 0).around(middle) == []


def test_a_chunk_shared_by_two_groups_is_listed_once(repo, build_group, pattern) -> None:
    shared = [file(f"s{i}", pattern(100 + i, CHUNK)) for i in range(4)]
    low = build_group(repo, shared, "low")
    high = build_group(repo, [*shared, file("extra", pattern(200, CHUNK))], "high")
    frames = _frames(low.index)
    near = Neighbours([low.index, high.index], 1 << 30).around(frames[0])
    digests = [loc.digest for loc in near]
    assert len(digests) == len(set(digests))
    assert {loc.digest for loc in frames[1:]} <= set(digests)


def test_zero_chunks_and_other_blobs_have_no_neighbours(repo, build_group, small_group,
                                                         pattern) -> None:
    neighbours = Neighbours([small_group.index], 1 << 30)
    holes = [loc for loc in small_group.locs(b"holes") if loc.blob is None]
    assert holes and neighbours.around(holes[0]) == []
    other = build_group(repo, [file("x", pattern(300, CHUNK))], "other")
    assert neighbours.around(_frames(other.index)[0]) == []


def _serve_reads(fetcher, body):
    """Run `body(fetcher)` with the fetcher's background work serving."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.serve)
            await body()
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _landed(fetcher, requests: int) -> None:
    """Wait until `requests` neighbourhood requests have ended (arrived or failed)."""
    with trio.fail_after(20):
        while fetcher.stats.neighbour_requests < requests or fetcher._near_tasks:
            await trio.sleep(0.005)


def _row_fetcher(repo, build_group, tmp_path, pattern, seed: int, n: int,
                 reach: int = 2 * CHUNK + 100):
    """`n` one-chunk files (contents `pattern(seed + i)`) in one blob, and a fetcher of them
    with neighbourhoods of `reach` bytes: (frames in blob order, cache, store, fetcher)."""
    group = build_group(repo, [file(f"f{i:02d}", pattern(seed + i, CHUNK)) for i in range(n)],
                        "row")
    cache = ChunkCache(tmp_path / "cache")
    store = FaultyStore(repo.store)
    fetcher = Fetcher(store, cache)
    fetcher.neighbours = Neighbours([group.index], reach).around
    return _frames(group.index), cache, store, fetcher


def test_a_demand_miss_fetches_the_neighbourhood_undecoded_in_the_background(
        repo, build_group, tmp_path, pattern) -> None:
    frames, cache, store, fetcher = _row_fetcher(repo, build_group, tmp_path, pattern, 400, 10)
    target = frames[5]

    async def body() -> None:
        assert await fetcher.read([(target, 0, target.ulen)]) == pattern(405, CHUNK)
        await _landed(fetcher, 1)
        # Nothing of the neighbourhood is decoded or cached until a reader asks ...
        assert [cache.contains(loc.digest) for loc in frames].count(True) == 1
        # ... and reading a neighbour then asks the store for nothing but the neighbourhood
        # of that read in turn (frames 8-9, then 1-2).
        calls = store.calls["get_range"]
        assert await fetcher.read([(frames[7], 0, frames[7].ulen)]) == pattern(407, CHUNK)
        assert await fetcher.read([(frames[3], 0, frames[3].ulen)]) == pattern(403, CHUNK)
        await _landed(fetcher, 3)
        assert store.calls["get_range"] - calls == 2 == fetcher.stats.neighbour_requests - 1

    _serve_reads(fetcher, body)
    assert [cache.contains(loc.digest) for loc in frames] == [i in (3, 5, 7) for i in range(10)]
    snap = fetcher.stats.snapshot()
    assert snap["neighbourhoods"]["hits"] == 2
    # The first neighbourhood was one range, frames 3..7 (the target's own read through).
    first = frames[7].offset + frames[7].clen - frames[3].offset
    assert snap["neighbourhoods"]["bytes"] == first + (frames[9].offset + frames[9].clen
                                                       - frames[8].offset) + (
        frames[2].offset + frames[2].clen - frames[1].offset)
    # What is held unread now (`weenv stats` shows it before the TTL makes it waste).
    held = sum(frames[i].clen for i in (1, 2, 4, 6, 8, 9))
    assert (snap["neighbourhoods"]["held_bytes"], snap["neighbourhoods"]["unused_bytes"]) == (
        held, 0)


def test_the_stash_keeps_the_buffer_the_neighbourhood_was_handed_over_in(
        repo, build_group, tmp_path, pattern) -> None:
    """The native devices hand each neighbourhood to their server in a memfd and return a
    mapping of it, which the stash keeps instead of its own copy (`Fetcher.on_stashed`).
    What that buffer holds is verified as any fetched frame: here it differs (zeros), so a
    read of a neighbour fails verification and is served from the store's own copy."""
    frames, cache, store, fetcher = _row_fetcher(repo, build_group, tmp_path, pattern, 500, 10)
    handed: list[tuple[str, int, int]] = []

    def share(blob: str, start: int, data: bytes) -> bytes:
        handed.append((blob, start, len(data)))
        return bytes(len(data))

    fetcher.on_stashed = share

    async def body() -> None:
        assert await fetcher.read([(frames[5], 0, frames[5].ulen)]) == pattern(505, CHUNK)
        await _landed(fetcher, 1)
        assert await fetcher.read([(frames[6], 0, frames[6].ulen)]) == pattern(506, CHUNK)

    _serve_reads(fetcher, body)
    assert handed and handed[0][0] == frames[5].blob
    assert handed[0][1] == frames[3].offset  # the first neighbourhood: frames 3..7
    assert fetcher.stats.neighbour_hits == 0 and fetcher.stats.retries == 1


def test_a_stashed_miss_widens_the_neighbourhood_only_near_its_ends(
        repo, build_group, tmp_path, pattern) -> None:
    reach = 3 * CHUNK + 200  # three frames on each side
    frames, cache, store, fetcher = _row_fetcher(repo, build_group, tmp_path, pattern, 450, 14,
                                                 reach)
    fetcher.near_reach = reach

    async def body() -> None:
        await fetcher.read([(frames[6], 0, frames[6].ulen)])  # brings frames 3..9
        await _landed(fetcher, 1)
        calls = store.calls["get_range"]
        # Frame 5 lies in the middle of that response: read from it, no request at all.
        assert await fetcher.read([(frames[5], 0, frames[5].ulen)]) == pattern(455, CHUNK)
        await trio.sleep(0.05)  # room for a background request to start (none must)
        assert store.calls["get_range"] == calls and fetcher.stats.neighbour_requests == 1
        # Frame 8 lies in the response's last quarter: the next stretch (10, 11) comes.
        assert await fetcher.read([(frames[8], 0, frames[8].ulen)]) == pattern(458, CHUNK)
        await _landed(fetcher, 2)
        assert store.calls["get_range"] == calls + 1
        assert fetcher._stash.holds(frames[10].digest) and fetcher._stash.holds(frames[11].digest)
        assert not fetcher._stash.covers(frames[12].digest)

    _serve_reads(fetcher, body)
    assert fetcher.stats.neighbour_hits == 2 and fetcher.stats.cache_misses == 3
    assert fetcher.stats.read_waits.count == 3
    assert [cache.contains(loc.digest) for loc in frames] == [i in (5, 6, 8) for i in range(14)]


def test_a_stashed_chunk_another_process_is_fetching_is_left_to_that_process(
        repo, build_group, tmp_path, pattern) -> None:
    frames, cache, store, fetcher = _row_fetcher(repo, build_group, tmp_path, pattern, 470, 8)
    elsewhere = ChunkCache(tmp_path / "cache")  # another holder of the chunk locks

    async def body() -> None:
        await fetcher.read([(frames[4], 0, frames[4].ulen)])
        await _landed(fetcher, 1)
        assert fetcher._stash.holds(frames[5].digest)
        lock = elsewhere.lock(frames[5].digest)
        calls = store.calls["get_range"]
        async with trio.open_nursery() as nursery:
            async def reader() -> None:
                assert await fetcher.read([(frames[5], 0, frames[5].ulen)]) == pattern(475,
                                                                                       CHUNK)
            nursery.start_soon(reader)
            await trio.sleep(0.1)
            assert not cache.contains(frames[5].digest)  # the reader waits for that lock
            lock.release()  # ... which let go without caching it: the reader fetches it
        assert store.calls["get_range"] >= calls + 1
        assert fetcher._stash.holds(frames[5].digest)  # the short path left the frame alone

    _serve_reads(fetcher, body)
    assert cache.contains(frames[5].digest) and fetcher.stats.neighbour_hits == 0


def test_a_reader_waits_for_the_neighbourhood_already_fetching_its_chunk(
        repo, build_group, tmp_path, pattern) -> None:
    specs = [file(f"f{i:02d}", pattern(600 + i, CHUNK)) for i in range(8)]
    group = build_group(repo, specs, "row")
    frames = _frames(group.index)
    wide = []

    def slow_wide(key, offset, length):
        if length > 2 * CHUNK:  # the neighbourhood, not a single chunk
            wide.append(offset)
            time.sleep(0.3)
        return repo.store.get_range(key, offset, length)

    store = FaultyStore(repo.store, get_range=slow_wide)
    fetcher = Fetcher(store, ChunkCache(tmp_path / "cache"))
    fetcher.neighbours = Neighbours([group.index], 2 * CHUNK + 100).around

    async def body() -> None:
        await fetcher.read([(frames[4], 0, frames[4].ulen)])
        assert fetcher._stash.covers(frames[6].digest)  # on its way, slowly
        assert await fetcher.read([(frames[6], 0, frames[6].ulen)]) == pattern(606, CHUNK)

    _serve_reads(fetcher, body)
    # One demand request (f04); f06 came from the neighbourhood, whose read asked in turn
    # for the neighbourhood of f06 (f07).
    assert len(wide) == 1 and store.calls["get_range"] == 1 + fetcher.stats.neighbour_requests
    assert fetcher.stats.neighbour_hits == 1


@pytest.mark.parametrize("fault", ["corrupt", "unavailable"])
def test_a_bad_or_failed_neighbourhood_falls_back_to_the_store(
        repo, build_group, tmp_path, pattern, fault) -> None:
    specs = [file(f"f{i:02d}", pattern(700 + i, CHUNK)) for i in range(8)]
    group = build_group(repo, specs, "row")
    frames = _frames(group.index)

    reading: set[int] = set()  # offsets of the chunks read: every other request is a
    # neighbourhood

    def bad_wide(key, offset, length):
        data = repo.store.get_range(key, offset, length)
        if offset not in reading:
            if fault == "unavailable":
                raise StoreUnavailable("injected", temporary=True)
            return bytes(b ^ 0xFF for b in data)  # every frame in it damaged
        return data

    cache = ChunkCache(tmp_path / "cache")
    store = FaultyStore(repo.store, get_range=bad_wide)
    fetcher = Fetcher(store, cache)
    fetcher.neighbours = Neighbours([group.index], 2 * CHUNK + 100).around

    async def body() -> None:
        reading.add(frames[4].offset)
        await fetcher.read([(frames[4], 0, frames[4].ulen)])
        await _landed(fetcher, 1)
        for i in (2, 3, 5, 6):
            await _landed(fetcher, 0)  # no neighbourhood on its way: `reading` is exact
            reading.add(frames[i].offset)
            assert await fetcher.read([(frames[i], 0, frames[i].ulen)]) == pattern(700 + i,
                                                                                   CHUNK)

    _serve_reads(fetcher, body)
    assert fetcher.stats.neighbour_hits == 0
    assert fetcher.stats.errors.get("corrupt", 0) == 0  # the store's own copies were good
    for i in (2, 3, 4, 5, 6):
        assert cache.contains(frames[i].digest)


def test_without_neighbours_a_miss_fetches_only_itself(repo, build_group, tmp_path,
                                                       pattern) -> None:
    specs = [file(f"f{i:02d}", pattern(500 + i, CHUNK)) for i in range(6)]
    group = build_group(repo, specs, "row")
    frames = _frames(group.index)
    cache = ChunkCache(tmp_path / "cache")
    fetcher = Fetcher(FaultyStore(repo.store), cache)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.serve)
            await fetcher.read([(frames[2], 0, frames[2].ulen)])
            await trio.sleep(0.05)  # room for any background fetch to start (none must)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert [cache.contains(loc.digest) for loc in frames] == [False, False, True, False,
                                                              False, False]


def test_neighbourhoods_dropped_unread_are_counted_as_waste(repo, build_group, tmp_path,
                                                           pattern) -> None:
    from weenvfs.core.frame_stash import FrameStash

    specs = [file(f"f{i:02d}", pattern(800 + i, CHUNK)) for i in range(6)]
    group = build_group(repo, specs, "row")
    frames = _frames(group.index)
    store = FaultyStore(repo.store)
    fetcher = Fetcher(store, ChunkCache(tmp_path / "cache"))
    # Nothing fits: every response is dropped at once.
    fetcher._stash = FrameStash(limit=1, stats=fetcher.stats)
    fetcher.neighbours = Neighbours([group.index], 2 * CHUNK + 100).around

    async def body() -> None:
        await fetcher.read([(frames[2], 0, frames[2].ulen)])
        await _landed(fetcher, 1)
        calls = store.calls["get_range"]
        # Not held: the neighbour is fetched on its own (plus its own neighbourhood).
        assert await fetcher.read([(frames[3], 0, frames[3].ulen)]) == pattern(803, CHUNK)
        assert store.calls["get_range"] > calls

    _serve_reads(fetcher, body)
    snap = fetcher.stats.snapshot()["neighbourhoods"]
    assert snap["hits"] == 0
    first = [frames[i] for i in (0, 1, 3, 4)]  # two on each side of f02
    assert snap["unused_bytes"] >= sum(loc.clen for loc in first)
    assert snap["held_bytes"] == 0  # dropped at once: waste, not held
