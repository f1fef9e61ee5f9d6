"""`weenv export`: materialize an environment's composed tree into a local directory, exactly.

Owns: creating every entry of a `ComposedTree` with all of its metadata. This is the reference
the FUSE filesystem is compared against, so nothing is approximated:

- regular files are written piece by piece; zero chunks are skipped (the file is extended with
  `ftruncate`), so holes stay holes; hardlinks (one (group, inode) under several names) become
  `link`s to the first name created;
- directories, symlinks, character and block devices, fifos, and sockets (created with
  `mknod(S_IFSOCK)`, an inode no process listens on, as `tar` and `cp -a` would leave it);
- owner first, then mode (chown clears set-id bits), then xattrs (chown clears
  `security.capability`), then the nanosecond mtime (atime is set to the same value); a
  directory gets its metadata once everything below it is complete (post-order, so deepest
  first), the destination directory itself gets the root's.

Never follows a symlink in the destination: every entry is created and changed relative to an
open directory descriptor of its parent (`*at` calls, `O_NOFOLLOW`), xattrs of symlinks and
special files through `/proc/self/fd/<dirfd>/<name>` with `follow_symlinks=False`. Whiteouts
never appear (the composed tree hides them). The destination must be absent or empty; it is
refused otherwise. A failed or interrupted export removes what it wrote, so that a retry
starts over: the destination and the parents it created, or, when the destination was there
(empty), everything in it, its mode and owner put back; nothing that was there before is
removed. Needs root for foreign owners, devices and trusted.* xattrs, like any exact unpacker.

Must not: change the store, or touch anything outside the destination.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

from weenvfs.errors import StoreError, UsageError, WeenvError
from weenvfs.format.compose import ComposedTree, Entry
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex, Inode

from .inspect import check_no_cycle, escape_name
from .reader import ChunkReader

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
P = ParamSpec("P")
T = TypeVar("T")
_NODE_TYPES = (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK)


class ExportError(WeenvError):
    """The export failed."""


@dataclass
class ExportStats:
    """What an export created."""

    dirs: int = 0
    files: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    special: int = 0  # devices, fifos, sockets
    bytes_written: int = 0
    hole_bytes: int = 0


@dataclass
class _Frame:
    """A directory being filled: its descriptor, path, entry and remaining children."""

    fd: int
    rel: bytes
    entry: Entry
    children: Iterator[tuple[bytes, Entry]]


@dataclass
class Exporter:
    """Writes one composed tree into one destination directory."""

    tree: ComposedTree
    reader: ChunkReader
    stats: ExportStats = field(default_factory=ExportStats)
    progress: Callable[[int], None] | None = None  # told each file data byte count written
    _first: dict[tuple[int, int], bytes] = field(default_factory=dict)
    _seen_dirs: set[tuple[int, int]] = field(default_factory=set)
    _root_fd: int = -1

    def run(self, dest: Path) -> ExportStats:
        """Export into `dest` (created if absent; refused if not an empty directory). On any
        failure, KeyboardInterrupt included, what was written is removed again."""
        opened = _open_dest(dest)
        self._root_fd = opened.fd
        try:
            self._fill()
        except BaseException:
            opened.undo()
            raise
        finally:
            _close_quietly(opened.keep_fd)
        return self.stats

    def _fill(self) -> None:
        """Create every entry below the root, then give the root its metadata."""
        stack = [_Frame(self._root_fd, b"", self.tree.root, self.tree.entries(self.tree.root))]
        try:
            while stack:
                frame = stack[-1]
                item = next(frame.children, None)
                if item is None:
                    self._guard(frame.rel, self._finish_dir, frame)
                    stack.pop()
                    continue
                name, entry = item
                rel = frame.rel + b"/" + name if frame.rel else name
                if entry.is_dir:
                    stack.append(self._guard(rel, self._mkdir, frame.fd, name, rel, entry))
                else:
                    self._guard(rel, self._create, frame.fd, name, rel, entry)
        finally:
            for frame in stack:  # left open by a failure
                _close_quietly(frame.fd)

    def _guard(self, rel: bytes, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn(*args)`, turning any failure into one line naming the entry."""
        try:
            return fn(*args, **kwargs)
        except OSError as error:
            raise ExportError(
                f"cannot export /{escape_name(rel)}: {error.strerror or error}"
            ) from None
        except (StoreError, FormatError) as error:
            raise ExportError(f"cannot read /{escape_name(rel)}: {error}") from None

    def _inode(self, entry: Entry) -> tuple[GroupIndex, Inode]:
        index = self.tree.groups[entry.group]
        return index, index.inode(entry.inode)

    # -- directories ------------------------------------------------------------------------

    def _mkdir(self, parent_fd: int, name: bytes, rel: bytes, entry: Entry) -> _Frame:
        check_no_cycle(self._seen_dirs, entry)
        # 0o700 while filling it; the real mode is applied when it is complete.
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        self.stats.dirs += 1
        return _Frame(fd, rel, entry, self.tree.entries(entry))

    def _finish_dir(self, frame: _Frame) -> None:
        index, rec = self._inode(frame.entry)
        _apply_fd(frame.fd, rec, index.xattrs(frame.entry.inode))
        os.close(frame.fd)

    # -- other entries ----------------------------------------------------------------------

    def _create(self, dir_fd: int, name: bytes, rel: bytes, entry: Entry) -> None:
        index, rec = self._inode(entry)
        key = (entry.group, entry.inode)
        first = self._first.get(key)
        if first is not None:
            os.link(first, name, src_dir_fd=self._root_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            self.stats.hardlinks += 1
            return
        kind = stat.S_IFMT(rec.mode)
        xattrs = index.xattrs(entry.inode)
        if kind == stat.S_IFREG:
            self._file(dir_fd, name, index, entry.inode, rec, xattrs)
        elif kind == stat.S_IFLNK:
            os.symlink(index.readlink(entry.inode), name, dir_fd=dir_fd)
            _apply_at(dir_fd, name, rec, xattrs, symlink=True)
            self.stats.symlinks += 1
        elif kind in _NODE_TYPES:
            os.mknod(name, kind | 0o600, rec.rdev if kind in _NODE_TYPES[:2] else 0, dir_fd=dir_fd)
            _apply_at(dir_fd, name, rec, xattrs, symlink=False)
            self.stats.special += 1
        else:
            raise ExportError(f"/{escape_name(rel)}: unknown file type {rec.mode:#o}")
        if rec.nlink > 1:
            self._first[key] = rel

    def _file(
        self,
        dir_fd: int,
        name: bytes,
        index: GroupIndex,
        ino: int,
        rec: Inode,
        xattrs: list[tuple[bytes, bytes]],
    ) -> None:
        fd = os.open(name, _FILE_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            for piece in self.reader.iter_pieces(index, ino):
                if piece.data is None:
                    self.stats.hole_bytes += piece.length
                else:
                    _pwrite_all(fd, piece.data, piece.offset)
                    self.stats.bytes_written += piece.length
                    if self.progress is not None:
                        self.progress(piece.length)
            # Extends over a trailing hole; a no-op otherwise.
            os.ftruncate(fd, rec.size)
            _apply_fd(fd, rec, xattrs)
        finally:
            os.close(fd)
        self.stats.files += 1


# -- metadata -----------------------------------------------------------------------------------


def _apply_fd(fd: int, rec: Inode, xattrs: list[tuple[bytes, bytes]]) -> None:
    """Owner, mode, xattrs, mtime of an open file or directory, in that order."""
    os.fchown(fd, rec.uid, rec.gid)
    os.fchmod(fd, stat.S_IMODE(rec.mode))
    for key, value in xattrs:
        os.setxattr(fd, key, value)
    os.utime(fd, ns=(rec.mtime_ns, rec.mtime_ns))


def _apply_at(
    dir_fd: int, name: bytes, rec: Inode, xattrs: list[tuple[bytes, bytes]], *, symlink: bool
) -> None:
    """Owner, mode, xattrs, mtime of entry `name` of `dir_fd`, never following it."""
    os.chown(name, rec.uid, rec.gid, dir_fd=dir_fd, follow_symlinks=False)
    if not symlink:
        # fchmodat cannot refuse to follow on Linux; `name` was just made by mknod here.
        os.chmod(name, stat.S_IMODE(rec.mode), dir_fd=dir_fd)
    proc = b"/proc/self/fd/%d/%s" % (dir_fd, name)
    for key, value in xattrs:
        os.setxattr(proc, key, value, follow_symlinks=False)
    os.utime(name, ns=(rec.mtime_ns, rec.mtime_ns), dir_fd=dir_fd, follow_symlinks=False)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


@dataclass
class _Dest:
    """An opened destination and how to undo an export into it: `fd` is the export's (closed
    when the root is finished), `keep_fd` a copy kept to empty it again."""

    path: Path
    fd: int
    keep_fd: int
    created: list[Path]  # made by this export, outermost first (the last is `path`, if so)
    mode: int
    uid: int
    gid: int

    def undo(self) -> None:
        """Remove everything in the destination, then what was created for it, or put back
        the mode and owner of one that was there. Never follows a symlink; best effort (a
        failure is logged, the export's own error is what the caller sees)."""
        try:
            _empty(self.keep_fd)
            if self.created and self.created[-1] == self.path:
                for path in reversed(self.created):
                    os.rmdir(path)  # empty: only what this export made
            else:
                os.fchown(self.keep_fd, self.uid, self.gid)
                os.fchmod(self.keep_fd, stat.S_IMODE(self.mode))
        except OSError as error:
            log.warning("could not remove the partial export in %s: %s", self.path, error)


def _empty(dir_fd: int) -> None:
    """Remove every entry of an open directory, depth first, with `*at` calls only (an
    explicit stack, as the export's: a tree may be deeper than Python's recursion limit)."""
    stack: list[tuple[int, str, list[tuple[str, bool]]]] = [(dir_fd, "", _children(dir_fd))]
    try:
        while stack:
            fd, name, children = stack[-1]
            if not children:
                stack.pop()
                if stack:  # a subdirectory: now empty
                    os.close(fd)
                    os.rmdir(name, dir_fd=stack[-1][0])
                continue
            child, is_dir = children.pop()
            if not is_dir:
                os.unlink(child, dir_fd=fd)
                continue
            # A finished directory has its real mode (0o555, even 0): make it ours to empty.
            # It is a directory, not a symlink (lstat'ed by scandir, in a tree we made).
            os.chmod(child, 0o700, dir_fd=fd)
            sub = os.open(child, _DIR_FLAGS, dir_fd=fd)
            stack.append((sub, child, []))  # stacked before listing: a failure closes it
            stack[-1] = (sub, child, _children(sub))
    finally:
        for fd, _, _ in stack[1:]:
            _close_quietly(fd)


def _children(dir_fd: int) -> list[tuple[str, bool]]:
    """(name, is a directory, not followed) of every entry of an open directory."""
    with os.scandir(dir_fd) as it:
        return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]


def _open_dest(dest: Path) -> _Dest:
    """Create `dest` (and its parents) if absent and open it; refuse a non-directory, a
    symlink or contents."""
    created = [p for p in (*reversed(dest.parents), dest) if not os.path.lexists(p)]
    try:
        os.makedirs(dest.parent, exist_ok=True)
        os.mkdir(dest, 0o700)
    except FileExistsError:
        created = created[:-1] if created and created[-1] == dest else created
    except OSError as error:
        for path in reversed(created):  # the parents made before mkdir failed
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise ExportError(f"cannot create {dest}: {error.strerror}") from None
    try:
        fd = os.open(dest, _DIR_FLAGS)
    except OSError as error:
        raise UsageError(
            f"export destination {dest} is not a directory (or is a symlink): {error.strerror}"
        ) from None
    if os.listdir(fd):
        os.close(fd)
        raise UsageError(f"export destination {dest} is not empty")
    st = os.fstat(fd)
    return _Dest(dest, fd, os.dup(fd), created, st.st_mode, st.st_uid, st.st_gid)


def export_tree(tree: ComposedTree, reader: ChunkReader, dest: Path,
                progress: Callable[[int], None] | None = None) -> ExportStats:
    """Materialize `tree` into `dest` (see the module docstring for the guarantees);
    `progress(n)` after each `n` bytes of file data written."""
    stats = Exporter(tree, reader, progress=progress).run(dest)
    log.info(
        "exported %d dirs, %d files (%d bytes, %d in holes), %d symlinks, %d hardlinks, "
        "%d special files into %s",
        stats.dirs,
        stats.files,
        stats.bytes_written,
        stats.hole_bytes,
        stats.symlinks,
        stats.hardlinks,
        stats.special,
        dest,
    )
    return stats
