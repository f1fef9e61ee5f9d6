"""core/prefetch.py without a mount: a real environment (built by tools/builder.py into a
LocalStore: conftest's `build_group` and `open_env`), the real ChunkCache, Fetcher and Reader;
the store is slowed or cut by a gate (test_fetcher.py's) or FaultyStore in front of it.
Recording through the Reader, replay, demand before prefetch, fetch-all then no store,
progress and waste."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from support.trees import file
from test_fetcher import Gate
from test_reader import inode_of

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import ChunkLoc, chunk_loc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.loaded_env import LoadedEnv
from weenvfs.core.node_hints import FoundHint, HintRecorder
from weenvfs.core.prefetch import Prefetcher, all_locs, hint_locs, windows
from weenvfs.core.reader import Reader
from weenvfs.format.hints import Hint, HintRecord
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.repository import Repository

CHUNK = 4 << 10


def _contents() -> dict[str, bytes]:
    rng = random.Random(5)
    data = {f"big{n}": rng.randbytes(4 * CHUNK + n) for n in range(4)}
    data.update({f"small/{n:02d}": rng.randbytes(rng.randrange(1, 900)) for n in range(30)})
    return data


CONTENTS = _contents()


def varied_env(repo: Repository, build_group, open_env) -> LoadedEnv:
    """CONTENTS as environment env:t: 4 KiB chunks, files under 1 KiB batched."""
    specs = [file(p, d) for p, d in CONTENTS.items()]
    return open_env(build_group(repo, specs, "g", "t", chunk_size=CHUNK, batch_threshold=1 << 10))


@pytest.fixture
def env(repo: Repository, build_group, open_env) -> LoadedEnv:
    return varied_env(repo, build_group, open_env)


def found(env: LoadedEnv, records: list[HintRecord]) -> FoundHint:
    return FoundHint("ab" * 32, "test", Hint(env.digest, tuple(records)))


def run(body: Callable[..., object], *args: object) -> None:
    trio.run(body, *args)


# -- pure helpers ------------------------------------------------------------------------------


def test_hint_locs_keep_order_and_drop_repeats(env: LoadedEnv) -> None:
    index = env.tree.groups[0]
    count = index.header.chunk_count
    order = [3, 1, 3, 0, count - 1, 1]
    locs = hint_locs([HintRecord(0, c, t) for t, c in enumerate(order)], env.tree.groups)
    assert locs == [chunk_loc(index, c) for c in (3, 1, 0, count - 1)]
    everything = all_locs(env.tree.groups, {locs[0].digest})
    assert len(everything) == count - 1 and locs[0] not in everything


def test_windows_cut_by_stored_bytes_in_order() -> None:
    locs = [ChunkLoc(bytes([n]) * 32, "b", n * 10, 10, 20) for n in range(7)]
    assert [len(w) for w in windows(locs, 30)] == [3, 3, 1]
    assert [loc for w in windows(locs, 30) for loc in w] == locs
    assert [len(w) for w in windows(locs, 1)] == [1] * 7  # never an empty window
    assert [len(w) for w in windows(locs, 40, first_bytes=10)] == [1, 2, 4]  # ramp up


# -- recording through the reader, then replay -------------------------------------------------


def test_recorded_reads_replay_into_the_cache(env: LoadedEnv, tmp_path: Path) -> None:
    recorder = HintRecorder()
    paths = ["small/07", "big2", "small/21"]

    async def record() -> None:
        reader = Reader(env.tree, Fetcher(env.store, ChunkCache(tmp_path / "c1", 1 << 30)))
        reader.recorder = recorder
        for path in paths:
            assert await reader.read(inode_of(env.tree, path), 0, 1 << 20) == CONTENTS[path]

    run(record)
    records = recorder.records()
    locs = hint_locs(records, env.tree.groups)
    assert len(locs) == len(records) >= 6  # big2 has 5 chunks; both small files are batched
    cache = ChunkCache(tmp_path / "c2", 1 << 30)
    store = FaultyStore(env.store)
    fetcher = Fetcher(store, cache)
    prefetcher = Prefetcher(env.tree.groups, fetcher)
    run(prefetcher.run, lambda: found(env, records))
    assert all(cache.contains(loc.digest) for loc in locs)
    assert store.calls["get_range"] < len(locs)  # coalesced
    progress = prefetcher.progress()
    assert progress["state"] == "done" and progress["chunks_done"] == len(locs)
    assert progress["chunks_missing"] == 0 and progress["waste"] == len(locs)

    async def use() -> None:
        reader = Reader(env.tree, fetcher)
        for path in paths:
            assert await reader.read(inode_of(env.tree, path), 0, 1 << 20) == CONTENTS[path]

    calls = store.calls["get_range"]
    run(use)
    assert store.calls["get_range"] == calls  # everything came from the replay
    snap = fetcher.stats.snapshot()["prefetch"]
    assert snap["hint_hits"] == len(locs) and snap["waste"] == 0
    assert snap["bytes"] == sum(loc.ulen for loc in locs)
    assert prefetcher.progress()["waste"] == 0


def test_no_hint_fetches_nothing(env: LoadedEnv, tmp_path: Path) -> None:
    store = FaultyStore(env.store)
    prefetcher = Prefetcher(env.tree.groups, Fetcher(store, ChunkCache(tmp_path / "c", 1 << 30)))
    run(prefetcher.run, lambda: None)
    assert prefetcher.progress()["state"] == "no hint"
    assert store.calls["get_range"] == 0


# -- demand before prefetch -------------------------------------------------------------------


def test_demand_reads_are_not_delayed_behind_replay(env: LoadedEnv, tmp_path: Path) -> None:
    """A slow store holds the first prefetch request; demand requests arrive at the store
    while it is stuck, before any of the queued prefetch requests, and complete, also for a
    hinted chunk the replay has not reached yet."""
    index = env.tree.groups[0]
    big = [n for n in index.file_chunks(index.resolve(b"big1"))]
    hinted = [n for name in (b"big0", b"big3") for n in index.file_chunks(index.resolve(name))]
    hinted += [big[-1]]  # big1's last chunk, also read on demand below
    hinted_offsets = {chunk_loc(index, n).offset for n in hinted}
    first = chunk_loc(index, hinted[0]).offset
    gate = Gate(env.store, hold=lambda offset: offset == first)
    store = FaultyStore(env.store, get_range=gate.get_range)
    fetcher = Fetcher(store, ChunkCache(tmp_path / "c", 1 << 30), prefetch_concurrency=1,
                      max_request_bytes=1)  # one request per chunk: an exact order
    prefetcher = Prefetcher(env.tree.groups, fetcher, window_bytes=1)
    records = [HintRecord(0, n, t) for t, n in enumerate(hinted)]

    async def main() -> None:
        reader = Reader(env.tree, fetcher, readahead=0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefetcher.run, lambda: found(env, records))
            await gate.arrivals(1)  # the first prefetch request is stuck in the store
            data = await reader.read(inode_of(env.tree, "big1"), 0, 1 << 20)
            assert data == CONTENTS["big1"]
            assert prefetcher.progress()["chunks_done"] == 0
            gate.open()

    run(main)
    demand = {chunk_loc(index, n).offset for n in big}
    assert gate.arrived[0] == first
    assert set(gate.arrived[1 : 1 + len(big)]) == demand
    assert set(gate.arrived[1 + len(big) :]) == hinted_offsets - demand - {first}
    assert prefetcher.progress()["chunks_done"] == len(hinted)


# -- fetch-all --------------------------------------------------------------------------------


def test_fetch_all_then_no_store_every_file_reads(env: LoadedEnv, tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "c", 1 << 30)
    fetcher = Fetcher(env.store, cache)
    prefetcher = Prefetcher(env.tree.groups, fetcher, fetch_all=True, window_bytes=CHUNK)
    records = [HintRecord(0, 0, 0)]
    run(prefetcher.run, lambda: found(env, records))
    progress = prefetcher.progress()
    total = len(all_locs(env.tree.groups))
    assert progress["state"] == "done"
    assert progress["fetch_all"] == {"chunks": total - 1, "done": total - 1, "missing": 0,
                                     "passes": 1}
    gone = FaultyStore(env.store, "M*")  # the store is gone: every call fails

    async def read_all() -> None:
        reader = Reader(env.tree, Fetcher(gone, cache, deadline=5))
        for path, data in CONTENTS.items():
            assert await reader.read(inode_of(env.tree, path), 0, 1 << 20) == data

    run(read_all)
    assert gone.calls["get_range"] == 0


def test_fetch_all_retries_what_failed(env: LoadedEnv, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("weenvfs.core.prefetch.FETCH_ALL_BACKOFF", 0.001)
    cache = ChunkCache(tmp_path / "c", 1 << 30)
    store = FaultyStore(env.store, "P")  # the first request fails for good
    prefetcher = Prefetcher(env.tree.groups, Fetcher(store, cache), fetch_all=True)
    run(prefetcher.run, lambda: None)
    assert prefetcher.progress()["fetch_all"]["passes"] == 2
    assert all(cache.contains(loc.digest) for loc in all_locs(env.tree.groups))


@pytest.mark.parametrize("seed", [False, True])
def test_no_neighbourhoods_while_a_hint_is_replayed(env: LoadedEnv, tmp_path: Path,
                                                    seed: bool) -> None:
    """A hint names what will be read: a miss during its replay fetches only itself; once
    the replay is done, misses fetch their neighbourhoods again (core/neighbours.py). The
    seed names the start-up only: a miss during its replay fetches its neighbourhood."""
    from weenvfs.core.neighbours import Neighbours

    gate = Gate(env.store, hold=lambda offset: True)
    fetcher = Fetcher(gate, ChunkCache(tmp_path / "c", 1 << 30))
    around = Neighbours(env.tree.groups, 1 << 30).around
    asked: list[ChunkLoc] = []

    def spy(loc: ChunkLoc, reach: int | None = None) -> list[ChunkLoc]:
        asked.append(loc)
        return around(loc, reach)

    fetcher.neighbours = spy
    prefetcher = Prefetcher(env.tree.groups, fetcher)
    index = env.tree.groups[0]
    hinted = dataclasses.replace(found(env, [HintRecord(0, 0, 0)]), partial=seed)
    demand = chunk_loc(index, index.header.chunk_count - 1)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.serve)
            nursery.start_soon(prefetcher.run, lambda: hinted)
            await gate.arrivals(1)  # the replay's request is held: replaying now
            assert (fetcher.neighbours is None) is not seed
            nursery.start_soon(fetcher.read, [(demand, 0, demand.ulen)])
            await gate.arrivals(2)
            gate.open()
            with trio.fail_after(20):
                while prefetcher.state != "done":
                    await trio.sleep(0.002)
            nursery.cancel_scope.cancel()

    run(main)
    assert asked == ([demand] if seed else []) and fetcher.neighbours is spy
