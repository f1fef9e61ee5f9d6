"""Reading a hint's files into the kernel's page cache through a mount, ahead of the workload.

Owns: `PageWarmer`, run in a thread of a hint replay (core/warm.py) next to its chunk fetches.
For each file record of the hint (version 2, SPEC.md 9.1), in first-read order, once the
chunks the hint names for that file are in the node cache, it reads those byte ranges of the
file through a folder where the file's group is mounted (the mount that asked for the replay).
On the kernel path every page-cache miss of a workload is a FUSE read of the data device;
read here first, on the replay's core, they leave the workload's critical path and the
workload finds the pages in the kernel's page cache (docs/design-notes.md has the numbers).
A multi-chunk file is read only in the chunks the hint names; a file of one chunk (a small or
batched file) whole. A range whose chunks are still missing when the replay has ended is
skipped: reading it would fetch on demand what the replay could not. A range already in the
page cache (cachestat(2): a group mount another environment keeps warm, the usual case on a
node that ran a task of the same family) is not read again: a warm start's replay copied 77
MB of resident pages for nothing (docs/design-notes.md).

Files are opened with openat2(2) beneath the mount (no symlinks, no magic links, no other
mount), so a hint cannot make this read anything else. Advisory work: an error skips the file
(or, for a mount that does not come, its group's files) and is logged; nothing is raised.
The warm-up never keeps a mount busy: it reads through a detached clone of each mount
(open_tree(2), as root), so a `weenv umount` just after a mount is not refused because its
replay is still reading, and it stops once a mount it reads through is unmounted.

Also `resident_sample`: whether a mount's first hinted files are in the page cache already
(the ranges `hinted_ranges` says a warm-up reads), for deciding whether a replay needs its
warm-up at all (core/replay_choice.py).

Must not: fetch chunks (it waits for the replay's), or know FUSE.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from stat import S_ISDIR
from typing import Any

from weenvfs.format.constants import INODE
from weenvfs.format.errors import FormatError
from weenvfs.format.hints import Hint
from weenvfs.format.index import ROOT_INODE, GroupIndex

from .cache import ChunkCache
from .chunk_plan import chunk_loc

log = logging.getLogger(__name__)

_MODE = struct.Struct("<I")  # the first field of an inode record (SPEC.md 6.4)

MOUNT_WAIT = 30.0  # seconds to wait for a folder to become a mount point (it is being made)
POLL = 0.002  # seconds between two looks at the cache for a chunk the replay fetches
READ_SIZE = 1 << 20

# openat2(2): the syscall number of the generic table (x86_64 and aarch64 alike) and its
# RESOLVE_* flags (linux/openat2.h).
_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 1, 2, 4, 8
_BENEATH = RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


# open_tree(2) (Linux 5.2): the same number in the generic table and on x86_64.
_SYS_OPEN_TREE = 428
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, os.O_CLOEXEC
_AT_FDCWD = -100
MOUNT_CHECK = 0.05  # seconds between two looks at whether a mount read through is still there

# cachestat(2) (Linux 6.5): the same number in the generic table and on x86_64.
_SYS_CACHESTAT = 451


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)


def open_beneath(folder: int, path: bytes) -> int:
    """A read-only descriptor of regular file `path` (relative) under the open `folder`,
    refusing symlinks, magic links and crossing into another mount (OSError)."""
    how = _OpenHow(os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK, 0, _BENEATH)
    fd = _libc.syscall(_SYS_OPENAT2, folder, path, ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), os.fsdecode(path))
    return int(fd)


def open_root(root: Path) -> int:
    """A descriptor of the mount at `root` that does not keep it busy: a detached clone of it
    (open_tree(2) needs CAP_SYS_ADMIN); without that right, the folder itself (O_PATH)."""
    fd = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(root),
                       OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
    if fd >= 0:
        return int(fd)
    code = ctypes.get_errno()
    if code not in (errno.EPERM, errno.ENOSYS):
        raise OSError(code, os.strerror(code), str(root))
    return os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


class Unmounted(Exception):
    """A mount the warm-up reads through was unmounted: there is nothing left to warm."""


def in_page_cache(fd: int, start: int, end: int) -> bool:
    """Whether every page of bytes [start, end) of open file `fd` is in the page cache; False
    when the kernel cannot tell (older than 6.5, or it refuses: then the range is read)."""
    if end <= start:
        return True
    span, found = _CachestatRange(start, end - start), _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(found), 0) != 0:
        return False
    pages = (end + mmap.PAGESIZE - 1) // mmap.PAGESIZE - start // mmap.PAGESIZE
    return int(found.nr_cache) >= pages


def hinted_ranges(index: GroupIndex, group: int, ino: int,
                  hinted: set[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """The byte ranges of file `ino` of `group` a warm-up reads, each with the chunks it
    needs: a file of one chunk (or none) whole, a multi-chunk file in the chunks `hinted`
    ((group, chunk) pairs) names."""
    size = index.inode(ino).size
    chunks = index.file_chunks(ino)
    if len(chunks) <= 1:
        return [(0, size, list(chunks))]
    step = index.chunk_size
    return [(k * step, min(size, (k + 1) * step), [c])
            for k, c in enumerate(chunks) if (group, c) in hinted]


def resident_sample(hint: Hint, indexes: Sequence[GroupIndex], roots: Mapping[int, Path],
                    sample: int) -> bool:
    """Whether the first `sample` files of `hint` (first-read order) of the groups in
    `roots` (group position -> the folder where it is mounted) are in the page cache in
    every range a warm-up would read (`hinted_ranges`): what a warm node looks like, whose
    shared group mounts other sandboxes keep in use. False as soon as one is not, or cannot
    be looked at (a folder not mounted yet, a file not found beneath it, a kernel that
    cannot tell); True when there is no such file. Opens each mount as a plain folder for
    a moment (no clone: nothing is read)."""
    files = [f for f in hint.files if f.group in roots][:sample]
    if not files:
        return True
    hinted = {(r.group, r.chunk) for r in hint.records}
    folders: dict[int, int] = {}
    try:
        for group in {f.group for f in files}:
            if not os.path.ismount(roots[group]):
                return False
            folders[group] = os.open(roots[group], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        paths = {}
        for group in folders:
            found = paths_of(indexes[group], {f.inode for f in files if f.group == group})
            paths.update(((group, ino), path) for ino, path in found.items())
        for file in files:
            path = paths.get((file.group, file.inode))
            if path is None:
                return False
            fd = open_beneath(folders[file.group], path)
            try:
                ranges = hinted_ranges(indexes[file.group], file.group, file.inode, hinted)
                if not all(in_page_cache(fd, start, end) for start, end, _ in ranges):
                    return False
            finally:
                os.close(fd)
        return True
    except (OSError, FormatError) as error:
        log.debug("cannot tell whether the hinted pages are resident: %s", error)
        return False
    finally:
        for folder in folders.values():
            os.close(folder)


def paths_of(index: GroupIndex, wanted: set[int]) -> dict[int, bytes]:
    """A path of each inode of `wanted` in `index`, visiting only the folders that can hold
    one: inode numbers are depth-first pre-order (SPEC.md 6, canonical indexes), so a
    folder's subtree is the range from its number up to the next folder beside it. Every
    path returned names its inode; an inode this does not find (a non-canonical index) is
    left out. A full walk of the reference group took 0.15 s; most of it is not needed.
    Which entries are folders is read from the inode table's mode column, unvalidated: a
    folder entered is validated by `entries` (the reference workload's 1,011 files: ~12 ms
    with a validated inode read per entry, ~7 ms so)."""
    targets = sorted(wanted)
    out: dict[int, bytes] = {}
    table = index.inode_table()
    stack = [(b"", ROOT_INODE, 0, index.header.inode_count)]
    while stack:
        prefix, folder, _, end = stack.pop()
        entries = list(index.entries(folder))
        folders = []
        for name, ino in entries:
            path = prefix + b"/" + name if prefix else name
            if ino in wanted and ino not in out:
                out[ino] = path
            elif S_ISDIR(_MODE.unpack_from(table, ino * INODE.size)[0]):
                folders.append((path, ino))
        for k, (path, ino) in enumerate(folders):
            until = folders[k + 1][1] if k + 1 < len(folders) else end
            at = bisect.bisect_left(targets, ino)
            if at < len(targets) and targets[at] < until and ino < until:
                stack.append((path, ino, ino, until))
    return out


class PageWarmer:
    """Reads the files of `hint` (those of the groups in `roots`: group position -> the folder
    where it is mounted) through their mounts once `cache` has their hinted chunks;
    `fetch_done` is set when the replay has fetched all it will."""

    def __init__(self, hint: Hint, indexes: Sequence[GroupIndex], roots: Mapping[int, Path],
                 cache: ChunkCache, fetch_done: threading.Event) -> None:
        self.hint = hint
        self.indexes = indexes
        self.roots = dict(roots)
        self.cache = cache
        self.fetch_done = fetch_done
        # files_resident: files whose hinted ranges were all in the page cache already
        # (nothing read); bytes_resident: the bytes of such ranges, in any file.
        self.progress: dict[str, Any] = {"files": 0, "files_read": 0, "bytes_read": 0,
                                         "files_resident": 0, "bytes_resident": 0,
                                         "skipped": 0, "seconds": None}
        self._buffer = bytearray(READ_SIZE)
        self._opened: list[Path] = []  # the mounts read through (their clones are open)
        self._checked = 0.0  # when `_check_mounted` last looked

    def run(self) -> dict[str, Any]:
        """Warm every file it can; return (and keep in `progress`) what it did."""
        started = time.monotonic()
        folders: dict[int, int] = {}
        try:
            files = [f for f in self.hint.files if f.group in self.roots]
            self.progress["files"] = len(files)
            paths = self._paths(files)
            hinted = {(r.group, r.chunk) for r in self.hint.records}
            unusable: set[int] = set()  # groups whose mount did not come
            for file in files:
                path = paths.get((file.group, file.inode))  # None: in no folder of its group
                if path is None or file.group in unusable:
                    self.progress["skipped"] += 1
                    continue
                self._check_mounted()
                if file.group not in folders:
                    try:
                        folders[file.group] = self._open_root(self.roots[file.group])
                    except OSError as error:
                        log.info("page-cache warm-up skips group %d: %s", file.group, error)
                        unusable.add(file.group)
                        self.progress["skipped"] += 1
                        continue
                self._warm(folders[file.group], file.group, file.inode, path, hinted)
        except Unmounted as gone:
            log.info("page-cache warm-up stops: %s was unmounted", gone)
        except Exception as error:  # advisory work: the mount goes on without it
            log.warning("page-cache warm-up stopped: %s", error)
        finally:
            for folder in folders.values():
                os.close(folder)
            self.progress["seconds"] = round(time.monotonic() - started, 3)
        return self.progress

    def _paths(self, files: Sequence[Any]) -> dict[tuple[int, int], bytes]:
        """(group, inode) -> path in its group, for `files` (`paths_of` per group)."""
        out: dict[tuple[int, int], bytes] = {}
        for group in sorted({f.group for f in files}):
            found = paths_of(self.indexes[group], {f.inode for f in files if f.group == group})
            out.update(((group, ino), path) for ino, path in found.items())
        return out

    def _open_root(self, root: Path) -> int:
        """The mount at `root`, open as a folder, once it is mounted (OSError otherwise)."""
        deadline = time.monotonic() + MOUNT_WAIT
        while not os.path.ismount(root):
            if time.monotonic() > deadline:
                raise OSError(errno.ETIMEDOUT, f"{root} was not mounted in {MOUNT_WAIT:g} s")
            time.sleep(POLL)
        fd = open_root(root)
        self._opened.append(root)
        return fd

    def _check_mounted(self) -> None:
        """Raise Unmounted if a mount read through is gone (looked at every MOUNT_CHECK s)."""
        now = time.monotonic()
        if now - self._checked < MOUNT_CHECK:
            return
        self._checked = now
        for root in self._opened:
            if not os.path.ismount(root):
                raise Unmounted(root)

    def _warm(self, folder: int, group: int, ino: int, path: bytes,
              hinted: set[tuple[int, int]]) -> None:
        index = self.indexes[group]
        ranges = hinted_ranges(index, group, ino, hinted)
        fd, read, resident = -1, False, 0
        try:
            for start, end, needed in ranges:
                if fd < 0:
                    fd = open_beneath(folder, path)
                    # Exactly the hinted ranges: the kernel's read-ahead would go on into the
                    # next chunk, which the mount then fetches on demand (the hint says the
                    # workload does not read it).
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                # Asked first: a resident range needs neither its chunks nor a read.
                if in_page_cache(fd, start, end):
                    self.progress["bytes_resident"] += end - start
                    resident += 1
                elif all(self._cached(index, c) for c in needed):
                    self._read(fd, start, end)
                    read = True
                else:
                    self.progress["skipped"] += 1
            if read:
                self.progress["files_read"] += 1
            elif ranges and resident == len(ranges):
                self.progress["files_resident"] += 1
        except OSError as error:
            self.progress["skipped"] += 1
            log.debug("page-cache warm-up skips %r: %s", path, error)
        finally:
            if fd >= 0:
                os.close(fd)

    def _cached(self, index: GroupIndex, chunk: int) -> bool:
        """Whether `chunk` is in the node cache (a zero chunk always is), waiting while the
        replay may still fetch it."""
        loc = chunk_loc(index, chunk)
        if loc.blob is None:
            return True
        while not self.cache.contains(loc.digest):
            if self.fetch_done.is_set():
                return self.cache.contains(loc.digest)
            self._check_mounted()
            time.sleep(POLL)
        return True

    def _read(self, fd: int, start: int, end: int) -> None:
        view = memoryview(self._buffer)
        while start < end:
            got = os.preadv(fd, [view[:min(end - start, READ_SIZE)]], start)
            if got <= 0:
                return
            start += got
            self.progress["bytes_read"] += got
