"""What a composed environment looks like as a file system: inode numbers, attributes, names.

Owns: the inode numbering of a mount (FUSE inode 1 is the root; any other entry is
`(group << 32) + inode + 2`, stable across mounts of the same manifest, so hardlinks, which
share a (group, inode) record, share an inode number), the attributes of every entry (`Attr`,
a plain tuple the FUSE adapter converts), cached directory listings, lookup, readlink, xattrs,
access checks and the numbers `statfs` reports. The union semantics themselves are
`weenvfs.format.compose.ComposedTree`'s; this module wraps it.

Must not: import pyfuse3, fetch data or know about the kernel beyond inode numbers (that is
fuse/ops.py, "a protocol adapter only"). Errors are `OSError` subclasses carrying their errno
(`FileNotFoundError`, `NotADirectoryError`, ...), which the adapter passes through.

Choices, written down:
- Directories handed out stay known for the life of the mount (a few hundred bytes each,
  bounded by the tree's directory count), so `forget` has nothing to free and `..` always
  resolves. Regular files and other non-directories are derived from their number alone.
- A directory merged from several groups reports nlink 1 ("unknown", as overlayfs does for
  merged directories): its exact count would need a listing on every getattr. A directory
  from one group reports the index's exact count. A hardlinked file reports its visible names
  (`ComposedTree.link_count`: the index's nlink for the topmost group, else counted once per
  record, on first use, after one walk of that group's directories).
- st_blocks counts stored data in 512-byte units: holes (zero chunks) of a sparse file do not
  count. st_blksize is large so that readers ask for big reads.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from weenvfs.format.compose import ComposedTree, Entry
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex, Inode

ROOT_INODE = 1
GROUP_SHIFT = 32
INODE_MASK = (1 << GROUP_SHIFT) - 1
FIRST_INODE = 2  # 0 is invalid for FUSE and 1 is the root
BLOCK_SIZE = 128 * 1024  # st_blksize: the read size we want from readers
DIR_SIZE = 4096  # st_size of a directory, as most local file systems report
_ATTR_CACHE = 1 << 16
# Directory listings kept, counted in entries (about 130 bytes each): a whole reference tree
# (47k entries) fits, so a second `find` never recomputes one; a huge tree keeps the recent.
_LISTING_CACHE = 1 << 18

# Raised by the index accessors for damaged records; re-exported for the FUSE adapter, which
# may not import the format itself (it maps this to EIO).
__all__ = ["Attr", "FormatError", "Tree", "Usage", "make_inode", "may_access", "split_inode"]


class Attr(NamedTuple):
    """The attributes of one entry, in kernel terms (times in nanoseconds)."""

    inode: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    blocks: int
    mtime_ns: int


class Usage(NamedTuple):
    """Totals `statfs` reports: stored bytes and inode records of every group."""

    data_bytes: int
    inodes: int


def make_inode(group: int, ino: int) -> int:
    """The FUSE inode number of record `ino` of group `group` (never the root)."""
    return (group << GROUP_SHIFT) + ino + FIRST_INODE


def split_inode(inode: int) -> tuple[int, int]:
    """(group, record) of a FUSE inode number made by `make_inode`."""
    rest = inode - FIRST_INODE
    return rest >> GROUP_SHIFT, rest & INODE_MASK


def may_access(attr: Attr, want: int, uid: int, gids: set[int]) -> bool:
    """Whether a caller (`uid`, groups `gids`) gets `want` (os.R_OK|W_OK|X_OK) on `attr`.

    The POSIX rule: root may read and write anything, and execute when any x bit is set (or
    it is a directory); everyone else gets the owner, group or other bits, first match only.
    """
    want &= os.R_OK | os.W_OK | os.X_OK
    if uid == 0:
        if not want & os.X_OK:
            return True
        return stat.S_ISDIR(attr.mode) or bool(attr.mode & 0o111)
    if uid == attr.uid:
        bits = (attr.mode >> 6) & 7
    elif attr.gid in gids:
        bits = (attr.mode >> 3) & 7
    else:
        bits = attr.mode & 7
    return want & bits == want


def _not_found(what: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, what)


class Tree:
    """The composed, read-only tree of `groups` (lowest first, as in a manifest)."""

    def __init__(self, groups: Sequence[GroupIndex]) -> None:
        self.composed = ComposedTree(groups)
        self.groups = self.composed.groups
        # Every directory handed out: inode -> (entry, parent inode).
        self._dirs: dict[int, tuple[Entry, int]] = {
            ROOT_INODE: (self.composed.root, ROOT_INODE)
        }
        self._listings: OrderedDict[int, tuple[tuple[bytes, int], ...]] = OrderedDict()
        self._listed = 0  # entries in self._listings
        self._usage: Usage | None = None
        self.attr = functools.lru_cache(maxsize=_ATTR_CACHE)(self._attr)

    # -- inode numbers ----------------------------------------------------------------------

    def _number(self, entry: Entry, parent: int) -> int:
        """The inode number of `entry` in directory `parent`, remembering directories."""
        if entry.is_dir:
            inode = make_inode(entry.group, entry.inode)
            if inode not in self._dirs:
                self._dirs[inode] = (entry, parent)
            return inode
        return make_inode(entry.group, entry.inode)

    def entry(self, inode: int) -> Entry:
        """The composed entry behind a number this tree handed out (ENOENT otherwise)."""
        known = self._dirs.get(inode)
        if known is not None:
            return known[0]
        group, ino = split_inode(inode)
        if inode < FIRST_INODE or group >= len(self.groups):
            raise _not_found(f"no inode {inode}")
        index = self.groups[group]
        if ino >= index.inode_count or index.inode(ino).is_dir:
            # A directory must have been handed out first: its layers are not in its number.
            raise _not_found(f"no inode {inode}")
        return Entry(group, ino, ())

    def _directory(self, inode: int) -> Entry:
        entry = self.entry(inode)
        if not entry.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, f"inode {inode} is not a directory")
        return entry

    # -- attributes -------------------------------------------------------------------------

    def _attr(self, inode: int) -> Attr:
        """Attributes of `inode` (cached by `attr`; content is immutable)."""
        entry = self.entry(inode)
        index = self.groups[entry.group]
        rec = index.inode(entry.inode)
        nlink = rec.nlink
        if rec.is_dir:
            size, blocks = DIR_SIZE, DIR_SIZE // 512
            if len(entry.layers) > 1:
                nlink = 1  # merged directory: count unknown without a listing (see above)
            elif entry.layers[0] != (entry.group, entry.inode):
                # Attributes from a directory below an opaque cut; the count is the layer's.
                g, ino = entry.layers[0]
                nlink = self.groups[g].inode(ino).nlink
        else:
            if nlink > 1:
                nlink = self.composed.link_count(entry)  # upper groups may hide some names
            size, blocks = self._size(index, entry.inode, rec)
        return Attr(
            inode, rec.mode, nlink, rec.uid, rec.gid, rec.rdev, size, blocks, rec.mtime_ns
        )

    def _size(self, index: GroupIndex, ino: int, rec: Inode) -> tuple[int, int]:
        """(st_size, st_blocks) of non-directory record `ino`."""
        if rec.is_reg:
            return rec.size, -(-self._stored_bytes(index, ino, rec.size) // 512)
        if rec.is_lnk:
            return len(index.readlink(ino)), 0
        return 0, 0

    @staticmethod
    def _stored_bytes(index: GroupIndex, ino: int, size: int) -> int:
        """Bytes of file `ino` that are not holes: its size minus its zero chunks."""
        chunks = index.file_chunks(ino)
        if len(chunks) <= 1:
            return size if not chunks or not index.chunk(chunks[0]).zero else 0
        records = (index.chunk(n) for n in chunks)
        zero = sum(rec.ulen for rec in records if rec.zero)
        return max(size - zero, 0)

    # -- names ------------------------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Attr:
        """Attributes of `name` in directory `parent`; FileNotFoundError if there is none."""
        directory = self._directory(parent)
        if name == b".":
            return self.attr(parent)
        if name == b"..":
            return self.attr(self._dirs[parent][1])
        found = self.composed.lookup(directory, name)
        if found is None:
            raise _not_found(f"no entry {name!r:.80} in inode {parent}")
        return self.attr(self._number(found, parent))

    def children(self, inode: int) -> tuple[tuple[bytes, int], ...]:
        """(name, inode) of directory `inode` in name order (cached; '.' and '..' omitted)."""
        listing = self._listings.get(inode)
        if listing is not None:
            self._listings.move_to_end(inode)
            return listing
        parent = self._directory(inode)
        listing = tuple(
            (name, self._number(child, inode)) for name, child in self._entries(parent)
        )
        self._listings[inode] = listing
        self._listed += len(listing)
        while self._listed > _LISTING_CACHE and len(self._listings) > 1:
            self._listed -= len(self._listings.popitem(last=False)[1])
        return listing

    def _shown_groups(self) -> Sequence[GroupIndex]:
        """The groups whose entries this tree shows (all of them, composed)."""
        return self.groups

    def _entries(self, directory: Entry) -> Iterator[tuple[bytes, Entry]]:
        """(name, entry) of `directory`, as `ComposedTree.entries` gives them. A directory of
        one layer (most are) is read straight from its index: nothing below it can show
        through, so it needs no lookup per name, only its whiteouts dropped."""
        if len(directory.layers) != 1:
            yield from self.composed.entries(directory)
            return
        group, dir_ino = directory.layers[0]
        index = self.groups[group]
        for name, ino in index.entries(dir_ino):
            rec = index.inode(ino)
            if rec.whiteout:
                continue
            yield name, Entry(group, ino, ((group, ino),) if rec.is_dir else ())

    def readlink(self, inode: int) -> bytes:
        """The target of symlink `inode` (EINVAL for anything else, as readlink(2) says)."""
        entry = self.entry(inode)
        index = self.groups[entry.group]
        if not index.inode(entry.inode).is_lnk:
            raise OSError(errno.EINVAL, f"inode {inode} is not a symlink")
        return index.readlink(entry.inode)

    # -- extended attributes ----------------------------------------------------------------

    def xattrs(self, inode: int) -> list[tuple[bytes, bytes]]:
        """Every (name, value) of `inode`, sorted by name (the topmost layer's, for a union
        directory: an upper directory's attributes win, as when layers are applied)."""
        entry = self.entry(inode)
        return self.groups[entry.group].xattrs(entry.inode)

    def getxattr(self, inode: int, name: bytes) -> bytes:
        """The value of xattr `name` of `inode`; OSError(ENODATA) if it has none."""
        for key, value in self.xattrs(inode):
            if key == name:
                return value
        raise OSError(errno.ENODATA, f"no attribute {name!r:.80}")

    # -- files ------------------------------------------------------------------------------

    def file(self, inode: int) -> tuple[GroupIndex, int]:
        """(index, record) holding regular file `inode`'s data."""
        entry = self.entry(inode)
        index = self.groups[entry.group]
        rec = index.inode(entry.inode)
        if rec.is_dir:
            raise IsADirectoryError(errno.EISDIR, f"inode {inode} is a directory")
        if not rec.is_reg:
            raise OSError(errno.EINVAL, f"inode {inode} is not a regular file")
        return index, entry.inode

    def usage(self) -> Usage:
        """Stored bytes (non-zero chunks) and inode records of the groups this tree shows,
        computed once on first use (a walk over the chunk tables, so never at mount time)."""
        if self._usage is None:
            data = inodes = 0
            for index in self._shown_groups():
                inodes += index.inode_count
                for n in range(index.header.chunk_count):
                    rec = index.chunk(n)
                    data += 0 if rec.zero else rec.ulen
            self._usage = Usage(data, inodes)
        return self._usage
