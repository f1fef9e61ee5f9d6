"""A store in a local directory: key `a/b/c` is the file `<root>/a/b/c`.

Owns: crash-safe writes (temp file in the target's directory, fsync, rename, fsync of the
directory), translating OSError into the store errors, and cleaning up stale temp files.
Must not: cache, retry (see retry.py) or know what the objects mean. The layout on disk is the
key layout itself, so a directory written here can be served as-is by a static HTTP server.

Limits, by design: a key cannot also be a "directory" of other keys (`tags/a` and `tags/a/b`
cannot both exist, unlike on S3); directories left empty by `delete` stay; symlinks inside the
root are followed only when they resolve inside it (checked per call, so a link swapped
between the check and the use is not caught: the root must be trusted).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from weenvfs.errors import ObjectMissing, ObjectTooLarge, StoreError, StoreUnavailable
from weenvfs.store.base import TEMP_PREFIX, Store, validate_key, validate_prefix

log = logging.getLogger(__name__)

# Errors that may pass on their own (network filesystems, signals); everything else is
# permanent for a local directory, so retrying it would only delay the failure.
_TEMPORARY_ERRNOS = frozenset(
    {errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.EIO}
)
_COPY_BUFFER = 1 << 20

# Fills a temp file, given its open descriptor.
_Fill = Callable[[int], None]


class LocalStore(Store):
    """Objects as files under `root`.

    With `create=True` the root directory (and its parents) is made if missing; with
    `create=False` (the default, for readers) a missing root is reported by `check()` and by
    every operation as StoreUnavailable, never as a missing object.
    """

    cheap_requests = True

    def __init__(self, root: Path | str, create: bool = False) -> None:
        self._given = Path(root).absolute()
        if create:
            try:
                self._given.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise self._unavailable(f"cannot create {self._given}", e) from None
        # Resolved once, so a root reached through a symlink still contains its objects.
        self._root = os.path.realpath(self._given)

    @property
    def url(self) -> str:
        """`file://` URL of the root, as given (before resolving symlinks)."""
        return self._given.as_uri()

    @property
    def root(self) -> Path:
        """The store's directory, symlinks resolved."""
        return Path(self._root)

    # -- reading -------------------------------------------------------------------------

    def local_file(self, key: str) -> str | None:
        """See `Store.local_file`: the key's file under the root (checked as every read is)."""
        try:
            return self._path(key)
        except StoreError:
            return None

    def get(self, key: str, limit: int | None = None) -> bytes:
        """See `Store.get`; with a `limit`, the file's size is checked before any read."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if limit is None:
                    return f.read()
                size = os.fstat(f.fileno()).st_size
                if size > limit:
                    raise ObjectTooLarge(key, self.url, limit, size)
                data = _read_capped(f, size, limit)
        except OSError as e:
            raise self._error("get", key, e) from None
        if len(data) > limit:  # grown since the fstat (a foreign writer: ours rename)
            raise ObjectTooLarge(key, self.url, limit)
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """See `Store.get_range`; one `pread` loop on a file descriptor."""
        if offset < 0 or length < 0:
            raise ValueError(f"negative range: offset={offset} length={length}")
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise self._error("get_range", key, e) from None
        try:
            data = self._pread_exact(fd, key, offset, length)
        except OSError as e:
            raise self._error("get_range", key, e) from None
        finally:
            os.close(fd)
        return data

    def _pread_exact(self, fd: int, key: str, offset: int, length: int) -> bytes:
        """Read `length` bytes at `offset`, or raise StoreError if the file ends first."""
        parts: list[bytes] = []
        done = 0
        while done < length:
            part = os.pread(fd, length - done, offset + done)
            if not part:
                break
            parts.append(part)
            done += len(part)
        size = os.fstat(fd).st_size
        if done < length or offset > size:
            raise StoreError(
                f"object {key!r} in {self.url} is {size} bytes, "
                f"shorter than the requested range {offset}+{length}"
            )
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def exists(self, key: str) -> bool:
        """See `Store.exists`."""
        path = self._path(key)
        if os.path.isfile(path):
            return True
        self._raise_if_root_gone()
        return False

    def size(self, key: str) -> int:
        """See `Store.size`."""
        path = self._path(key)
        try:
            st = os.stat(path)
        except OSError as e:
            raise self._error("size", key, e) from None
        if not stat.S_ISREG(st.st_mode):
            raise self._missing(key)
        return st.st_size

    def list(self, prefix: str = "") -> Iterator[str]:
        """See `Store.list`. Walks only the directories the prefix can match, in key order;
        skips temp files, names that are not valid keys, and symlinked directories."""
        validate_prefix(prefix)
        self._raise_if_root_gone()
        head, _, _ = prefix.rpartition("/")
        start = os.path.join(self._root, head) if head else self._root
        return self._walk(start, head + "/" if head else "", prefix)

    def _walk(self, dirpath: str, keypath: str, prefix: str) -> Iterator[str]:
        """Yield the keys under `dirpath` (whose keys begin with `keypath`) matching `prefix`."""
        try:
            with os.scandir(dirpath) as it:
                entries = [e for e in it if not e.name.startswith(TEMP_PREFIX)]
        except (FileNotFoundError, NotADirectoryError):
            return  # nothing under this prefix, or it vanished during the walk
        except OSError as e:
            raise self._error("list", keypath or prefix, e) from None
        # Sorting a directory's children by "name/" (and files by "name") yields the keys in
        # exact string order, e.g. "a-b" < "a/x" because "-" < "/".
        tagged = [(e.name + "/" if _is_real_dir(e) else e.name, e) for e in entries]
        for name, entry in sorted(tagged, key=lambda t: t[0]):
            key = keypath + name
            if name.endswith("/"):
                if key.startswith(prefix) or prefix.startswith(key):
                    yield from self._walk(entry.path, key, prefix)
            elif key.startswith(prefix) and self._listable(entry, key):
                yield key

    def _listable(self, entry: os.DirEntry[str], key: str) -> bool:
        """Whether a file entry is an object `get` would serve."""
        try:
            validate_key(key)
            if not entry.is_file():
                return False
        except (StoreError, OSError):
            return False
        return not entry.is_symlink() or self._inside(os.path.realpath(entry.path))

    # -- writing -------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """See `Store.put`."""
        view = memoryview(data).cast("B")
        self._write_atomically(key, lambda fd: _write_all(fd, view))

    def put_file(self, key: str, path: Path | str) -> None:
        """See `Store.put_file`; copies the file in 1 MiB pieces, never whole in memory."""
        with open(path, "rb") as src:  # OSError here is the caller's, not the store's
            self._write_atomically(key, lambda fd: _copy_into(src, fd))

    def _write_atomically(self, key: str, fill: _Fill) -> None:
        """Write a temp file beside the target with `fill`, make it durable, rename it over
        the target and make the rename durable."""
        path = self._path(key)
        parent = os.path.dirname(path)
        self._make_dirs(key, parent)
        tmp = os.path.join(parent, TEMP_PREFIX + secrets.token_hex(8))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                fill(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_dir(parent)
        except BaseException as e:
            _unlink_quietly(tmp)
            if isinstance(e, OSError):
                raise self._put_error(key, e) from None
            raise

    def _make_dirs(self, key: str, parent: str) -> None:
        """Create the directories between the root and `parent`, never the root itself."""
        if os.path.isdir(parent):
            return
        self._raise_if_root_gone()
        current = self._root
        for segment in os.path.relpath(parent, self._root).split(os.sep):
            current = os.path.join(current, segment)
            try:
                os.mkdir(current)
                _fsync_dir(os.path.dirname(current))
            except FileExistsError:
                if not os.path.isdir(current):
                    raise self._conflict(key) from None
                # made earlier, or by a concurrent writer
            except OSError as e:
                raise self._put_error(key, e) from None

    def delete(self, key: str) -> None:
        """See `Store.delete`. Not fsynced: a delete undone by a crash is redone by gc."""
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            self._raise_if_root_gone()
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.EPERM) and os.path.isdir(path):
                return  # a directory of other keys, not an object: nothing to delete
            raise self._error("delete", key, e) from None

    # -- maintenance -----------------------------------------------------------------------

    def check(self, write: bool = False) -> None:
        """See `Store.check`. With `write=True` creates and removes a probe temp file."""
        if not os.path.exists(self._root):
            raise self._root_missing()
        if not os.path.isdir(self._root):
            raise StoreUnavailable(f"store {self.url}: not a directory", temporary=False)
        try:
            with os.scandir(self._root) as it:
                next(it, None)
        except OSError as e:
            raise self._unavailable("cannot read", e) from None
        if write:
            probe = os.path.join(self._root, TEMP_PREFIX + "check-" + secrets.token_hex(8))
            try:
                os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                os.unlink(probe)
            except OSError as e:
                raise self._unavailable("not writable", e) from None

    def stale_temp(self, max_age: float = 3600.0) -> list[tuple[str, int]]:
        """Temp files (left by crashed writers) older than `max_age` seconds, as (path relative
        to the root, size). Younger ones may belong to a write in progress."""
        cutoff = time.time() - max_age
        out = []
        for dirpath, dirnames, filenames in os.walk(self._root):
            dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX)]
            for name in filenames:
                if name.startswith(TEMP_PREFIX) and _older_than(dirpath, name, cutoff):
                    path = os.path.join(dirpath, name)
                    try:
                        size = os.lstat(path).st_size
                    except OSError:
                        continue  # renamed or removed meanwhile
                    out.append((os.path.relpath(path, self._root), size))
        return sorted(out)

    def cleanup_temp(self, max_age: float = 3600.0) -> int:
        """Remove temp files (left by crashed writers) older than `max_age` seconds.

        Younger ones may belong to a write in progress and are kept. Returns how many were
        removed. Safe to run while other processes read and write the store.
        """
        removed = 0
        for rel, _size in self.stale_temp(max_age):
            removed += _unlink_quietly(os.path.join(self._root, rel))
        if removed:
            log.info("store %s: removed %d stale temp files", self.url, removed)
        return removed

    # -- paths and errors ------------------------------------------------------------------

    def _path(self, key: str) -> str:
        """The file for `key`, after validating it and refusing symlinks out of the root."""
        path = os.path.join(self._root, validate_key(key))
        real = os.path.realpath(path)
        if real != path and not self._inside(real):
            raise StoreError(f"store key {key!r} resolves outside {self.url} through a symlink")
        return path

    def _inside(self, real: str) -> bool:
        return real == self._root or real.startswith(self._root + os.sep)

    def _raise_if_root_gone(self) -> None:
        if not os.path.isdir(self._root):
            raise self._root_missing()

    def _error(self, op: str, key: str, err: OSError) -> StoreError:
        """Translate an OSError from `op` on `key` into the store's errors."""
        if isinstance(err, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
            if not os.path.isdir(self._root):
                return self._root_missing()
            return self._missing(key)
        temporary = err.errno in _TEMPORARY_ERRNOS
        return StoreUnavailable(
            f"store {self.url}: {op} {key!r} failed: {err.strerror or err}", temporary=temporary
        )

    def _put_error(self, key: str, err: OSError) -> StoreError:
        """Translate an OSError from writing `key`; "not found" there is never ObjectMissing."""
        if isinstance(err, IsADirectoryError):
            return self._conflict(key)
        if isinstance(err, (FileNotFoundError, NotADirectoryError)):
            if not os.path.isdir(self._root):
                return self._root_missing()
            # Another process removed or replaced a directory on the way: trying again helps.
            return StoreUnavailable(
                f"store {self.url}: put {key!r} failed: a directory changed during the write",
                temporary=True,
            )
        return self._error("put", key, err)

    def _missing(self, key: str) -> ObjectMissing:
        return ObjectMissing(key, self.url)

    def _conflict(self, key: str) -> StoreError:
        return StoreError(
            f"store key {key!r} conflicts with an existing key in {self.url}: a key cannot "
            "also be a directory of other keys"
        )

    def _root_missing(self) -> StoreUnavailable:
        if os.path.exists(self._root):  # a file, or a dangling link: what `check` says
            return StoreUnavailable(f"store {self.url}: not a directory", temporary=False)
        return StoreUnavailable(
            f"store {self.url}: directory {self._given} does not exist", temporary=False
        )

    def _unavailable(self, what: str, err: OSError) -> StoreUnavailable:
        return StoreUnavailable(
            f"store {self.url}: {what}: {err.strerror or err}",
            temporary=err.errno in _TEMPORARY_ERRNOS,
        )


def _read_capped(f: BinaryIO, size: int, limit: int) -> bytes:
    """The rest of `f`, expected to be `size` bytes, but never more than `limit + 1`."""
    data = f.read(size + 1)  # a buffered read returns fewer bytes only at the end of file
    while size < len(data) <= limit:
        more = f.read(limit + 1 - len(data))
        if not more:
            break
        data += more
    return data


def _write_all(fd: int, view: memoryview) -> None:
    """os.write until all of `view` is written (a write may be short)."""
    while view:
        view = view[os.write(fd, view) :]


def _copy_into(src: BinaryIO, fd: int) -> None:
    """Copy the open binary file `src` into the descriptor `fd`."""
    with os.fdopen(fd, "wb", closefd=False) as dst:
        shutil.copyfileobj(src, dst, _COPY_BUFFER)


def _fsync_dir(path: str) -> None:
    """Make a rename or mkdir in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> int:
    """Remove `path` if present; return 1 if it was removed, else 0."""
    try:
        os.unlink(path)
    except OSError:
        return 0
    return 1


def _older_than(dirpath: str, name: str, cutoff: float) -> bool:
    try:
        return os.lstat(os.path.join(dirpath, name)).st_mtime < cutoff
    except OSError:
        return False  # renamed or removed meanwhile


def _is_real_dir(entry: os.DirEntry[str]) -> bool:
    """A directory that is not a symlink: the walk never follows links (no cycles)."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False
