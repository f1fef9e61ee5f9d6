"""The one storage interface every backend implements, and key validation.

Owns: the `Store` contract (what each method promises, which error it raises) and
`validate_key`/`validate_prefix`, the single definition of a well-formed key. Must not: know
the store layout beyond "keys are relative paths" (the layout of blobs/, indexes/, ... belongs
to the format and the tools), do I/O, or import a backend library.

Keys are '/'-separated relative paths. Each segment is made of RFC 3986 *unreserved*
characters only (letters, digits, `-`, `.`, `_`, `~`): they never need percent-encoding in an
HTTP URL, are safe on every filesystem and on S3, and sort the same as str and as UTF-8 bytes,
so every backend lists in one order.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from weenvfs.errors import StoreError

# Names starting with this are a backend's half-written files; no key may look like one, so a
# listing can skip them without ever hiding a real object.
TEMP_PREFIX = ".tmp-"

# S3 limits a key to 1024 bytes and most filesystems a name to 255.
MAX_KEY_LENGTH = 1024
MAX_SEGMENT_LENGTH = 255

_SEGMENT_CHARS = re.compile(r"[A-Za-z0-9._~-]*")


def _segment_problem(segment: str) -> str | None:
    """Why `segment` cannot be a full key segment, or None if it can."""
    if not segment:
        return "empty path segment"
    if segment in (".", ".."):
        return f"segment {segment!r} is not allowed"
    if len(segment) > MAX_SEGMENT_LENGTH:
        return f"segment longer than {MAX_SEGMENT_LENGTH} characters"
    if segment.startswith(TEMP_PREFIX):
        return f"segments starting with {TEMP_PREFIX!r} are reserved for temporary files"
    return _chars_problem(segment)


def _chars_problem(text: str) -> str | None:
    """Why `text` holds a character outside the safe set, or None."""
    if _SEGMENT_CHARS.fullmatch(text):
        return None
    bad = next(c for c in text if not _SEGMENT_CHARS.fullmatch(c))
    return f"character {bad!r} is not allowed (use letters, digits, '-', '.', '_', '~')"


def _common_problem(text: str) -> str | None:
    """Checks shared by keys and prefixes: type, length, absolute path."""
    if not isinstance(text, str):
        return f"expected str, got {type(text).__name__}"
    if len(text) > MAX_KEY_LENGTH:
        return f"longer than {MAX_KEY_LENGTH} characters"
    if text.startswith("/"):
        return "absolute paths are not allowed"
    return None


def validate_key(key: str) -> str:
    """Return `key` unchanged if it is a well-formed store key, else raise StoreError.

    A key is one or more '/'-separated segments of safe characters (see the module
    docstring): no empty segment, no `.` or `..`, no leading '/', no NUL or backslash,
    nothing starting with `.tmp-`. The message names the key and the reason.
    """
    problem = _common_problem(key)
    if problem is None and key == "":
        problem = "empty key"
    if problem is None:
        problem = next(filter(None, map(_segment_problem, key.split("/"))), None)
    if problem is not None:
        raise StoreError(f"invalid store key {key!r}: {problem}")
    return key


def validate_prefix(prefix: str) -> str:
    """Return `prefix` unchanged if it may be passed to `Store.list`, else raise StoreError.

    A prefix is a string prefix of keys: '' (everything), whole segments ending in '/'
    (`tags/env/`), or whole segments then a partial last one (`blobs/ab`).
    """
    problem = _common_problem(prefix)
    if problem is None and prefix:
        *dirs, last = prefix.split("/")
        problem = next(filter(None, map(_segment_problem, dirs)), None) or _chars_problem(last)
    if problem is not None:
        raise StoreError(f"invalid store prefix {prefix!r}: {problem}")
    return prefix


class Store(ABC):
    """A flat namespace of objects addressed by key: the only way the rest of WeEnv reaches
    storage.

    Objects under `blobs/`, `indexes/`, `manifests/` and `hints/` are immutable and named by
    their digest; `tags/...` keys are small and mutable (last writer wins). Implementations are
    synchronous and thread-safe: the core calls them from worker threads, many at once.

    Errors: a missing object raises `ObjectMissing`; a store that cannot be reached raises
    `StoreUnavailable`, with `temporary=True` only when trying again may help (the retry
    wrapper relies on that flag); a malformed key and any other failure raise `StoreError`.
    Backends translate their library's exceptions into these; nothing else escapes, except
    `OSError` from reading the caller's own file in `put_file`.
    """

    # A read-only store (e.g. HTTP) refuses put/put_file/delete and check(write=True) with
    # StoreError and may not support list; everything else behaves as documented here.
    read_only: bool = False
    # A store whose requests cost about as much as a read of the local disk (a folder on this
    # machine): a cold reader gains nothing from fetching more than it waits for, and the extra
    # decompression and hashing cost it CPU (fuse/mount.py leaves out neighbourhoods).
    cheap_requests: bool = False

    def local_file(self, key: str) -> str | None:
        """The path of the file `key` is stored in when a read of it is a plain read of that
        file (a folder on this machine with nothing in front), else None. For a reader that
        reads ranges of blobs itself (the native device server, fuse/native_devices.py); the
        file may be gone by the time it is opened, which the reader handles as a miss."""
        return None

    def writer_identity(self) -> str | None:
        """A digest of what decides whether a write to this store succeeds: its URL and the
        credentials and configuration it writes with (never the secrets themselves), for a
        node's memo of the stores it wrote to lately (fuse/writable_stores.py). None where a
        probe is cheap or the credentials are not the node's (given to this store alone)."""
        return None

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL this store was opened from, for messages and logs (never credentials)."""

    @abstractmethod
    def get(self, key: str, limit: int | None = None) -> bytes:
        """Return the whole object stored under `key`.

        Raises ObjectMissing if there is none. Never returns a partially written object.
        With a `limit`, an object larger than `limit` bytes raises ObjectTooLarge, found
        from the backend's own size of the object (a file's size, a Content-Length) before
        reading any of it, or else after reading little more than `limit` bytes: a store the
        reader does not control cannot make it allocate more than the limit of the kind of
        object it asks for (SPEC.md 12.1).
        """

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return exactly `length` bytes of the object under `key`, starting at `offset`.

        The range must lie inside the object: if the object is shorter than
        `offset + length`, raise StoreError (never return fewer bytes). `length == 0` returns
        b"" for an existing object when `offset <= size`. Raises ObjectMissing if the object
        does not exist and ValueError for a negative offset or length.
        """

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store `data` (any bytes-like object) under `key`, atomically.

        Readers see either the previous object or all of `data`, never a mix or a prefix, even
        if the writer crashes midway. Concurrent puts of one key are safe: the last writer
        wins. Putting a content-addressed key again with the same bytes is a harmless no-op
        in effect, so callers may retry a put freely.
        """

    def put_file(self, key: str, path: Path | str) -> None:
        """Store the contents of the local file `path` under `key`, atomically as `put`.

        Meant for large blobs: backends should stream the file rather than hold it in memory.
        This default reads the whole file and calls `put`. Raises OSError if `path` cannot be
        read.
        """
        self.put(key, Path(path).read_bytes())

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Tell whether an object is stored under `key`.

        Raises StoreUnavailable (not False) when the store itself cannot be reached, so a
        missing store is never mistaken for a missing object.
        """

    @abstractmethod
    def size(self, key: str) -> int:
        """Return the size in bytes of the object under `key`; ObjectMissing if absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key that starts with `prefix` (a plain string prefix, as on S3).

        Keys come in ascending order, so a consumer (or the retry wrapper) can resume after
        the last key it saw. The listing is complete for keys that existed before the call
        and were not deleted during it; keys written during it may or may not appear. A
        backend's temporary or half-written objects are never listed. Raises
        StoreUnavailable if the store cannot be reached; an empty prefix lists the store.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object under `key`. Deleting a missing object is not an error."""

    @abstractmethod
    def check(self, write: bool = False) -> None:
        """Fail fast if the store is not usable; return None if it is.

        Verifies that the store exists and can be read (and written, with `write=True`),
        e.g. before a mount or a publish, so a bad URL or missing credentials are reported
        at once rather than as an I/O error halfway through a task. Raises StoreUnavailable
        (or StoreError) with a clear one-line message naming the store.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release connections and handles. The store must not be used afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
