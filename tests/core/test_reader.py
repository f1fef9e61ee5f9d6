"""core/reader.py without a mount: random reads equal an in-memory copy; read-ahead.

Real components throughout: a group built by tools/builder.py into a local store, the real
`ChunkCache` and `Fetcher`. Small chunks (4 KiB) and a small batch threshold make chunk and
batch boundaries frequent, so random reads cross them often.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest
import trio
from support.trees import file, sparse

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import ChunkLoc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.loaded_env import LoadedEnv
from weenvfs.core.reader import Reader
from weenvfs.core.tree import ROOT_INODE, Tree
from weenvfs.store.repository import Repository

CHUNK = 4 << 10


def _contents() -> dict[str, bytes]:
    rng = random.Random(7)
    data = {
        "big": rng.randbytes(10 * CHUNK + 123),  # partial last chunk
        "exact": rng.randbytes(3 * CHUNK),
        "empty": b"",
        "one": b"1",
    }
    for n in range(40):  # batched small files, boundaries all over the batch chunks
        data[f"small/{n:02d}"] = rng.randbytes(rng.randrange(1, 1000))
    return data


CONTENTS = _contents()
SPARSE = {0: b"head", 5 * CHUNK + 10: b"mid" * 300, 12 * CHUNK - 4: b"tail"}


@pytest.fixture
def env(repo: Repository, build_group, open_env) -> LoadedEnv:
    return make_env(repo, build_group, open_env)


def make_env(repo: Repository, build_group, open_env) -> LoadedEnv:
    """CONTENTS plus a sparse file, built into `repo` as group g:t, opened as `env:t`."""
    specs = [file(path, data) for path, data in CONTENTS.items()]
    specs.append(sparse("sparse", 12 * CHUNK, SPARSE))
    return open_env(build_group(repo, specs, "g", "t", chunk_size=CHUNK, batch_threshold=1 << 10))


def inode_of(tree: Tree, path: str) -> int:
    inode = ROOT_INODE
    for part in path.encode().split(b"/"):
        inode = tree.lookup(inode, part).inode
    return inode


def run_with_fetcher(
    env: LoadedEnv, cache_dir: Path, body: Callable[[Fetcher], Awaitable[None]]
) -> None:
    async def main() -> None:
        fetcher = Fetcher(env.store, ChunkCache(cache_dir, 1 << 30))
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.serve)
            await body(fetcher)
            nursery.cancel_scope.cancel()
        fetcher.close()

    trio.run(main)


def expected_sparse() -> bytes:
    buf = bytearray(12 * CHUNK)
    for offset, data in SPARSE.items():
        buf[offset : offset + len(data)] = data
    return bytes(buf)


def test_random_reads_equal_an_in_memory_copy(env: LoadedEnv, tmp_path: Path) -> None:
    copies = dict(CONTENTS, sparse=expected_sparse())
    rng = random.Random(11)

    async def body(fetcher: Fetcher) -> None:
        reader = Reader(env.tree, fetcher)
        for path, data in copies.items():
            inode = inode_of(env.tree, path)
            size = len(data)
            cases = [(0, size), (0, size + 10), (size, 5), (size + 100, 5), (0, 0)]
            cases += [(k * CHUNK - 1, 2) for k in range(1, size // CHUNK + 1)]
            cases += [
                (rng.randrange(0, size + 50), rng.randrange(0, 3 * CHUNK)) for _ in range(30)
            ]
            for offset, length in cases:
                got = await reader.read(inode, offset, length)
                assert got == data[offset : offset + length], (path, offset, length)

    run_with_fetcher(env, tmp_path / "cache", body)


class SpyFetcher:
    """The real fetcher, with the read-ahead it is asked for recorded."""

    def __init__(self, inner: Fetcher) -> None:
        self.inner = inner
        self.scheduled: list[list[ChunkLoc]] = []
        self.streams: list[bool] = []  # for each batch scheduled: as a stream
        self.advised: list[list[ChunkLoc]] = []

    async def read(self, spans: Sequence[tuple[ChunkLoc, int, int]]) -> bytes:
        return await self.inner.read(spans)

    def read_cached(self, spans: Sequence[tuple[ChunkLoc, int, int]]) -> bytes | None:
        return self.inner.read_cached(spans)

    def schedule_prefetch(self, locs: Sequence[ChunkLoc], *, stream: bool = False) -> bool:
        self.scheduled.append(list(locs))
        self.streams.append(stream)
        return self.inner.schedule_prefetch(locs, stream=stream)

    def advise(self, locs: Sequence[ChunkLoc]) -> None:
        self.advised.append(list(locs))
        self.inner.advise(locs)


def test_sequential_reads_queue_a_growing_window_once(env: LoadedEnv, tmp_path: Path) -> None:
    """Read-ahead of a sequential reader: two chunks ahead at first, twice as many at each
    chunk it reads on into, up to `stream_ahead`; every chunk queued once, in order, as a
    stream (fetched beside demand reads, not after them)."""
    index, ino = env.tree.file(inode_of(env.tree, "big"))
    digests = [index.chunk(n).digest for n in index.file_chunks(ino)]

    async def body(fetcher: Fetcher) -> None:
        spy = SpyFetcher(fetcher)
        reader = Reader(env.tree, spy, readahead=2, advise_ahead=3,  # type: ignore[arg-type]
                        first_ahead=0,  # the first touch queues nothing (tested below)
                        stream_ahead=4 * CHUNK)
        inode = inode_of(env.tree, "big")
        await reader.read(inode, 5 * CHUNK, 100)  # a random read: no read-ahead
        assert spy.scheduled == []
        for offset in range(0, 4 * CHUNK, CHUNK // 2):  # sequential from the start
            await reader.read(inode, offset, CHUNK // 2)
        batches = [[digests.index(loc.digest) for loc in batch] for batch in spy.scheduled]
        # In chunk 0: 2 ahead; into chunk 1: 4 ahead (to 5); then 4 ahead (the cap), topped up
        # once no more than half of that is queued: in chunk 3, with 4 and 5 left.
        assert batches == [[1, 2], [3, 4, 5], [6, 7]]
        assert all(spy.streams)
        # The cache file one chunk past the first window (three ahead) is advised, once.
        advised = [loc.digest for batch in spy.advised for loc in batch]
        assert advised == digests[3:4]

    run_with_fetcher(env, tmp_path / "cache", body)


def test_a_long_sequential_read_reaches_the_stream_bound(
    env: LoadedEnv, tmp_path: Path
) -> None:
    """With the default bound far off, the window doubles at each chunk: by the third chunk
    read the rest of the 11-chunk file is queued; a first touch mid-file starts no stream."""
    index, ino = env.tree.file(inode_of(env.tree, "big"))
    digests = [index.chunk(n).digest for n in index.file_chunks(ino)]

    async def body(fetcher: Fetcher) -> None:
        spy = SpyFetcher(fetcher)
        reader = Reader(env.tree, spy, first_ahead=0)  # type: ignore[arg-type]
        inode = inode_of(env.tree, "big")
        for offset in (0, CHUNK, 2 * CHUNK):
            await reader.read(inode, offset, CHUNK)
        queued = [digests.index(loc.digest) for batch in spy.scheduled for loc in batch]
        assert queued == list(range(2, 11))  # 2..5 (4 after chunk 1), then 6..10 (8)
        assert len(spy.scheduled) == 2
        await reader.read(inode_of(env.tree, "exact"), CHUNK, 10)  # first touch, mid-file
        assert len(spy.scheduled) == 2

    run_with_fetcher(env, tmp_path / "cache", body)


def test_cached_sequential_reads_advise_ahead_as_reads_do(env: LoadedEnv, tmp_path: Path) -> None:
    """A reader served by `read_cached` (everything verified) keeps its read-ahead: the
    cached files ahead of a sequential reader are advised exactly as for `read`."""
    index, ino = env.tree.file(inode_of(env.tree, "big"))
    digests = [index.chunk(n).digest for n in index.file_chunks(ino)]

    async def body(fetcher: Fetcher) -> None:
        big = inode_of(env.tree, "big")
        data = await Reader(env.tree, fetcher).read(big, 0, 11 * CHUNK)  # all verified now
        spies = []
        for cached in (False, True):
            spy = SpyFetcher(fetcher)
            reader = Reader(env.tree, spy, readahead=2, advise_ahead=3,  # type: ignore[arg-type]
                            first_ahead=0, stream_ahead=4 * CHUNK)
            for offset in range(0, 4 * CHUNK, CHUNK // 2):
                if cached:
                    got = reader.read_cached(big, offset, CHUNK // 2)
                else:
                    got = await reader.read(big, offset, CHUNK // 2)
                assert got == data[offset:offset + CHUNK // 2]
            spies.append(spy)
        by_read, by_cached = spies
        assert by_cached.scheduled == by_read.scheduled and by_cached.scheduled
        advised = [loc.digest for batch in by_cached.advised for loc in batch]
        assert advised == digests[3:4]
        assert by_cached.advised == by_read.advised

    run_with_fetcher(env, tmp_path / "cache", body)


def test_the_first_read_of_a_file_queues_the_rest_of_it(
    env: LoadedEnv, tmp_path: Path
) -> None:
    """Demand overlap without a hint: touching a multi-chunk file queues its other chunks
    (after the read first), bounded by `first_ahead`, once; single-chunk files queue nothing."""
    index, ino = env.tree.file(inode_of(env.tree, "big"))
    digests = [index.chunk(n).digest for n in index.file_chunks(ino)]
    assert len(digests) == 11

    async def body(fetcher: Fetcher) -> None:
        spy = SpyFetcher(fetcher)
        reader = Reader(env.tree, spy, readahead=2, advise_ahead=3,  # type: ignore[arg-type]
                        first_ahead=4 * CHUNK)
        big = inode_of(env.tree, "big")
        await reader.read(big, 0, 100)
        assert [[loc.digest for loc in batch] for batch in spy.scheduled] == [digests[1:5]]
        await reader.read(big, 6 * CHUNK, 100)  # the file is known now: no second burst
        assert len(spy.scheduled) == 1
        exact = inode_of(env.tree, "exact")  # 3 chunks, first touched in the middle
        exact_index, exact_ino = env.tree.file(exact)
        exact_digests = [exact_index.chunk(n).digest for n in exact_index.file_chunks(exact_ino)]
        await reader.read(exact, CHUNK + 5, 10)
        assert [loc.digest for loc in spy.scheduled[1]] == [exact_digests[2], exact_digests[0]]
        await reader.read(inode_of(env.tree, "small/03"), 0, 10)  # one (batch) chunk
        await reader.read(inode_of(env.tree, "one"), 0, 1)
        assert len(spy.scheduled) == 2

    run_with_fetcher(env, tmp_path / "cache", body)


def test_the_rest_of_a_file_is_fetched_in_the_background(
    env: LoadedEnv, tmp_path: Path
) -> None:
    """The queued chunks really reach the cache without being read (the real fetcher)."""
    index, ino = env.tree.file(inode_of(env.tree, "big"))
    locs = [index.chunk(n) for n in index.file_chunks(ino)]
    cache_dir = tmp_path / "cache"

    async def body(fetcher: Fetcher) -> None:
        reader = Reader(env.tree, fetcher, first_ahead=4 * CHUNK)
        await reader.read(inode_of(env.tree, "big"), 0, 100)
        with trio.fail_after(30):
            while not all(fetcher.cache.contains(loc.digest) for loc in locs[1:5]):
                await trio.sleep(0.01)
        assert not fetcher.cache.contains(locs[5].digest)

    run_with_fetcher(env, cache_dir, body)


def test_reading_a_directory_or_symlink_fails(env: LoadedEnv, tmp_path: Path) -> None:
    async def body(fetcher: Fetcher) -> None:
        reader = Reader(env.tree, fetcher)
        with pytest.raises(IsADirectoryError):
            await reader.read(inode_of(env.tree, "small"), 0, 10)

    run_with_fetcher(env, tmp_path / "cache", body)
