"""One entry model for every build source, and every path-safety rule in one place.

Owns: `Entry` (what a directory walk or a tar member says about one path), `Kind`,
`DataStream` (how the chunker reads a file's bytes), `normalize_path` (Docker convention: a
leading '/' and './' mean the root, `..` may not climb above it), `check_entry` (names,
symlink targets, xattrs) and the structural refusals the tree raises through `refuse`
(symlink traversal, a parent that is not a directory, a hardlink to an unseen path). Every
refusal is a `SourceError` of one line that names the entry.

Must not: read directories or tars (source_dir.py, source_tar.py), or build trees (tree.py).
"""

from __future__ import annotations

import enum
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

from weenvfs.errors import SourceError
from weenvfs.format import constants as C

WHITEOUT_PREFIX = b".wh."
OPAQUE_NAME = b".wh..wh..opq"
DEFAULT_DIR_MODE = 0o755


class Kind(enum.Enum):
    """What an entry is. WHITEOUT hides `path` in lower layers; OPAQUE marks the directory
    `path` as hiding everything lower layers put under it."""

    DIR = "dir"
    REG = "file"
    SYMLINK = "symlink"
    HARDLINK = "hardlink"
    CHR = "chardev"
    BLK = "blockdev"
    FIFO = "fifo"
    SOCK = "socket"
    WHITEOUT = "whiteout"
    OPAQUE = "opaque"


# The kind of a file from its mode's type bits (os.stat, an index's inode records).
KIND_OF_MODE = {
    stat.S_IFDIR: Kind.DIR,
    stat.S_IFREG: Kind.REG,
    stat.S_IFLNK: Kind.SYMLINK,
    stat.S_IFCHR: Kind.CHR,
    stat.S_IFBLK: Kind.BLK,
    stat.S_IFIFO: Kind.FIFO,
    stat.S_IFSOCK: Kind.SOCK,
}


class DataStream:
    """A file's bytes, read once and in order by the chunker.

    `extents` lists the (start, end) byte ranges that may hold data when the source knows
    where the holes are (SEEK_DATA on a directory, a GNU sparse map in a tar); None means
    "read everything". Bytes outside the extents are zeros and are skipped, not read.
    """

    def __init__(self, fileobj: BinaryIO, extents: list[tuple[int, int]] | None = None) -> None:
        self._f = fileobj
        self.extents = extents
        self.position = 0

    def read_exact(self, n: int, what: bytes) -> bytes:
        """The next `n` bytes; `SourceError` if the file ends first (it shrank)."""
        parts, got = [], 0
        while got < n:
            part = self._f.read(n - got)
            if not part:
                raise SourceError(
                    f"{show(what)}: file ended after {self.position + got} bytes "
                    "(changed while reading?)"
                )
            parts.append(part)
            got += len(part)
        self.position += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def skip(self, n: int, what: bytes) -> None:
        """Move `n` bytes forward without keeping them (seek when the file allows it)."""
        if n <= 0:
            return
        try:
            seekable = self._f.seekable()
        except (AttributeError, ValueError, OSError):
            seekable = False
        if seekable:
            self._f.seek(self.position + n)
            self.position += n
            return
        while n:
            step = min(n, 1 << 20)
            self.read_exact(step, what)
            n -= step

    def close(self) -> None:
        self._f.close()


@dataclass(slots=True)
class Entry:
    """One path of a source. `path` is relative, normalized bytes (b'' is the root).

    `mode` holds only the permission bits (07777); the kind says the file type. `target` is
    the symlink target, or for HARDLINK the normalized path of the linked entry. For WHITEOUT
    `path` is the hidden path; for OPAQUE it is the directory. `open_data` returns the
    file's bytes for REG entries with a size.
    """

    path: bytes
    kind: Kind
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    rdev: int = 0
    target: bytes = b""
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    open_data: Callable[[], DataStream] | None = None


class Source(Protocol):
    """What the builder reads: entries in order, each file's data readable once, in order.

    `total_bytes` is the sum of file sizes when the source knows it (after `entries()` has
    started), else None; `label` names the source in messages.
    """

    label: str
    total_bytes: int | None

    def entries(self) -> Iterator[Entry]: ...

    def close(self) -> None: ...


