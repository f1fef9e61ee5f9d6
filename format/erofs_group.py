"""A group's EROFS metadata image (SPEC.md section 15.9): its inodes, from its index.

`GroupImage(index, layout).image()` is the image of a group as the lowest layer of a stack,
or mounted alone: every entry of the index but whiteouts (nothing lies below to hide), each
directory with its own attributes, every xattr but `trusted.overlay.*` (an image must not
steer overlayfs), regular files as chunk-based inodes on the group's data device
(device_layout.py): chunk k of a file is device block `start + k * chunk_blocks` when the
index's chunk size is a power of two of at least a block, a zero chunk is a hole the kernel
never reads, and a file of one chunk (small, or batched) is one chunk as large as it needs.

This image is a pure function of the index, so a publisher computes it once and stores it
(`erofs/<digest>`, named in the manifest), and a node mounts it after checking its digest
instead of deriving it again. Groups higher in a stack need to know what lies below them
(which whiteouts show, what an implied directory looks like): the node derives those with a
subclass that answers the two hooks from the composed tree (weenvfs/core/kernel_image.py).

Must not: do I/O, or know composition beyond the two hooks.
"""

from __future__ import annotations

import stat
from typing import NamedTuple

from . import erofs
from .constants import CHUNK_ZERO, MAX_IMAGE_SIZE
from .device_layout import BLOCK_SIZE, DeviceLayout
from .errors import FormatError
from .index import ROOT_INODE, GroupIndex, Inode

OVERLAY_XATTR_PREFIX = b"trusted.overlay."
OPAQUE_XATTR = (b"trusted.overlay.opaque", b"y")
WHITEOUT_MODE = stat.S_IFCHR  # with rdev 0: what overlayfs takes for a whiteout
DEVICE_TAG = b"weenv-group"  # the device slot's tag in every image (SPEC.md 15.9)


class DirectoryView(NamedTuple):
    """How a directory of the group is shown: what the two hooks answer."""

    below: bool  # something lies below it in the stack, so its whiteouts must show
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    xattrs: tuple[tuple[bytes, bytes], ...]


def chunk_bits(chunk_size: int) -> int | None:
    """log2(chunk_size / BLOCK_SIZE) when an index's chunks can be EROFS chunks, else None."""
    if chunk_size < BLOCK_SIZE or chunk_size & (chunk_size - 1):
        return None
    return chunk_size.bit_length() - BLOCK_SIZE.bit_length()


