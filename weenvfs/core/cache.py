"""The node-local chunk cache: verified, decompressed chunks on local disk, shared by every
mount (every process) on the node.

Owns: the on-disk layout, atomic writes, the per-chunk cross-process locks that let one
process fetch a chunk while the others wait, verification of cached chunks, LRU eviction under
a size bound, and cleaning what crashed processes leave behind. Must not: talk to a store,
decompress, or decide what to fetch (see fetcher.py). Blocking and thread-safe; `lock_async`
is the one trio-aware entry point.

Layout under `root` (default `DEFAULT_CACHE_DIR`, or $WEENV_CACHE):

    <root>/<2 hex>/<64 hex>   a chunk's plaintext, named by its BLAKE3 digest
    <root>/tmp/<hex>.<pid>.<random>   a chunk being written (never read)
    <root>/locks/<hex>        the per-chunk lock file of a chunk being fetched
    <root>/evict.lock         taken by the process that evicts
    <root>/indexes/, erofs/   node files: group indexes, EROFS images, device layouts
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

Eviction. Files are LRU-ordered by mtime, which `open` refreshes at most once per
`touch_interval`. Each process tracks the cache size from a scan plus what it inserted and
rescans after inserting max_bytes/8 (so other processes' writes are noticed); when over
`max_bytes` it evicts the least recently used files down to 90% of the bound, under a global
lock. Eviction unlinks, and an open descriptor keeps reading the unlinked file, so an open
`ChunkHandle` is a pin that eviction can never break; chunks pinned in the evicting process
are also skipped. The bound counts file sizes and can be exceeded briefly by writes in flight.
The node files mounts keep beside the chunks (`indexes/`, `erofs/`: NODE_FOLDERS) count
against the same bound and are evicted in the same LRU order (their users refresh their
mtime: node_files.touch); the mount logs in `logs/` are removed once a week old.

Free space. The effective bound is min(max_bytes, cached + free - margin), read from statvfs at
every rescan and eviction, where the margin is FREE_MARGIN_FRACTION of the file system or
FREE_MARGIN_MAX, whichever is smaller: a cache on a file system smaller than its bound (or
shared with other data) stops short of filling it. A write that still hits ENOSPC (or EDQUOT)
is the caller's cue to `make_room()` and retry once (fetcher.py); if that fails too, the chunk
is served from memory without being cached.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from weenvfs.errors import WeenvError
from weenvfs.format.digest import digest_bytes, short

from .chunk_locks import ChunkLock, lock_file, remove_if_unlocked, wait_for_lock

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("/var/cache/weenv/chunks")
CACHE_ENV = "WEENV_CACHE"
DEFAULT_MAX_BYTES = 10 << 30
TOUCH_INTERVAL = 60.0  # seconds between mtime refreshes of one chunk (LRU resolution)
LOW_WATER = 0.9  # eviction frees down to this fraction of max_bytes
_RESCAN_DIVISOR = 8  # rescan after inserting bound / this
_MIN_RESCAN_BYTES = 1 << 20  # but not more often than every MiB (a tiny or full disk)
FREE_MARGIN_FRACTION = 0.05  # of the file system's size, kept free ...
FREE_MARGIN_MAX = 1 << 30  # ... or this much, whichever is smaller
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
# What mounts keep next to the chunks, counted in the bound and evicted with them (LRU by
# mtime, which their users refresh as `open` does a chunk's): group indexes
# (index_cache.py), EROFS images and device layouts (kernel_image.py).
NODE_FOLDERS = ("indexes", "erofs")
LOG_FOLDER = "logs"  # the mount daemons' logs: removed once untouched for LOG_KEEP seconds
LOG_KEEP = 7 * 86400
_HEX = frozenset("0123456789abcdef")
TRUST_XATTR = "user.weenv.verified"  # value: the boot id of the boot that verified the file
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file marks the WeEnv chunk cache; backup tools may skip this folder.\n"
)


def default_cache_dir() -> Path:
    """$WEENV_CACHE if set, else DEFAULT_CACHE_DIR."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR)


@dataclass(frozen=True)
class CacheUsage:
    """What a scan of the cache found. Times are POSIX seconds (None when empty)."""

    chunks: int
    bytes: int
    temp_files: int
    lock_files: int
    oldest_use: float | None
    newest_use: float | None
    node_files: int = 0  # indexes, images and layouts (NODE_FOLDERS)
    node_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """What counts against the bound: chunks and node files."""
        return self.bytes + self.node_bytes


