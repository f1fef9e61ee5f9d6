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
  (found by a column scan of the type bits, columns.py);
- `DeviceLayout.pieces(offset, size)` splits a device range into (inode, file offset,
  length, position in the range) by bisecting the sorted extent starts; what falls between
  extents (a file's last block past its size) reads as zeros.

The layout depends on the group's own index only (not on the groups below it), so it is the
same for every stack the group sits in. Pure: no I/O (the codec's rule).
"""

from __future__ import annotations

import bisect
import stat
import struct
import sys
from array import array
from itertools import accumulate, compress
from operator import itemgetter
from typing import NamedTuple

from .columns import kind_flags, u64_column
from .constants import INODE, INODE_AT
from .index import GroupIndex

BLOCK_SIZE = 4096  # the device's block size: the EROFS image's (format/erofs.py)
# `DeviceLayout.to_bytes`: magic, extent count, then the columns as little-endian arrays.
_SAVED = struct.Struct("<8sQ")
_MAGIC = b"WEENVDL1"


class DevicePiece(NamedTuple):
    """Bytes [file_offset, file_offset + length) of record `ino`, at `at` in the read."""

    ino: int
    file_offset: int
    length: int
    at: int


class DeviceLayout:
    """The extents of every regular file of `index` on its group's data device."""

    def __init__(self, index: GroupIndex) -> None:
        # Read as columns of the raw inode table and selected in C (columns.py): this runs
        # at every cold mount of the kernel path (100k files: 110 ms as a loop over decoded
        # records; 46k: ~9 ms as list comprehensions over the columns, ~6 ms so). Records
        # are validated where they are used (the image builder and the reader decode them
        # through `GroupIndex.inode`).
        table = index.inode_table()
        files = list(compress(range(index.inode_count), kind_flags(table, stat.S_IFREG)))
        sizes = u64_column(table, INODE.size, INODE_AT["size"])
        file_sizes = itemgetter(*files)(sizes) if len(files) > 1 else [sizes[i] for i in files]
        self._inos = list(compress(files, file_sizes))  # those with data
        self._sizes = list(filter(None, file_sizes))
        # First block of each extent, and the device's size in blocks as the last item.
        self._first = list(accumulate([-(-size // BLOCK_SIZE) for size in self._sizes],
                                      initial=0))
        self._block_of: dict[int, int] | None = None  # record -> first block, on first use
        self.size = self._first[-1] * BLOCK_SIZE  # bytes: a whole number of blocks
        self._saved: bytes | None = None  # `to_bytes`, once made or read

    def to_bytes(self) -> bytes:
        """The layout as bytes `from_bytes` reads back (a node keeps it per index: computing
        it costs 45 ms at 100k files, reading it back a few; the kernel path's native device
        server reads it too). Made once per layout: 8 ms at 100k files."""
        if self._saved is None:
            columns = (array("I", self._inos), array("Q", self._sizes),
                       array("Q", self._first))
            if sys.byteorder != "little":
                for column in columns:
                    column.byteswap()
            self._saved = (_SAVED.pack(_MAGIC, len(self._inos))
                           + b"".join(c.tobytes() for c in columns))
        return self._saved

    @classmethod
    def from_bytes(cls, data: bytes) -> DeviceLayout:
        """A layout saved by `to_bytes`; ValueError if `data` is not one."""
        if len(data) < _SAVED.size:
            raise ValueError("not a saved device layout: too short")
        magic, count = _SAVED.unpack_from(data)
        if magic != _MAGIC or len(data) != _SAVED.size + count * 20 + 8:
            raise ValueError("not a saved device layout: bad header or length")
        # Kept as arrays: lists of 100k Python ints each cost ~10 ms at every mount, and
        # `pieces` indexes a few items per read.
        columns = [array("I"), array("Q"), array("Q")]
        at = _SAVED.size
        view = memoryview(data)
        for column, items in zip(columns, (count, count, count + 1), strict=True):
            end = at + items * column.itemsize
            column.frombytes(view[at:end])
            at = end
            if sys.byteorder != "little":
                column.byteswap()
        layout = cls.__new__(cls)
        layout._inos, layout._sizes, layout._first = columns
        layout._block_of = None
        layout.size = layout._first[-1] * BLOCK_SIZE
        layout._saved = data if isinstance(data, bytes) else bytes(data)
        return layout

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
        if self._block_of is None:  # only an image being derived asks: not the mount itself
            self._block_of = dict(zip(self._inos, self._first, strict=False))
        return self._block_of[ino]

    def pieces(self, offset: int, size: int) -> list[DevicePiece]:
        """The file ranges inside device bytes [offset, offset + size), in device order;
        bytes of the range no piece covers are zeros (block tails, past the end)."""
        end = min(offset + size, self.size)
        if offset < 0 or offset >= end:
            return []
        first, count = self._first, len(self._inos)
        k = max(bisect.bisect_right(first, offset // BLOCK_SIZE, 0, count) - 1, 0)
        out = []
        while k < count and first[k] * BLOCK_SIZE < end:
            start, length = first[k] * BLOCK_SIZE, self._sizes[k]
            lo, hi = max(offset, start), min(end, start + length)
            if lo < hi:
                out.append(DevicePiece(self._inos[k], lo - start, hi - lo, lo - offset))
            k += 1
        return out