def whole_file_bits(size: int) -> int:
    """The smallest chunk size (as bits over BLOCK_SIZE) that holds `size` bytes at once."""
    blocks = max(-(-size // BLOCK_SIZE), 1)
    return (blocks - 1).bit_length()


def own_xattrs(pairs: list[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """An entry's xattrs as an image shows them: without `trusted.overlay.*`."""
    return tuple((k, v) for k, v in pairs if not k.startswith(OVERLAY_XATTR_PREFIX))


class GroupImage:
    """The image of `index` as the lowest layer; subclasses answer the hooks for others.

    A directory is identified by a handle the hooks choose (here: its record number)."""

    def __init__(self, index: GroupIndex, layout: DeviceLayout) -> None:
        self.index = index
        self.layout = layout
        self.bits = chunk_bits(index.chunk_size)
        self._records: dict[int, Inode] = {}
        self._zero: bytes | None = None
        self._bytes = 0  # a lower bound of the image's size so far (`_spend`)

    # -- the hooks ------------------------------------------------------------------------

    def root(self) -> object:
        """The handle of the root directory."""
        return ROOT_INODE

    def own(self, handle: object) -> int:
        """The group record of directory `handle`."""
        assert isinstance(handle, int)
        return handle

    def directory(self, handle: object) -> DirectoryView:
        """How directory `handle` is shown: alone, its own attributes, nothing below."""
        ino = self.own(handle)
        rec = self.record(ino)
        return DirectoryView(False, rec.mode, rec.uid, rec.gid, rec.mtime_ns,
                             own_xattrs(self.index.xattrs(ino)))

    def child(self, handle: object, name: bytes, ino: int) -> object:
        """The handle of subdirectory `name` (record `ino`) of directory `handle`."""
        return ino

    # -- the walk -------------------------------------------------------------------------

    def record(self, ino: int) -> Inode:
        """Record `ino` of the index, validated once."""
        rec = self._records.get(ino)
        if rec is None:
            rec = self._records[ino] = self.index.inode(ino)
        return rec

    def image(self, device_tag: bytes = b"") -> bytes:
        """The EROFS image bytes."""
        return erofs.write_image(self.inodes(), self.layout.blocks, device_tag)

    def inodes(self) -> list[erofs.ErofsInode]:
        """Every inode reachable from the root, the root first."""
        out: list[erofs.ErofsInode | None] = [None]
        leaves: dict[int, int] = {}  # record -> position (hardlinks share one inode)
        pending = [(self.root(), 0)]  # (handle of a directory, its position in out)
        while pending:
            handle, position = pending.pop()
            view = self.directory(handle)
            entries, subdirs = [], 0
            self._spend(erofs.INODE_SIZE + sum(len(v) + 4 for _, v in view.xattrs))
            for name, ino in self.index.entries(self.own(handle)):
                rec = self.record(ino)
                if rec.is_dir:
                    n = len(out)
                    out.append(None)
                    pending.append((self.child(handle, name, ino), n))
                    subdirs += 1
                elif rec.whiteout and not view.below:
                    continue
                else:
                    n = leaves.get(ino)
                    if n is None:
                        n = leaves[ino] = len(out)
                        out.append(self._leaf(ino, rec))
                self._spend(erofs.DIRENT_SIZE + len(name))
                entries.append((name, n))
            # nlink: exact within this layer (2 + subdirectories), as local file systems say.
            out[position] = erofs.ErofsInode(
                mode=view.mode, uid=view.uid, gid=view.gid, nlink=2 + subdirs,
                mtime_ns=view.mtime_ns, xattrs=view.xattrs, entries=tuple(entries))
        assert all(inode is not None for inode in out)
        return out  # type: ignore[return-value]

    def _spend(self, size: int) -> None:
        """Count `size` more bytes the image will hold at least; refuse past MAX_IMAGE_SIZE.

        Index records may share strings and chunk ranges, so a small index can describe a
        huge image: the refusal comes before the inodes that would hold it are built."""
        self._bytes += size
        if self._bytes > MAX_IMAGE_SIZE:
            raise FormatError("EROFS image", f"would exceed {MAX_IMAGE_SIZE} bytes")

    def _leaf(self, ino: int, rec: Inode) -> erofs.ErofsInode:
        self._spend(erofs.INODE_SIZE)
        if rec.whiteout:  # overlayfs' whiteout: a character device 0/0
            return erofs.ErofsInode(mode=WHITEOUT_MODE, uid=0, gid=0, nlink=1,
                                    mtime_ns=rec.mtime_ns)
        xattrs = own_xattrs(self.index.xattrs(ino)) if rec.xattr_count else ()
        self._spend(sum(len(v) + 4 for _, v in xattrs))
        if rec.is_lnk:
            self._spend(rec.data_count)  # the target's length
            return erofs.ErofsInode(rec.mode, rec.uid, rec.gid, rec.nlink, rec.mtime_ns,
                                    xattrs=xattrs, target=self.index.readlink(ino))
        if not rec.is_reg:
            return erofs.ErofsInode(rec.mode, rec.uid, rec.gid, rec.nlink, rec.mtime_ns,
                                    rdev=rec.rdev, xattrs=xattrs)
        if rec.size == 0:
            return erofs.ErofsInode(rec.mode, rec.uid, rec.gid, rec.nlink, rec.mtime_ns,
                                    xattrs=xattrs)
        bits, chunks = self._chunks(ino, rec)
        return erofs.ErofsInode(rec.mode, rec.uid, rec.gid, rec.nlink, rec.mtime_ns,
                                xattrs=xattrs, size=rec.size, chunk_bits=bits, chunks=chunks)

    def _chunks(self, ino: int, rec: Inode) -> tuple[int, tuple[int, ...]]:
        """(chunk bits, device block of each chunk or HOLE) of regular file record `ino`."""
        count, first, size = rec.data_count, rec.data_first, rec.size
        if (first + count > self.index.header.chunk_count or count == 0
                or (count > 1 and (count != -(-size // self.index.chunk_size)
                                   or rec.inner_offset))):
            self.index.file_chunks(ino)  # raises the FormatError that names the problem
        start, zero = self.layout.start_block(ino), self._zero_chunks()
        if count == 1:  # a small file, alone or batched: one chunk holds it all
            return whole_file_bits(size), (erofs.HOLE if zero[first] else start,)
        if self.bits is None:  # chunks EROFS cannot mirror: one extent, zeros served
            return whole_file_bits(size), (start,)
        self._spend(count * erofs.CHUNK_INDEX_SIZE)  # before building `count` block numbers
        step = 1 << self.bits
        return self.bits, tuple(erofs.HOLE if zero[first + k] else start + k * step
                                for k in range(count))

    def _zero_chunks(self) -> bytes:
        """One byte per chunk record: 1 for a zero chunk (a hole), decoded in one pass. The
        reader validates every record it fetches; a hole is never fetched."""
        if self._zero is None:
            self._zero = bytes(flags & CHUNK_ZERO for _, _, flags, _, _, _
                               in self.index.raw_chunks())
        return self._zero


def group_image(index: GroupIndex) -> bytes:
    """The published image of a group (SPEC.md 15.9): `GroupImage` over its own layout."""
    return GroupImage(index, DeviceLayout(index)).image(DEVICE_TAG)
