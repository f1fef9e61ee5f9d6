"""A chunk cache on a file system smaller than its size bound: it keeps a free-space margin,
and a write that hits ENOSPC evicts and retries once, else the read is served from memory.

The cache lives on a small tmpfs mounted by the test (unmounted in finally).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import trio

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import ChunkLoc
from weenvfs.core.fetcher import Fetcher

FS_BYTES = 8 << 20
CHUNK = 256 << 10


@pytest.fixture
def small_fs(tmp_path: Path, require_or_skip: Callable[[object, str], None]) -> Iterator[Path]:
    require_or_skip(os.geteuid() == 0, "mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)], check=True
    )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _read(fetcher: Fetcher, locs: Sequence[ChunkLoc]) -> bytes:
    return trio.run(fetcher.read, [(loc, 0, loc.ulen) for loc in locs])


def _random_chunks(n: int) -> list[bytes]:
    return [os.urandom(CHUNK) for _ in range(n)]  # incompressible, like real data


def test_the_cache_keeps_a_free_space_margin(small_fs: Path, put_blob, local_store) -> None:
    plains = _random_chunks(48)  # 12 MiB through an 8 MiB file system
    locs = put_blob(plains)
    cache = ChunkCache(small_fs / "cache", 1 << 30)
    fetcher = Fetcher(local_store, cache)
    for i in range(0, len(locs), 4):
        assert _read(fetcher, locs[i : i + 4]) == b"".join(plains[i : i + 4])
    # The margin is min(a few percent, 1 GiB) of the file system: here a few percent.
    assert _free(small_fs) >= FS_BYTES * 0.04, _free(small_fs)
    assert all(cache.contains(loc.digest) for loc in locs[-4:])  # still caching


def test_enospc_evicts_and_retries(small_fs: Path, put_blob, local_store) -> None:
    plains = _random_chunks(8)
    locs = put_blob(plains)
    cache = ChunkCache(small_fs / "cache", 1 << 30)
    fetcher = Fetcher(local_store, cache)
    assert _read(fetcher, locs[:4]) == b"".join(plains[:4])
    # Something else fills the file system behind the cache's back.
    ballast = small_fs / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    assert _free(small_fs) < CHUNK
    assert _read(fetcher, locs[4:5]) == plains[4]  # never EIO
    assert cache.contains(locs[4].digest)  # room was made by evicting older chunks
    assert not all(cache.contains(loc.digest) for loc in locs[:4])


def test_a_full_disk_with_nothing_to_evict_serves_from_memory(
    small_fs: Path, put_blob, local_store, assert_logs
) -> None:
    plains = _random_chunks(2)
    locs = put_blob(plains)
    cache = ChunkCache(small_fs / "cache", 1 << 30)
    with open(small_fs / "ballast", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    fetcher = Fetcher(local_store, cache)
    with assert_logs("cannot write the chunk cache .*: No space left on device", count=1):
        assert _read(fetcher, locs) == b"".join(plains)
    assert not cache.contains(locs[0].digest)