@dataclass(frozen=True)
class EvictResult:
    """What one eviction removed and what is left."""

    removed_chunks: int
    removed_bytes: int  # chunks' and node files'
    chunks_left: int
    bytes_left: int  # chunks' and node files'
    removed_node_files: int = 0


class ChunkHandle:
    """An open, verified cached chunk. The descriptor pins its data: eviction may unlink the
    file, reads through the handle still return it. Close it (or use `with`)."""

    __slots__ = ("_cache", "_fd", "digest", "size")

    def __init__(self, cache: ChunkCache, fd: int, digest: bytes, size: int) -> None:
        self._cache = cache
        self._fd = fd
        self.digest = digest
        self.size = size

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
            self._cache._unpin(self.digest)

    def __enter__(self) -> ChunkHandle:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class ChunkCache:
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
            for sub in ("tmp", "locks", *(f"{i:02x}" for i in range(256))):
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

    def is_verified(self, digest: bytes) -> bool:
        """True if this process already verified (or wrote) `digest`, so `open` is cheap."""
        return digest in self._verified

    def is_trusted(self, digest: bytes) -> bool:
        """True if `digest` is cached and was verified in this boot (by any process), so `open`
        reads no data (one getxattr: for deciding whether to open in a thread)."""
        if not self._boot:
            return False
        try:
            return os.getxattr(self._chunk_path(digest.hex()), TRUST_XATTR) == self._boot
        except OSError:
            return False

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

    def open(self, digest: bytes, ulen: int) -> ChunkHandle | None:
        """A handle on the cached chunk `digest` of `ulen` bytes, or None if it is not cached.

        The first use of a file not verified in this boot reads and hashes the whole file (run
        it in a thread for big chunks, unless `is_trusted`); a damaged file is removed, logged
        and reported as None.
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
        with self._mutex:
            self._pins[digest] += 1
        return ChunkHandle(self, fd, digest, ulen)

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
            os.rename(tmp, self._chunk_path(hexd))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self._verified[digest] = (st.st_dev, st.st_ino)
        with self._mutex:
            self._added += len(plain)
            if self._estimate is not None:
                self._estimate += len(plain)

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

    # -- size bound ---------------------------------------------------------------------------

    def needs_maintenance(self) -> bool:
        """True when `maintain()` should run (size unknown, over the bound, or stale)."""
        with self._mutex:
            return (
                self._estimate is None
                or self._estimate > self._bound
                or self._added >= self._rescan_bytes()
            )

    @property
    def bound(self) -> int:
        """The size bound in force: max_bytes, or less when the file system is short of it."""
        with self._mutex:
            return self._bound

    def _rescan_bytes(self) -> int:
        return max(self._bound // _RESCAN_DIVISOR, _MIN_RESCAN_BYTES)

    def _space_bound(self, cached: int) -> int:
        """min(max_bytes, cached + free - margin), from statvfs of the cache folder."""
        try:
            st = os.statvfs(self._root)
        except OSError as e:
            log.debug("chunk cache %s: statvfs failed: %s", self.root, e)
            return self.max_bytes
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        margin = min(int(size * FREE_MARGIN_FRACTION), FREE_MARGIN_MAX)
        return max(0, min(self.max_bytes, cached + free - margin))

    def maintain(self) -> EvictResult | None:
        """Rescan if due (and re-read the free space) and evict down to LOW_WATER * the bound
        when over it.

        Skips the eviction (returns None) if another process is evicting right now.
        """
        with self._mutex:
            stale = self._estimate is None or self._added >= self._rescan_bytes()
        if stale:
            since = self._added_now()
            self._rebase(self.usage().total_bytes, since)
        with self._mutex:
            over = self._estimate is not None and self._estimate > self._bound
            target = int(self._bound * LOW_WATER)
        if not over:
            return None
        return self.evict(target, wait=False)

    def make_room(self) -> EvictResult | None:
        """After a write failed for lack of space: re-read the free space and evict down to
        LOW_WATER * the new bound (waiting for another evicting process)."""
        since = self._added_now()
        self._rebase(self.usage().total_bytes, since)
        with self._mutex:
            target = int(self._bound * LOW_WATER)
        return self.evict(target, wait=True)

    def evict(self, target_bytes: int, *, wait: bool = True) -> EvictResult | None:
        """Remove the least recently used chunks and node files until at most `target_bytes`
        remain, skipping chunks pinned in this process. None if `wait` is false and another
        process evicts. (A node file in use stays usable: its user holds it open or in
        memory, and the next mount fetches or derives it again.)"""
        with self._evict_lock(wait) as locked:
            if not locked:
                return None
            since = self._added_now()
            entries = sorted([*self._scan_chunks(), *self._scan_node_files()])
            total = sum(e[1] for e in entries)
            count = sum(1 for e in entries if e[2])
            removed = freed = node_removed = 0
            with self._mutex:
                pinned = set(self._pins)
            for _mtime, size, hexd, path in entries:
                if total <= target_bytes:
                    break
                digest = bytes.fromhex(hexd) if hexd else b""
                if digest in pinned:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    freed += size
                    if hexd:
                        removed += 1
                    else:
                        node_removed += 1
                if hexd:
                    self._verified.pop(digest, None)
                    count -= 1
                total -= size
        self._rebase(total, since)
        if removed or node_removed:
            log.info("chunk cache: evicted %d chunk(s) and %d node file(s), %d bytes; %d bytes "
                     "left", removed, node_removed, freed, total)
        return EvictResult(removed, freed, count, total, node_removed)

    def _added_now(self) -> int:
        with self._mutex:
            return self._added

    def _rebase(self, scanned_bytes: int, added_before_scan: int) -> None:
        """Take a scan's total as the new estimate, keeping what was inserted during the scan
        (else those bytes would be forgotten and the cache could stay over its bound), and
        re-read the free space into the bound."""
        bound = self._space_bound(scanned_bytes)
        with self._mutex:
            during = self._added - added_before_scan
            self._estimate, self._added = scanned_bytes + during, during
            self._bound = bound

    @contextlib.contextmanager
    def _evict_lock(self, wait: bool) -> Iterator[bool]:
        fd = os.open(os.path.join(self._root, "evict.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _scan_chunks(self) -> Iterator[tuple[float, int, str, str]]:
        """(mtime, size, hex digest, path) of every cached chunk."""
        for i in range(256):
            sub = os.path.join(self._root, f"{i:02x}")
            try:
                entries = list(os.scandir(sub))
            except FileNotFoundError:
                continue
            for entry in entries:
                if len(entry.name) != 64 or not _HEX.issuperset(entry.name):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    yield st.st_mtime, st.st_size, entry.name, entry.path

    def _scan_node_files(self) -> Iterator[tuple[float, int, str, str]]:
        """(mtime, size, "", path) of every node file (NODE_FOLDERS; temp files skipped)."""
        for folder in NODE_FOLDERS:
            try:
                entries = list(os.scandir(os.path.join(self._root, folder)))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.name.startswith("."):
                    continue  # write_atomically's temp file: its writer renames or removes it
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        yield st.st_mtime, st.st_size, "", entry.path

    def usage(self) -> CacheUsage:
        """Scan the cache: chunk count and bytes, node files, leftover files, LRU time range."""
        chunks = list(self._scan_chunks())
        nodes = list(self._scan_node_files())
        times = [c[0] for c in chunks]
        return CacheUsage(
            chunks=len(chunks),
            bytes=sum(c[1] for c in chunks),
            temp_files=len(_listdir(self._tmp)),
            lock_files=len(_listdir(self._locks)),
            oldest_use=min(times) if times else None,
            newest_use=max(times) if times else None,
            node_files=len(nodes),
            node_bytes=sum(n[1] for n in nodes),
        )

    # -- housekeeping -------------------------------------------------------------------------

    def clean(self) -> int:
        """Remove temp files and lock files whose owner is gone (their flock is free), and
        mount logs untouched for LOG_KEEP seconds."""
        removed = 0
        for folder in (self._tmp, self._locks):
            for name in _listdir(folder):
                removed += remove_if_unlocked(os.path.join(folder, name))
        logs = os.path.join(self._root, LOG_FOLDER)
        old = time.time() - LOG_KEEP
        for name in _listdir(logs):
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


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []
