"""The node-local chunk cache: verified, decompressed chunks on local disk, shared by every
mount (every process) on the node.

Owns: the on-disk layout, atomic writes, the per-chunk cross-process locks that let one
process fetch a chunk while the others wait, verification of cached chunks, LRU eviction under
a size bound, and cleaning what crashed processes leave behind. Must not: talk to a store,
decompress, or decide what to fetch (see fetcher.py). Blocking and thread-safe; `lock_async`
is the one trio-aware entry point.

Layout under `root` (default `DEFAULT_CACHE_DIR`, or $WEENV_CACHE):

    <root>/<2 hex>/<64 hex>   a chunk's plaintext, named by its BLAKE3 digest (each of the
                              256 subfolders made with its first chunk)
    <root>/tmp/<hex>.<pid>.<random>   a chunk being written (never read)
    <root>/locks/<hex>        the per-chunk lock file of a chunk being fetched
    <root>/evict.lock         taken by the process that evicts
    <root>/usage              the bytes the last scan counted, for the next processes
                              (cache_bound.py: not every new mount scans the cache again)
    <root>/indexes/, erofs/   node files: group indexes, EROFS images, device layouts
    <root>/manifests/, refs/  node files: manifests, what tags resolved to (node_copies.py)
    <root>/logs/              mount daemons' logs
    <root>/CACHEDIR.TAG       tells backup tools to skip the folder

Crash safety without an fsync per chunk. A chunk is written to a temp file (flocked by its
writer while it is written) and renamed into place, so a `kill -9` leaves at worst a temp file,
which is never read and is removed by the next `ChunkCache` (or `prune`) once its lock is
free. A power loss may leave a renamed file empty or torn (the rename reached the disk before
the data). So a chunk file is trusted only if it was verified since the last boot: its writer
verified the bytes before writing them, and a reader that checks an older file verifies its
size, then the BLAKE3 of the whole file. That fact is recorded on the file as the xattr
`user.weenv.verified` = the kernel's boot id (/proc/sys/kernel/random/boot_id), so the next
process of the same boot (every new mount) trusts the file without reading it again, while
after a reboot (the only way a power loss can tear a file) the marker no longer matches and the
file is verified again on first use. Within a process, (digest, device, inode) of a trusted
file is remembered; a file replaced by another process has a new inode and is checked again.
Where xattrs are not supported, every process verifies each chunk on its first use instead. A
damaged file is logged, removed and treated as a miss, never served. (Residual risk: a file
damaged by hand in place, or at a reused inode number, during the boot that verified it;
crashes cannot produce that.)

One fetch per chunk across processes: the fetching process holds the chunk's lock file
(chunk_locks.py says how those locks work).

Eviction (cache_bound.py). Files are LRU-ordered by mtime, which `open` refreshes at most
once per `touch_interval`; over `max_bytes` the least recently used go first, down to 90%
of the bound, under a global lock. Eviction unlinks, and an open descriptor keeps reading the
unlinked file, so an open `ChunkHandle` is a pin that eviction can never break; chunks pinned
in the evicting process are also skipped. The node files mounts keep beside the chunks
(`indexes/`, `erofs/`) count against the same bound and are evicted in the same LRU order
(their users refresh their mtime: node_files.touch); the mount logs in `logs/` are removed
once a week old. The bound in force is lowered to what the file system has free (minus a
margin); a write that still hits ENOSPC (or EDQUOT) is the caller's cue to `make_room()` and
retry once (fetcher.py); if that fails too, the chunk is served from memory without being
cached.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import threading
import time
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from weenvfs.errors import WeenvError
from weenvfs.format.digest import digest_bytes, short

from .cache_bound import CacheBound, EvictResult, listdir
from .chunk_locks import ChunkLock, lock_file, remove_if_unlocked, wait_for_lock

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("/var/cache/weenv/chunks")
CACHE_ENV = "WEENV_CACHE"
DEFAULT_MAX_BYTES = 10 << 30
TOUCH_INTERVAL = 60.0  # seconds between mtime refreshes of one chunk (LRU resolution)
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
LOG_FOLDER = "logs"  # the mount daemons' logs: removed once untouched for LOG_KEEP seconds
LOG_KEEP = 7 * 86400
TRUST_XATTR = "user.weenv.verified"  # value: the boot id of the boot that verified the file
# `ChunkCache.open_cost` answers: no file, no data read, or the whole file read and hashed.
MISSING, CHEAP, HASHES = "missing", "cheap", "hashes"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file marks the WeEnv chunk cache; backup tools may skip this folder.\n"
)


def default_cache_dir() -> Path:
    """$WEENV_CACHE if set, else DEFAULT_CACHE_DIR."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR)


