"""A directory as a build source: entries with every bit of metadata, in sorted order.

Owns: walking a directory with `os.scandir` and `lstat` (names as bytes, symlinks never
followed), reading xattrs, turning repeated (st_dev, st_ino) into hardlink entries, and
finding holes in sparse files with SEEK_DATA/SEEK_HOLE so the chunker skips them unread.
The root directory's own metadata becomes the index root.

Sockets are skipped with a warning: they are endpoints of running processes, meaningless in
an image (Docker's archiver drops them too). Extended attributes are copied verbatim (user.*,
trusted.*, security.capability, system.posix_acl_*), except the other security.* ones
(selinux, ima, evm, apparmor): those are labels of the build host, not of the image. A
`system.*` attribute that cannot be read is skipped with a debug line; any other unreadable
one is an error.

Must not: follow symlinks below the root, or decide anything about layers or chunks.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from weenvfs.errors import SourceError

from .entries import KIND_OF_MODE, DataStream, Entry, Kind, check_entry, refuse, show
from .regular_file import open_regular_fd

log = logging.getLogger(__name__)



class DirSource:
    """The tree under `root`. `entries()` yields the root first, then depth-first by name."""

    def __init__(self, root: Path | str | bytes) -> None:
        self.root = os.fsencode(root)
        self.label = show(self.root)
        try:
            st = os.stat(self.root)  # the root itself may be reached through a symlink
        except OSError as e:
            raise SourceError(f"cannot read source {self.label}: {e.strerror}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise SourceError(f"source {self.label} is not a directory")
        self._root_stat = st
        self.total_bytes: int | None = None  # known once entries() has listed everything

    def entries(self) -> Iterator[Entry]:
        """Every entry; the walk (metadata only) finishes before the first file is read, so
        `total_bytes` is known when data starts to flow."""
        listed = list(self._walk())
        self.total_bytes = sum(e.size for e in listed if e.kind is Kind.REG)
        return iter(listed)

    def close(self) -> None:
        """Nothing to release: files are opened and closed one at a time."""

    def _walk(self) -> Iterator[Entry]:
        yield self._entry(b"", self.root, self._root_stat)
        seen: dict[tuple[int, int], bytes] = {}
        stack: list[bytes] = [b""]
        while stack:
            rel_dir = stack.pop()
            children = self._scan(rel_dir)
            subdirs = []
            for name in sorted(children):
                rel = rel_dir + b"/" + name if rel_dir else name
                entry = self._child(rel, seen)
                if entry is None:
                    continue
                yield entry
                if entry.kind is Kind.DIR:
                    subdirs.append(rel)
            stack.extend(reversed(subdirs))

    def _scan(self, rel_dir: bytes) -> list[bytes]:
        path = os.path.join(self.root, rel_dir) if rel_dir else self.root
        try:
            with os.scandir(path) as it:
                return [d.name for d in it]
        except OSError as e:
            raise refuse(rel_dir, f"cannot list directory: {e.strerror}") from None

    def _child(self, rel: bytes, seen: dict[tuple[int, int], bytes]) -> Entry | None:
        full = os.path.join(self.root, rel)
        try:
            st = os.lstat(full)
        except OSError as e:
            raise refuse(rel, f"cannot stat: {e.strerror}") from None
        kind = KIND_OF_MODE.get(stat.S_IFMT(st.st_mode))
        if kind is None:
            raise refuse(rel, f"unknown file type {st.st_mode:#o}")
        if kind is Kind.SOCK:
            log.warning("skipping socket %s (sockets do not belong in an image)", show(rel))
            return None
        if kind is not Kind.DIR and st.st_nlink > 1:
            first = seen.setdefault((st.st_dev, st.st_ino), rel)
            if first != rel:
                return check_entry(Entry(rel, Kind.HARDLINK, target=first))
        return self._entry(rel, full, st)

    def _entry(self, rel: bytes, full: bytes, st: os.stat_result) -> Entry:
        kind = KIND_OF_MODE[stat.S_IFMT(st.st_mode)]
        entry = Entry(
            rel,
            kind,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            mtime_ns=st.st_mtime_ns,
            xattrs=_xattrs(full, rel),
        )
        if kind is Kind.REG:
            entry.size = st.st_size
            entry.open_data = _opener(full, rel, st.st_size)
        elif kind is Kind.SYMLINK:
            try:
                entry.target = os.readlink(full)
            except OSError as e:
                raise refuse(rel, f"cannot read symlink: {e.strerror}") from None
        elif kind in (Kind.CHR, Kind.BLK):
            entry.rdev = st.st_rdev
        return check_entry(entry)


def _xattrs(full: bytes, rel: bytes) -> dict[bytes, bytes]:
    try:
        names = os.listxattr(full, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise refuse(rel, f"cannot list xattrs: {e.strerror}") from None
    out = {}
    for name in sorted(names):
        if name.startswith("security.") and name != "security.capability":
            continue  # a host label (see the module docstring)
        try:
            out[os.fsencode(name)] = os.getxattr(full, name, follow_symlinks=False)
        except OSError as e:
            if e.errno == errno.ENODATA:
                continue  # removed since listing
            if name.startswith("system."):
                log.debug("skipping unreadable xattr %s of %s: %s", name, show(rel), e.strerror)
                continue
            raise refuse(rel, f"cannot read xattr {name}: {e.strerror}") from None
    return out


def _opener(full: bytes, rel: bytes, size: int) -> Callable[[], DataStream]:
    def open_data() -> DataStream:
        try:
            fd = open_regular_fd(full, follow=False)
        except SourceError:
            raise refuse(rel, "is no longer a regular file (changed while reading?)") from None
        except OSError as e:
            raise refuse(rel, f"cannot open: {e.strerror}") from None
        try:
            now = os.fstat(fd).st_size
            if now != size:
                raise refuse(rel, f"size changed from {size} to {now} (changed while reading?)")
            extents = data_extents(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return DataStream(os.fdopen(fd, "rb", buffering=0), extents)

    return open_data


def data_extents(fd: int, size: int) -> list[tuple[int, int]] | None:
    """The (start, end) ranges of `fd` that hold data, or None if the filesystem cannot tell
    (then everything is read). A file without holes is one extent."""
    extents: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole up to the end
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            if start >= size:
                break
            extents.append((start, end))
            pos = end
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    return extents
