"""The pyfuse3 adapter with a fake core: the errno table of `@errno_boundary`, pinned.

No mount: operations are called directly (pyfuse3's types work without a session). The fake
core raises whatever a test asks for, so every row of the table in fuse/errno_map.py is
checked, including that chunk errors are left to the fetcher's own log line and that a
damaged index record is logged once however often it is read.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
import pytest
import trio

from weenvfs.core.tree import ROOT_INODE, Attr, FormatError
from weenvfs.errors import ChunkCorrupt, ChunkUnavailable, StoreUnavailable
from weenvfs.fuse import STATS_XATTR
from weenvfs.fuse.ops import TIMEOUT, Operations

FILE = Attr(7, 0o100644, 1, 1, 2, 0, 10, 1, 123_456_789_012_345_678)


class FakeTree:
    """Answers for inode 7 only, or raises `error` from every call."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def attr(self, inode: int) -> Attr:
        self._check()
        if inode != FILE.inode:
            raise FileNotFoundError(errno.ENOENT, "no such inode")
        return FILE

    def lookup(self, parent: int, name: bytes) -> Attr:
        self._check()
        if name != b"f":
            raise FileNotFoundError(errno.ENOENT, "no such entry")
        return FILE

    def file(self, inode: int) -> tuple[Any, int]:
        self._check()
        return None, inode

    def readlink(self, inode: int) -> bytes:
        self._check()
        raise OSError(errno.EINVAL, "not a symlink")

    def xattrs(self, inode: int) -> list[tuple[bytes, bytes]]:
        self._check()
        return [(b"user.a", b"1")]

    def getxattr(self, inode: int, name: bytes) -> bytes:
        self._check()
        raise OSError(errno.ENODATA, "no attribute")


class FakeReader:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def read_cached(self, inode: int, offset: int, size: int) -> bytes | None:
        return None  # nothing cached: every read takes the async path

    async def read(self, inode: int, offset: int, size: int) -> bytes:
        if self.error is not None:
            raise self.error
        return b"x" * size


def ops(error: BaseException | None = None, read_error: BaseException | None = None) -> Operations:
    return Operations(FakeTree(error), FakeReader(read_error),  # type: ignore[arg-type]
                      stats=lambda: {"fetch": {"chunks_fetched": 3}})


def call(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return trio.run(fn, *args)


def errno_of(fn: Callable[..., Awaitable[Any]], *args: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as info:
        trio.run(fn, *args)
    return info.value.errno


def test_attributes_are_converted_with_long_timeouts() -> None:
    attrs = call(ops().lookup, ROOT_INODE, b"f", None)
    assert (attrs.st_ino, attrs.st_mode, attrs.st_size, attrs.st_uid, attrs.st_gid) == (
        7, 0o100644, 10, 1, 2)
    assert attrs.st_mtime_ns == attrs.st_ctime_ns == 123_456_789_012_345_678
    assert attrs.entry_timeout == attrs.attr_timeout == TIMEOUT >= 3600


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (FileNotFoundError(errno.ENOENT, "x"), errno.ENOENT),
        (NotADirectoryError(errno.ENOTDIR, "x"), errno.ENOTDIR),
        (OSError(errno.EINVAL, "x"), errno.EINVAL),
        (ChunkUnavailable("ab" * 32, "timed out"), errno.EIO),
        (ChunkCorrupt("cd" * 32, "digest mismatch"), errno.EIO),
        (StoreUnavailable("store gone"), errno.EIO),
        (FormatError("inode 3", "bad record"), errno.EIO),
    ],
)
def test_domain_errors_map_to_errnos(error: BaseException, expected: int,
                                     assert_logs: Any) -> None:
    logged = isinstance(error, FormatError | StoreUnavailable)
    with assert_logs(r"getattr: ", count=1 if logged else 0, level=logging.ERROR):
        assert errno_of(ops(error).getattr, 7, None) == expected


def test_a_damaged_record_is_logged_once(assert_logs: Any) -> None:
    adapter = ops(FormatError("inode 9", "bad"))
    with assert_logs(r"lookup: .*inode 9", count=1, level=logging.ERROR):
        for _ in range(5):
            assert errno_of(adapter.lookup, ROOT_INODE, b"f", None) == errno.EIO


def test_chunk_errors_are_not_logged_again(assert_logs: Any) -> None:
    adapter = ops(read_error=ChunkCorrupt("ef" * 32, "bad"))
    with assert_logs(r"chunk", count=0, level=logging.INFO):
        assert errno_of(adapter.read, 7, 0, 10) == errno.EIO


def test_a_bug_is_eio_with_a_traceback(assert_logs: Any) -> None:
    adapter = ops(read_error=ZeroDivisionError("oops"))
    with assert_logs(r"read failed unexpectedly", count=1, level=logging.ERROR) as records:
        assert errno_of(adapter.read, 7, 0, 10) == errno.EIO
    assert records[0].exc_info is not None


def test_cancellation_is_never_swallowed() -> None:
    class Slow(FakeReader):
        async def read(self, inode: int, offset: int, size: int) -> bytes:
            await trio.sleep_forever()
            return b""

    adapter = Operations(FakeTree(), Slow())  # type: ignore[arg-type]

    async def main() -> bool:
        with trio.move_on_after(0.01) as scope:
            await adapter.read(7, 0, 1)
        return scope.cancelled_caught

    assert trio.run(main)


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("setattr", (7, None, None, None, None)),
        ("mknod", (1, b"n", 0o644, 0, None)),
        ("mkdir", (1, b"d", 0o755, None)),
        ("unlink", (1, b"f", None)),
        ("rmdir", (1, b"d", None)),
        ("symlink", (1, b"l", b"t", None)),
        ("rename", (1, b"a", 1, b"b", 0, None)),
        ("link", (7, 1, b"h", None)),
        ("write", (7, 0, b"x")),
        ("create", (1, b"n", 0o644, os.O_WRONLY, None)),
        ("setxattr", (7, b"user.a", b"1", None)),
        ("removexattr", (7, b"user.a", None)),
    ],
)
def test_writes_are_erofs(name: str, args: tuple[Any, ...]) -> None:
    assert errno_of(getattr(ops(), name), *args) == errno.EROFS


@pytest.mark.parametrize("flags", [os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC,
                                   os.O_WRONLY | os.O_APPEND])
def test_open_for_writing_is_erofs(flags: int) -> None:
    assert errno_of(ops().open, 7, flags, None) == errno.EROFS


def test_open_read_only_keeps_the_kernel_cache() -> None:
    info = call(ops().open, 7, os.O_RDONLY, None)
    assert info.fh == 7 and info.keep_cache and not info.direct_io


def test_xattrs_and_the_hidden_stats_attribute() -> None:
    adapter = ops()
    assert call(adapter.listxattr, ROOT_INODE, None) == [b"user.a"]
    assert errno_of(adapter.getxattr, 7, b"user.none", None) == pyfuse3.ENOATTR
    stats = json.loads(call(adapter.getxattr, ROOT_INODE, STATS_XATTR, None))
    assert stats == {"fetch": {"chunks_fetched": 3}}
    assert errno_of(adapter.getxattr, 7, STATS_XATTR, None) == pyfuse3.ENOATTR  # root only


def test_readlink_of_a_file_is_einval() -> None:
    assert errno_of(ops().readlink, 7, None) == errno.EINVAL


def test_missing_names_get_negative_entries_the_kernel_caches() -> None:
    attrs = call(ops().lookup, ROOT_INODE, b"missing", None)
    assert attrs.st_ino == 0 and attrs.entry_timeout == TIMEOUT


def test_flush_is_enosys_so_the_kernel_stops_sending_it() -> None:
    assert errno_of(ops().flush, 7) == errno.ENOSYS