def show(path: bytes) -> str:
    """A path for messages: printable, invalid UTF-8 escaped, never longer than 200."""
    text = repr(path.decode("utf-8", "backslashreplace"))[1:-1] if path else "/"
    return text if len(text) <= 200 else text[:197] + "..."


def refuse(path: bytes | str, reason: str) -> SourceError:
    """The one-line error for an unsafe or invalid entry (raise it)."""
    name = show(path) if isinstance(path, bytes) else path
    return SourceError(f"refusing entry {name!r}: {reason}")


def normalize_path(raw: bytes, *, what: bytes | None = None) -> bytes:
    """`raw` as a relative path without '.', '..' or empty parts; b'' is the root.

    A leading '/' or './' is dropped (tar members like './etc/x' and '/etc/x' mean etc/x);
    `..` is resolved lexically and may not climb above the root. Refuses NUL bytes and
    components longer than MAX_NAME bytes.
    """
    label = raw if what is None else what
    if b"\0" in raw:
        raise refuse(label, "NUL byte in the path")
    parts: list[bytes] = []
    for part in raw.split(b"/"):
        if part in (b"", b"."):
            continue
        if part == b"..":
            if not parts:
                raise refuse(label, "path escapes the root ('..' above the top)")
            parts.pop()
            continue
        if len(part) > C.MAX_NAME:
            raise refuse(label, f"a name is {len(part)} bytes, the limit is {C.MAX_NAME}")
        parts.append(part)
    return b"/".join(parts)


def split_whiteout(path: bytes) -> tuple[Kind, bytes] | None:
    """(WHITEOUT, hidden path) or (OPAQUE, directory) for an OCI whiteout file, else None.

    Other `.wh.` names (aufs' `.wh..wh.plnk` and friends) and whiteouts of `.`/`..` are
    refused: OCI layers never hold them and a naive reader would misapply them.
    """
    parent, _, name = path.rpartition(b"/")
    if not name.startswith(WHITEOUT_PREFIX):
        return None
    if name == OPAQUE_NAME:
        return Kind.OPAQUE, parent
    hidden = name[len(WHITEOUT_PREFIX) :]
    if hidden.startswith(WHITEOUT_PREFIX):
        raise refuse(path, "unsupported whiteout name (only .wh.NAME and .wh..wh..opq)")
    if hidden in (b"", b".", b".."):
        raise refuse(path, f"whiteout of {hidden.decode()!r} is not allowed")
    return Kind.WHITEOUT, parent + b"/" + hidden if parent else hidden


def check_entry(entry: Entry) -> Entry:
    """Validate what can be checked on the entry alone; return it."""
    if not entry.path and entry.kind not in (Kind.DIR, Kind.OPAQUE):
        raise refuse(entry.path, f"a {entry.kind.value} cannot be the root (empty name)")
    if entry.kind is Kind.SYMLINK:
        if not entry.target or b"\0" in entry.target:
            raise refuse(entry.path, "symlink target is empty or holds a NUL byte")
        if len(entry.target) > C.MAX_SYMLINK:
            raise refuse(entry.path, f"symlink target exceeds {C.MAX_SYMLINK} bytes")
    if entry.kind is Kind.HARDLINK and not entry.target:
        raise refuse(entry.path, "hardlink to the root")
    if entry.mode & ~0o7777:
        raise refuse(entry.path, f"mode {entry.mode:#o} has bits beyond 07777")
    if entry.size < 0 or entry.uid < 0 or entry.gid < 0:
        raise refuse(entry.path, "negative size or owner")
    if entry.uid > C.MAX_U32 or entry.gid > C.MAX_U32:
        raise refuse(entry.path, "owner id exceeds 32 bits")
    for key, value in entry.xattrs.items():
        if not 0 < len(key) <= C.MAX_XATTR_KEY or b"\0" in key:
            raise refuse(entry.path, f"invalid xattr name {key[:80]!r}")
        if len(value) > C.MAX_XATTR_VALUE:
            raise refuse(entry.path, f"xattr {key[:80]!r} value exceeds {C.MAX_XATTR_VALUE} bytes")
    return entry