class ChunkHandle:
    """An open, verified cached chunk. The descriptor keeps its data: eviction may unlink the
    file, reads through the handle still return it. A pinned handle also keeps this process's
    eviction away from the file while it is open. Close it (or use `with`)."""

    __slots__ = ("_cache", "_fd", "_pinned", "digest", "size")

    def __init__(self, cache: ChunkCache, fd: int, digest: bytes, size: int,
                 pinned: bool = True) -> None:
        self._cache = cache
        self._fd = fd
        self._pinned = pinned
        self.digest = digest
        self.size = size

    def fileno(self) -> int:
        """The open descriptor (valid until `close`)."""
        return self._fd

    def linked(self) -> bool:
        """Whether the file is still in the cache (not evicted or pruned since it was opened)."""
        return self._fd >= 0 and os.fstat(self._fd).st_nlink > 0

    def read(self, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of the chunk's plaintext (clipped to the chunk)."""
        end = self.size if end is None else min(end, self.size)
        parts, pos = [], start
        while pos < end:
            part = os.pread(self._fd, end - pos, pos)
            if not part:  # only if someone truncated the file in place: never serve less
                raise OSError(errno.EIO, f"cached chunk {short(self.digest)} shrank while open")
            parts.append(part)
            pos += len(part)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def close(self) -> None:
        """Release the pin. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if self._pinned:
                self._cache._unpin(self.digest)

    def __enter__(self) -> ChunkHandle:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# Made with the cache. The 256 chunk subfolders are made as their first chunk comes
# (`insert`): making them all took a new node's first mount ~20 ms before it could serve.
_SUBFOLDERS = ("tmp", "locks")
_CACHE_NAMES = frozenset((*_SUBFOLDERS, "CACHEDIR.TAG"))


class ChunkCache(CacheBound):
    """Verified chunk plaintexts under `root`, bounded to about `max_bytes`.

    `create=True` (mounts) makes the folders if needed and removes what crashed processes
    left; `create=False` (`weenv cache stats`) opens an existing cache without changing it
    and raises WeenvError if there is none. Raises WeenvError if the folder is unusable.
    """

    def __init__(
        self,
        root: Path | str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        create: bool = True,
        touch_interval: float = TOUCH_INTERVAL,
        boot_id: bytes | None = None,
    ) -> None:
        self.root = Path(root).absolute()
        self.max_bytes = max_bytes
        self.touch_interval = touch_interval
        self._root = str(self.root)
        self._tmp = os.path.join(self._root, "tmp")
        self._locks = os.path.join(self._root, "locks")
        self._mutex = threading.Lock()
        self._verified: dict[bytes, tuple[int, int]] = {}
        self._pins: Counter[bytes] = Counter()
        self._estimate: int | None = None  # bytes, from the last scan plus own inserts
        self._added = 0  # bytes inserted since the last scan
        self._bound = max_bytes  # max_bytes, lowered by the free space at the last scan
        # What a file verified in this boot carries in TRUST_XATTR (b"": no markers at all).
        self._boot = current_boot_id() if boot_id is None else boot_id
        self._setup(create)
        if create:
            cleaned = self.clean()
            if cleaned:
                log.info(
                    "chunk cache %s: removed %d file(s) left by crashed processes",
                    self.root,
                    cleaned,
                )

    def _setup(self, create: bool) -> None:
        if not create:
            if not os.path.isdir(self._locks):
                raise WeenvError(f"no chunk cache at {self.root}")
            return
        try:
            # One listing instead of the mkdir calls when the cache is made already (every
            # mount daemon opens it).
            with contextlib.suppress(FileNotFoundError):
                if set(os.listdir(self._root)) >= _CACHE_NAMES:
                    return
            for sub in _SUBFOLDERS:
                os.makedirs(os.path.join(self._root, sub), exist_ok=True)
            tag = os.path.join(self._root, "CACHEDIR.TAG")
            if not os.path.exists(tag):
                Path(tag).write_text(_CACHEDIR_TAG)
        except OSError as e:
            raise WeenvError(f"cannot use chunk cache {self.root}: {e.strerror}") from None

    def path(self, digest: bytes) -> Path:
        """Where the chunk `digest` is (or would be) cached."""
        return Path(self._chunk_path(digest.hex()))

    def _chunk_path(self, hexd: str) -> str:
        return f"{self._root}/{hexd[:2]}/{hexd}"

    # -- reading ------------------------------------------------------------------------------

    def trust_marker(self) -> tuple[str, bytes]:
        """(cache folder, marker): a file `<folder>/<hex[:2]>/<hex>` whose TRUST_XATTR equals
        the marker was verified in this boot, so `open` trusts it (b"": nothing is trusted).
        For a reader of cached chunks outside this process, which must trust what this cache
        trusts and nothing more (fuse/native_devices.py)."""
        return self._root, self._boot

    def is_verified(self, digest: bytes) -> bool:
        """True if this process already verified (or wrote) `digest`, so `open` is cheap."""
        return digest in self._verified

    def open_cost(self, digest: bytes) -> str:
        """What `open(digest)` would do, for deciding whether to run it in a thread: MISSING
        (no file: it returns None at once), CHEAP (verified by this process, or in this boot
        by any process: it reads no data) or HASHES (it reads and hashes the whole file). One
        getxattr at most; the file may come or go right after, which `open` handles."""
        if digest in self._verified:
            return CHEAP
        path = self._chunk_path(digest.hex())
        if not self._boot:
            return HASHES if os.path.exists(path) else MISSING
        try:
            return CHEAP if os.getxattr(path, TRUST_XATTR) == self._boot else HASHES
        except FileNotFoundError:
            return MISSING
        except OSError:
            return HASHES

    def contains(self, digest: bytes) -> bool:
        """Whether a file for `digest` exists (not verified: a hint for prefetch only)."""
        return os.path.exists(self._chunk_path(digest.hex()))

    def advise(self, digest: bytes) -> bool:
        """Ask the kernel to read the cached chunk `digest` into memory in the background
        (read-ahead across chunk files); False if it is not cached."""
        try:
            fd = os.open(self._chunk_path(digest.hex()), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # only a hint
        finally:
            os.close(fd)
        return True

    def open(self, digest: bytes, ulen: int, *, pin: bool = True) -> ChunkHandle | None:
        """A handle on the cached chunk `digest` of `ulen` bytes, or None if it is not cached;
        pinned (not evicted by this process while open) unless `pin` is False.

        The first use of a file not verified in this boot reads and hashes the whole file (run
        it in a thread for big chunks, when `open_cost` says HASHES); a damaged file is
        removed, logged and reported as None.
        """
        path = self._chunk_path(digest.hex())
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("cannot open cached chunk %s: %s", short(digest), e.strerror)
            return None
        try:
            usable = self._check(fd, path, digest, ulen)
        except OSError as e:
            log.warning("cannot read cached chunk %s: %s", short(digest), e.strerror or e)
            usable = False
        except BaseException:
            os.close(fd)
            raise
        if not usable:
            os.close(fd)
            return None
        if pin:
            with self._mutex:
                self._pins[digest] += 1
        return ChunkHandle(self, fd, digest, ulen, pin)

    def _check(self, fd: int, path: str, digest: bytes, ulen: int) -> bool:
        """Verify (once per file and process) and refresh the LRU time of an open chunk."""
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        if st.st_size != ulen:
            self._discard(path, ident, digest, f"{st.st_size} bytes, expected {ulen}")
            return False
        if self._verified.get(digest) != ident:
            if not self._marked(fd):
                if digest_bytes(os.pread(fd, ulen, 0) if ulen else b"") != digest:
                    self._discard(path, ident, digest, "content does not match its digest")
                    return False
                self._mark(fd)
            self._verified[digest] = ident
        if time.time() - st.st_mtime > self.touch_interval:
            with contextlib.suppress(OSError):  # read-only or foreign files: LRU is best effort
                os.utime(fd)
        return True

    def _marked(self, fd: int) -> bool:
        """Whether the open file carries this boot's trust marker."""
        if not self._boot:
            return False
        try:
            return os.getxattr(fd, TRUST_XATTR) == self._boot
        except OSError:
            return False

    def _mark(self, fd: int) -> None:
        """Record on the open file that it was verified in this boot (best effort: without
        xattr support, or on a file of another user, later processes verify it again)."""
        if not self._boot:
            return
        try:
            os.setxattr(fd, TRUST_XATTR, self._boot)
        except OSError as e:
            if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                self._boot = b""  # this file system has no xattrs: stop trying
                log.info("chunk cache %s: no xattrs, chunks are verified by every process",
                         self.root)

    def _discard(self, path: str, ident: tuple[int, int], digest: bytes, why: str) -> None:
        log.warning("cached chunk %s is damaged (%s); removing it", short(digest), why)
        self._verified.pop(digest, None)
        with contextlib.suppress(OSError):
            st = os.stat(path)
            # Only the file we checked: another process may have just replaced it.
            if (st.st_dev, st.st_ino) == ident:
                os.unlink(path)

    def _unpin(self, digest: bytes) -> None:
        with self._mutex:
            self._pins[digest] -= 1
            if self._pins[digest] <= 0:
                del self._pins[digest]

    # -- writing ------------------------------------------------------------------------------

    def insert(self, digest: bytes, plain: bytes | memoryview) -> None:
        """Store `plain`, which the caller has verified against `digest`, atomically.

        Raises OSError if the cache cannot be written (the caller may still serve `plain`).
        """
        hexd = digest.hex()
        tmp = os.path.join(self._tmp, f"{hexd}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            # The lock marks the temp file as live; clean() removes only unlocked ones.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_all(fd, memoryview(plain))
            self._mark(fd)  # the caller verified these bytes, in this boot
            st = os.fstat(fd)
            path = self._chunk_path(hexd)
            try:
                os.rename(tmp, path)
            except FileNotFoundError:  # the subfolder's first chunk (see _SUBFOLDERS)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self._verified[digest] = (st.st_dev, st.st_ino)
        self.note_inserted(len(plain))

    def note_inserted(self, nbytes: int) -> None:
        """Count a chunk of `nbytes` inserted (here, or by another program for this process:
        fuse/native_devices.py) toward the size bound."""
        with self._mutex:
            self._added += nbytes
            if self._estimate is not None:
                self._estimate += nbytes

    # -- cross-process locks ------------------------------------------------------------------

    def try_lock(self, digest: bytes) -> ChunkLock | None:
        """The fetch lock of `digest` if no other holder has it, else None."""
        return self._lock(digest, blocking=False)

    def lock(self, digest: bytes) -> ChunkLock:
        """The fetch lock of `digest`, waiting for the current holder (blocks the thread)."""
        lock = self._lock(digest, blocking=True)
        assert lock is not None
        return lock

    async def lock_async(self, digest: bytes) -> ChunkLock:
        """`lock` for trio: waits in a worker thread, cancellable at any time."""
        lock = self.try_lock(digest)
        if lock is not None:
            return lock
        return await wait_for_lock(lambda: self.lock(digest))

    def _lock(self, digest: bytes, blocking: bool) -> ChunkLock | None:
        return lock_file(os.path.join(self._locks, digest.hex()), blocking)

    # -- housekeeping -------------------------------------------------------------------------

    def clean(self) -> int:
        """Remove temp files and lock files whose owner is gone (their flock is free), and
        mount logs untouched for LOG_KEEP seconds."""
        removed = 0
        for folder in (self._tmp, self._locks):
            for name in listdir(folder):
                removed += remove_if_unlocked(os.path.join(folder, name))
        logs = os.path.join(self._root, LOG_FOLDER)
        old = time.time() - LOG_KEEP
        for name in listdir(logs):
            path = os.path.join(logs, name)
            with contextlib.suppress(OSError):
                if os.stat(path).st_mtime < old:
                    os.unlink(path)
                    removed += 1
        return removed

    def prune(self, max_bytes: int | None = None, *, everything: bool = False) -> EvictResult:
        """Clean leftovers, then evict down to `max_bytes` (default: the bound), or remove
        every chunk with `everything` (safe under live mounts: open handles keep reading,
        anything else is fetched again)."""
        self.clean()
        target = 0 if everything else (self.max_bytes if max_bytes is None else max_bytes)
        result = self.evict(target, wait=True)
        assert result is not None
        return result

    def close(self) -> None:
        """Forget in-process state (open handles stay valid until closed)."""
        self._verified.clear()


def current_boot_id() -> bytes:
    """This boot's id (changes at every boot), or b"" where the kernel does not tell."""
    try:
        return _BOOT_ID.read_bytes().strip()
    except OSError:
        return b""


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


