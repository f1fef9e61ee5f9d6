"""The errno policy of the mount, in one place: `@errno_boundary`.

Every request handler of fuse/ops.py is wrapped by it, so no exception other than
`pyfuse3.FUSEError` ever reaches pyfuse3 (which would end the main loop). The table:

- `FUSEError`                                      -> passed through
- `OSError` with an errno (the core raises these:   -> that errno
  FileNotFoundError, NotADirectoryError, EROFS, ...)
- `ChunkUnavailable`, `ChunkCorrupt`                -> EIO; the fetcher has logged the chunk
                                                      once already, so only DEBUG here
- `FormatError` (a damaged index record),          -> EIO, logged once per distinct failure
  `StoreError` (any other store failure)              (a damaged record read by a thousand
                                                      requests makes one log line)
- anything else (a bug)                            -> EIO, logged with its traceback
- `trio.Cancelled` and other BaseExceptions        -> propagate (never swallowed)

Must not: know what the operations do.
"""

from __future__ import annotations

import errno
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import pyfuse3

from weenvfs.core.tree import FormatError
from weenvfs.errors import ChunkUnavailable, StoreError

log = logging.getLogger(__name__)

_MAX_REMEMBERED = 100_000  # distinct failures remembered for "log once"

T = TypeVar("T")


class OnceLog:
    """Logs each distinct failure (by key) once; thread-safe, bounded."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, key: str) -> bool:
        """True the first time `key` is seen."""
        with self._lock:
            if key in self._seen:
                return False
            if len(self._seen) >= _MAX_REMEMBERED:
                self._seen.clear()  # forget old failures rather than grow without bound
            self._seen.add(key)
            return True


class HasOnceLog(Protocol):
    error_log: OnceLog


def failure_key(error: BaseException) -> str:
    """What makes two failures "the same" for logging: their type and message."""
    return f"{type(error).__name__}:{error}"


def to_errno(error: Exception, once: OnceLog, op: str) -> int:
    """The errno reported for `error` raised by operation `op`, logging as the table says."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    if isinstance(error, ChunkUnavailable):  # ChunkCorrupt included
        log.debug("%s: %s", op, error)
        return errno.EIO
    if isinstance(error, FormatError | StoreError):
        # "These bytes cannot be served correctly": EIO, and one log line per failure.
        if once.first(failure_key(error)):
            log.error("%s: %s", op, error)
        return errno.EIO
    log.error("%s failed unexpectedly", op, exc_info=error)
    return errno.EIO


def errno_boundary(
    method: Callable[..., Awaitable[T]],
) -> Callable[..., Awaitable[T]]:
    """Wrap an async `Operations` method so every failure leaves as `FUSEError(errno)`."""

    @functools.wraps(method)
    async def wrapper(self: HasOnceLog, *args: Any) -> T:
        try:
            return await method(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as error:
            raise pyfuse3.FUSEError(to_errno(error, self.error_log, method.__name__)) from None

    return wrapper
