"""The size bound of the node cache: how big it is, when it is over, and LRU eviction.

`CacheBound` is the part of `ChunkCache` (cache.py) that keeps the cache within `max_bytes`:
each process tracks the size from a scan plus what it inserted and rescans after inserting
max_bytes/8 (so other processes' writes are noticed); when over the bound it evicts the least
recently used chunks and node files (NODE_FOLDERS: indexes, EROFS images, layouts) down to
LOW_WATER of it, under a global lock (`evict.lock`), skipping chunks pinned in this process.
The bound in force is min(max_bytes, cached + free - margin), read from statvfs at every
rescan and eviction (see cache.py's docstring for why, and for how pins work).

A scan costs ~9 us per cached chunk (0.9 s of CPU for 100,000), and every process starts with
no estimate: each mount daemon used to scan the whole cache at its first insert, 32 at once
when 32 environments start. So every scan and eviction leaves its total in the ledger
(`<root>/usage`), and a process with no estimate yet takes a ledger younger than
LEDGER_SECONDS instead of scanning; scans take turns (`scan.lock`), and one that waited for
another's takes the ledger that one left. What other processes inserted since the ledger was
written is theirs to count, as what they insert after any scan always was (each rescans
after inserting max_bytes/8); the process's own next rescan comes as before.

A mixin: the attributes it uses (`_root`, `_tmp`, `_locks`, `_mutex`, `_pins`, `_verified`,
`_estimate`, `_added`, `_bound`, `max_bytes`, `root`) are `ChunkCache`'s, set in its
`__init__`. Must not: read, write or verify chunks.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("weenvfs.core.cache")

LOW_WATER = 0.9  # eviction frees down to this fraction of max_bytes
LEDGER = "usage"  # <root>/usage: the bytes the last scan or eviction left, as decimal text
LEDGER_SECONDS = 10.0  # a process with no estimate takes a ledger at most this old
_RESCAN_DIVISOR = 8  # rescan after inserting bound / this
_MIN_RESCAN_BYTES = 1 << 20  # but not more often than every MiB (a tiny or full disk)
FREE_MARGIN_FRACTION = 0.05  # of the file system's size, kept free ...
FREE_MARGIN_MAX = 1 << 30  # ... or this much, whichever is smaller
# What mounts keep next to the chunks, counted in the bound and evicted with them (LRU by
# mtime, which their users refresh as `open` does a chunk's): group indexes and manifests
# (node_copies.py), EROFS images and device layouts (kernel_image.py), and the notes of what
# a tag resolved to (node_copies.py: never refreshed, so they go first; only a preload guess).
NODE_FOLDERS = ("indexes", "manifests", "erofs", "refs")
_HEX = frozenset("0123456789abcdef")


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


class CacheBound:
    """Size tracking and eviction of a `ChunkCache` (see the module)."""

    root: Path
    max_bytes: int
    _root: str
    _tmp: str
    _locks: str
    _mutex: threading.Lock
    _pins: Counter[bytes]
    _verified: dict[bytes, tuple[int, int]]
    _estimate: int | None
    _added: int
    _bound: int

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
            first = self._estimate is None
            stale = first or self._added >= self._rescan_bytes()
        if stale:
            since = self._added_now()
            ledger = self._read_ledger() if first else None
            if ledger is None:
                # One scan at a time: 32 daemons starting together would otherwise all find
                # no fresh ledger and all scan; those that waited take the one just written.
                with self._lock_file("scan.lock", wait=True):
                    ledger = self._read_ledger() if first else None
                    if ledger is None:
                        ledger = self._scan_total()
            self._rebase(ledger, since)
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
        self._rebase(self._scan_total(), since)
        with self._mutex:
            target = int(self._bound * LOW_WATER)
        return self.evict(target, wait=True)

    def evict(self, target_bytes: int, *, wait: bool = True) -> EvictResult | None:
        """Remove the least recently used chunks and node files until at most `target_bytes`
        remain, skipping chunks pinned in this process. None if `wait` is false and another
        process evicts. (A node file in use stays usable: its user holds it open or in
        memory, and the next mount fetches or derives it again.)"""
        with self._lock_file("evict.lock", wait) as locked:
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
        self._write_ledger(total)
        if removed or node_removed:
            log.info("chunk cache: evicted %d chunk(s) and %d node file(s), %d bytes; %d bytes "
                     "left", removed, node_removed, freed, total)
        return EvictResult(removed, freed, count, total, node_removed)

    def _scan_total(self) -> int:
        """A scan's total (chunks and node files), left in the ledger for other processes."""
        total = self.usage().total_bytes
        self._write_ledger(total)
        return total

    def _read_ledger(self) -> int | None:
        """The ledger's bytes if it was written within LEDGER_SECONDS, else None (missing,
        old, from the future, or not a byte count: then the caller scans)."""
        try:
            with open(os.path.join(self._root, LEDGER), "rb") as f:
                age = time.time() - os.fstat(f.fileno()).st_mtime
                text = f.read(32)
        except OSError:
            return None
        if not 0 <= age <= LEDGER_SECONDS or not text.strip().isdigit():
            return None
        return int(text)

    def _write_ledger(self, total: int) -> None:
        """Leave `total` in the ledger (written aside and renamed: a reader sees all of it or
        the old one). Advisory: a failure only means the next process scans."""
        tmp = os.path.join(self._tmp, f"{LEDGER}.{os.getpid()}.{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(b"%d\n" % total)
            os.replace(tmp, os.path.join(self._root, LEDGER))
        except OSError as e:  # a full disk, or clean() took the unlocked temp file meanwhile
            log.debug("chunk cache %s: cannot write the usage ledger: %s", self.root, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

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
    def _lock_file(self, name: str, wait: bool) -> Iterator[bool]:
        """flock of `<root>/name` for the block: True when taken (waits for it with
        `wait`, else False at once when another process holds it)."""
        fd = os.open(os.path.join(self._root, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
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
            temp_files=len(listdir(self._tmp)),
            lock_files=len(listdir(self._locks)),
            oldest_use=min(times) if times else None,
            newest_use=max(times) if times else None,
            node_files=len(nodes),
            node_bytes=sum(n[1] for n in nodes),
        )


def listdir(folder: str) -> list[str]:
    """The names in `folder` ([] if it does not exist)."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []
