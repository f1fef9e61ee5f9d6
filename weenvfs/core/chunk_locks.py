"""The cross-process fetch lock of a chunk: one process fetches a chunk while the others wait
for it, then find it cached (core/cache.py keeps the lock files under `<cache>/locks/`).

The fetching process holds `flock(LOCK_EX)` on the chunk's lock file; others block on the same
file (in a thread), then find the chunk cached. The holder unlinks the lock file before
releasing it, and a locker that wakes on an unlinked or replaced file retries with the current
one, so lock files do not accumulate and never split into two locks. A task that holds chunk
locks never blocks on another chunk lock, which rules out deadlocks between processes. A
file whose lock nobody holds belongs to a process that died (a temp file of a killed writer,
a lock of a killed fetcher): `remove_if_unlocked` removes it.

Must not: know the cache's layout beyond the path it is given, or fetch anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import trio

# Threads blocked waiting for another process's chunk lock get their own limiter, so that many
# of them never starve trio's default thread limiter (decoding, the FUSE layer's calls).
# trio is imported on first use only: `weenv mount`'s parent process needs the cache module for
# `default_cache_dir` and must not pay trio's import (about 0.1 s of the mount budget).
_LOCK_WAITS: trio.lowlevel.RunVar[trio.CapacityLimiter] | None = None
_MAX_LOCK_WAITS = 256


class ChunkLock:
    """The cross-process fetch lock of one chunk. `release()` unlinks the lock file, then
    unlocks (see the module docstring for why that is safe)."""

    __slots__ = ("_fd", "_path")

    def __init__(self, fd: int, path: str) -> None:
        self._fd = fd
        self._path = path

    def release(self) -> None:
        """Unlink and unlock. Idempotent."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        os.close(self._fd)
        self._fd = -1


class _LockWaiter:
    """A blocking lock wait in a worker thread that the trio side may abandon at a deadline;
    if the thread gets the lock after that, it releases it at once instead of leaking it."""

    def __init__(self, lock: Callable[[], ChunkLock]) -> None:
        self._take = lock
        self._mutex = threading.Lock()
        self._abandoned = False
        self._lock: ChunkLock | None = None

    def run(self) -> ChunkLock:
        lock = self._take()
        with self._mutex:
            if self._abandoned:
                lock.release()
            else:
                self._lock = lock
        return lock

    def abandon(self) -> None:
        with self._mutex:
            self._abandoned = True
            lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


def lock_file(path: str, blocking: bool) -> ChunkLock | None:
    """The lock of the lock file `path` (made if missing); None if another holder has it and
    not `blocking`, else waits for it (blocks the thread)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if same_file(fd, path):
            return ChunkLock(fd, path)
        os.close(fd)  # the holder unlinked it while we waited: lock the current file


async def wait_for_lock(lock: Callable[[], ChunkLock]) -> ChunkLock:
    """`lock()` (a blocking wait) in a worker thread, cancellable at any time: a lock the
    thread gets after the cancellation is released at once."""
    import trio

    waiter = _LockWaiter(lock)
    try:
        return await trio.to_thread.run_sync(
            waiter.run, abandon_on_cancel=True, limiter=_lock_wait_limiter()
        )
    except BaseException:
        waiter.abandon()
        raise


def _lock_wait_limiter() -> trio.CapacityLimiter:
    """The limiter of lock-waiting threads of the current trio run (made on first use)."""
    import trio

    global _LOCK_WAITS
    if _LOCK_WAITS is None:
        _LOCK_WAITS = trio.lowlevel.RunVar("weenv_lock_waits")
    try:
        return _LOCK_WAITS.get()
    except LookupError:
        limiter = trio.CapacityLimiter(_MAX_LOCK_WAITS)
        _LOCK_WAITS.set(limiter)
        return limiter


def same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def remove_if_unlocked(path: str) -> int:
    """Unlink `path` if nobody holds its flock (its writer or fetcher died); 1 if removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return 0
    try:
        if same_file(fd, path):
            os.unlink(path)
            return 1
        return 0
    except OSError:
        return 0
    finally:
        os.close(fd)
