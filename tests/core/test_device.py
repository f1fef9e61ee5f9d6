"""core/device_layout.py and core/device_reader.py without a mount: the virtual data device of
a group equals the device built by hand from the files' bytes, for random reads.

Real components: a group built by tools/builder.py (small chunks, so chunk and batch
boundaries are frequent), the real chunk cache and fetcher (test_reader.py's fixtures).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_reader import CHUNK, CONTENTS, expected_sparse, make_env, run_with_fetcher

from weenvfs.core.device_reader import DeviceReader
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.loaded_env import LoadedEnv
from weenvfs.core.reader import Reader
from weenvfs.core.tree import FormatError
from weenvfs.format.device_layout import BLOCK_SIZE, DeviceLayout
from weenvfs.store.repository import Repository


@pytest.fixture
def env(repo: Repository, build_group, open_env) -> LoadedEnv:
    return make_env(repo, build_group, open_env)


def device_image(env: LoadedEnv, layout: DeviceLayout) -> bytes:
    """The device as the layout promises it: each file at its block, zeros elsewhere."""
    index = env.tree.groups[0]
    copies = dict(CONTENTS, sparse=expected_sparse())
    out = bytearray(layout.size)
    for path, data in copies.items():
        ino = index.resolve(path.encode())
        assert ino is not None
        if data:
            start = layout.start_block(ino) * BLOCK_SIZE
            out[start:start + len(data)] = data
    return bytes(out)


def test_layout_gives_each_file_its_own_aligned_extent(env: LoadedEnv) -> None:
    index = env.tree.groups[0]
    layout = DeviceLayout(index)
    sized = {p: d for p, d in dict(CONTENTS, sparse=expected_sparse()).items() if d}
    assert layout.files == len(sized)
    assert layout.size == sum(-(-len(d) // BLOCK_SIZE) * BLOCK_SIZE for d in sized.values())
    extents = sorted(
        (layout.start_block(index.resolve(p.encode())), len(d)) for p, d in sized.items())
    for (start, size), (after, _) in zip(extents, extents[1:], strict=False):
        assert start * BLOCK_SIZE + size <= after * BLOCK_SIZE  # no overlap
    with pytest.raises(KeyError):
        layout.start_block(index.resolve(b"empty"))  # no data, no extent


def test_pieces_cover_files_and_leave_gaps_as_zeros(env: LoadedEnv) -> None:
    layout = DeviceLayout(env.tree.groups[0])
    assert layout.pieces(0, 0) == []
    assert layout.pieces(layout.size, 10) == []
    assert layout.pieces(-1, 10) == []
    whole = layout.pieces(0, layout.size)
    assert sum(p.length for p in whole) == sum(len(d) for d in CONTENTS.values()) + 12 * CHUNK
    assert [p.at for p in whole] == sorted(p.at for p in whole)


def test_random_device_reads_equal_the_device_built_by_hand(
    env: LoadedEnv, tmp_path: Path
) -> None:
    layout = DeviceLayout(env.tree.groups[0])
    expected = device_image(env, layout)
    rng = random.Random(5)
    cases = [(0, layout.size), (0, layout.size + 4096), (layout.size - 1, 10),
             (layout.size, 10)]
    cases += [(k * BLOCK_SIZE - 3, 6) for k in range(1, layout.blocks)]
    cases += [(rng.randrange(layout.size), rng.randrange(1, 256 << 10)) for _ in range(60)]

    async def body(fetcher: Fetcher) -> None:
        device = DeviceReader(layout, Reader(env.tree, fetcher), 0)
        for offset, size in cases:
            got = await device.read(offset, size)
            assert got == expected[offset:offset + size], (offset, size)

    run_with_fetcher(env, tmp_path / "cache", body)


def test_cached_reads_equal_the_device_and_count_as_reads(env: LoadedEnv, tmp_path: Path) -> None:
    layout = DeviceLayout(env.tree.groups[0])
    expected = device_image(env, layout)
    index = env.tree.groups[0]
    # Each file's block range, padding included: what the kernel asks for one file.
    ranges = [(layout.start_block(ino) * BLOCK_SIZE, -(-index.inode(ino).size // BLOCK_SIZE)
               * BLOCK_SIZE) for path, ino in index.walk()
              if index.inode(ino).is_reg and index.inode(ino).size]
    assert ranges

    async def body(fetcher: Fetcher) -> None:
        device = DeviceReader(layout, Reader(env.tree, fetcher), 0)
        served = []
        for offset, size in ranges:
            first = device.read_cached(offset, size)  # nothing verified by this process yet
            got = first if first is not None else await device.read(offset, size)
            again = device.read_cached(offset, size)  # now cached and verified
            assert got == again == expected[offset:offset + size], (offset, size)
            served.append(first is not None)
        assert not all(served)
        before = fetcher.stats.snapshot()
        for offset, size in ranges:
            assert device.read_cached(offset, size) is not None
        after = fetcher.stats.snapshot()
        # One read each, counted as `read` counts an all-cached read: hits, no misses.
        assert after["reads"] - before["reads"] >= len(ranges)
        assert after["cache_misses"] == before["cache_misses"]
        assert after["cache_hits"] > before["cache_hits"]
        # Across two files' ranges: not one file's read, so left to `read`.
        (a, asize), (b, _) = sorted(ranges)[:2]
        assert device.read_cached(a, b - a + 1) is None

    run_with_fetcher(env, tmp_path / "cache", body)


def test_a_file_shorter_than_its_index_says_is_a_format_error(
    env: LoadedEnv, tmp_path: Path
) -> None:
    layout = DeviceLayout(env.tree.groups[0])
    ino = env.tree.groups[0].resolve(b"one")

    class ShortReader:
        async def read(self, inode: int, offset: int, size: int) -> bytes:
            return b""

    async def body(fetcher: Fetcher) -> None:
        device = DeviceReader(layout, ShortReader(), 0)  # type: ignore[arg-type]
        with pytest.raises(FormatError, match="ends early"):
            await device.read(layout.start_block(ino) * BLOCK_SIZE, 1)

    run_with_fetcher(env, tmp_path / "cache", body)
