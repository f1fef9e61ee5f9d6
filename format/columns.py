"""Columns of the index's fixed-size tables, read in C.

A mount scans whole tables of a group index before it serves anything (the tree check,
validate.py; the data device's layout, device_layout.py): 46,733 inode records for the
reference image. Unpacking every record into a tuple, or testing each in a Python loop, cost
those two scans ~28 ms per cold group mount; with each column read as a strided view of
machine words (well under a millisecond) and each type test as one `bytes.translate` over
the records' type bytes, they cost ~11 ms.

Owns: `u32_column`, `u64_column`, `kind_flags`. Pure: no I/O.
"""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Sequence

from . import constants as C

# Whether native words are little-endian, as the format's are (tests turn it off to run the
# portable reader).
NATIVE_LE = sys.byteorder == "little"
# The little-endian mode's second byte holds the file type bits (S_IFMT, 0o170000).
_TYPE_BYTE = C.INODE_AT["mode"] + 1


def _column(table: memoryview, size: int, field: int, code: str) -> Sequence[int]:
    width = struct.calcsize(code)
    if NATIVE_LE and size % width == 0 and field % width == 0:
        return table.cast(code)[field // width :: size // width]
    one = struct.Struct(f"<{field}x{code}{size - field - width}x")
    return [value for (value,) in one.iter_unpack(table)]


def u32_column(table: memoryview, size: int, field: int) -> Sequence[int]:
    """The little-endian u32 at byte `field` of each `size`-byte record of `table`: a view
    into it where native words are little-endian (ints made only as they are read: a
    256 MiB index's columns as lists would be hundreds of MB), else a list."""
    return _column(table, size, field, "I")


def u64_column(table: memoryview, size: int, field: int) -> Sequence[int]:
    """The little-endian u64 at byte `field` of each `size`-byte record of `table` (as
    `u32_column`)."""
    return _column(table, size, field, "Q")


def kind_flags(inode_table: memoryview, kind: int) -> bytes:
    """For each record of `inode_table`, 1 if its file type is `kind` (an S_IF* value),
    else 0: one byte per inode, indexable by inode number."""
    return inode_table[_TYPE_BYTE :: C.INODE.size].tobytes().translate(_kind_table(kind))


@functools.cache
def _kind_table(kind: int) -> bytes:
    """The `bytes.translate` table of a type byte to 1 for file type `kind`, else 0."""
    return bytes(int(b >> 4 == kind >> 12) for b in range(256))

