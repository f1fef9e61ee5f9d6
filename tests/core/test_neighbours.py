"""core/neighbours.py: the chunks stored beside a chunk in its blob, from real built groups,
and the fetcher fetching the neighbourhood of a chunk a reader waited for (real LocalStore,
real ChunkCache)."""

from __future__ import annotations

import trio
from support.trees import file

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import chunk_loc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.neighbours import Neighbours
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


def test_a_demand_miss_fetches_the_neighbourhood_in_the_background(
        repo, build_group, tmp_path, pattern) -> None:
    specs = [file(f"f{i:02d}", pattern(400 + i, CHUNK)) for i in range(10)]
    group = build_group(repo, specs, "row")
    frames = _frames(group.index)
    cache = ChunkCache(tmp_path / "cache")
    store = FaultyStore(repo.store)
    fetcher = Fetcher(store, cache)
    fetcher.neighbours = Neighbours([group.index], 2 * CHUNK + 100).around
    target = frames[5]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.serve)
            assert await fetcher.read([(target, 0, target.ulen)]) == pattern(405, CHUNK)
            with trio.fail_after(20):
                while not all(cache.contains(loc.digest) for loc in frames[3:8]):
                    await trio.sleep(0.005)
            # Reading a neighbour now waits for nothing, and fetches nothing more.
            calls = store.calls["get_range"]
            assert await fetcher.read([(frames[7], 0, frames[7].ulen)]) == pattern(407, CHUNK)
            assert store.calls["get_range"] == calls
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert not any(cache.contains(loc.digest) for loc in frames[:3] + frames[8:])
    snap = fetcher.stats.snapshot()
    assert snap["read_waits"]["count"] == 1  # the first read only
    assert snap["prefetch"]["chunks"] == 4 and snap["prefetch"]["hint_hits"] == 1


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
