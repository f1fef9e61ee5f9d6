"""Where each regular file of one group lives on that group's virtual data device.

The kernel path (DESIGN.md, "Data path of a read") mounts an EROFS metadata image whose
regular files are chunk-based inodes addressing one extra device per group. That device is
virtual: nothing stores it, the mount daemon serves it lazily (weenvfs/core/device_reader.py)
by turning a device range back into file ranges and those into chunks. This module owns that
mapping, which is part of the format (SPEC.md section 15): a published EROFS image
(erofs_group.py) addresses the device by it, so every node must compute the same one:

- every regular file with data gets one contiguous, block-aligned extent, in inode order
  (the builder numbers inodes in walk order, which is also how it packs blobs, so a device
  read-ahead runs along the store's layout); hardlinks share their record, so one extent
  (S_IFREG is spelled 0o100000 in the scan: `stat.S_ISREG` per record costs a call);
- `DeviceLayout.pieces(offset, size)` splits a device range into (inode, file offset,
  length, position in the range) by bisecting the sorted extent starts; what falls between
  extents (a file's last block past its size) reads as zeros.

The layout depends on the group's own index only (not on the groups below it), so it is the
same for every stack the group sits in. Pure: no I/O (the codec's rule).
"""

from __future__ import annotations

import bisect
from array import array
from typing import NamedTuple

from .constants import INODE
from .index import GroupIndex

BLOCK_SIZE = 4096  # the device's block size: the EROFS image's (format/erofs.py)


class DevicePiece(NamedTuple):
    """Bytes [file_offset, file_offset + length) of record `ino`, at `at` in the read."""

    ino: int
    file_offset: int
    length: int
    at: int


class DeviceLayout:
    """The extents of every regular file of `index` on its group's data device."""

    def __init__(self, index: GroupIndex) -> None:
        self._starts = array("q")  # device byte offset of each extent, ascending
        self._inos = array("q")
        self._sizes = array("q")
        self._block_of: dict[int, int] = {}
        position = 0
        # One pass over the raw inode table (mode and size only): this runs at every mount of
        # the kernel path. Records are validated where they are used (the image builder and
        # the reader decode them through `GroupIndex.inode`).
        h = index.header
        table = memoryview(index.raw)[h.inode_offset:h.inode_offset + h.inode_count * INODE.size]
        for ino, record in enumerate(INODE.iter_unpack(table)):
            mode, size = record[0], record[4]
            if mode & 0o170000 != 0o100000 or size == 0:
                continue
            self._block_of[ino] = position // BLOCK_SIZE
            self._starts.append(position)
            self._inos.append(ino)
            self._sizes.append(size)
            position += -(-size // BLOCK_SIZE) * BLOCK_SIZE
        self.size = position  # bytes: a whole number of blocks

    @property
    def blocks(self) -> int:
        """The device's size in blocks."""
        return self.size // BLOCK_SIZE

    @property
    def files(self) -> int:
        """How many extents (regular files with data) the device holds."""
        return len(self._inos)

    def start_block(self, ino: int) -> int:
        """The first block of record `ino`'s extent (KeyError: not a file with data)."""
        return self._block_of[ino]

    def pieces(self, offset: int, size: int) -> list[DevicePiece]:
        """The file ranges inside device bytes [offset, offset + size), in device order;
        bytes of the range no piece covers are zeros (block tails, past the end)."""
        end = min(offset + size, self.size)
        if offset < 0 or offset >= end:
            return []
        k = max(bisect.bisect_right(self._starts, offset) - 1, 0)
        out = []
        while k < len(self._starts) and self._starts[k] < end:
            start, length = self._starts[k], self._sizes[k]
            lo, hi = max(offset, start), min(end, start + length)
            if lo < hi:
                out.append(DevicePiece(self._inos[k], lo - start, hi - lo, lo - offset))
            k += 1
        return out
