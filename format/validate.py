"""Whole-index validation that the per-record accessors of `GroupIndex` cannot do.

`GroupIndex` checks each record when it is used, so loading stays O(1); but one rule is a
property of the whole directory graph: it must be a tree, every directory reachable from the
root by exactly one path (SPEC.md 6.15). A shared directory (a "directory hardlink") or a cycle
passes every record check, yet a reader that walks the tree would loop or serve the same
directory twice. `check_tree` is the one validator every reader of an index calls once, after
decoding it: the mount (core/loaded_env.py), inspect, export and verify.

Must not: do I/O, or repeat the per-record checks beyond what the walk needs.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from itertools import compress
from operator import itemgetter
from typing import NoReturn

from . import constants as C
from .errors import FormatError
from .index import ROOT_INODE, GroupIndex

# Byte offsets of the fields the walk reads (the formats before them in C.INODE, C.DIRENT).
_MODE_TYPE_BYTE = 1  # the second byte of the little-endian mode holds the file type bits
_DATA_FIRST = struct.calcsize("<IIIIQqIIQ")
_DATA_COUNT = _DATA_FIRST + 4
_CHILD = struct.calcsize("<IHxx")
# 1 for the type byte of a directory (S_IFDIR 0o040000: 0x40 in the high nibble), else 0.
_DIRECTORY = bytes(int(b >> 4 == 0x4) for b in range(256))
# Whether a native u32 is little-endian, as the format's are (tests turn it off).
_NATIVE_LE = sys.byteorder == "little"


def _u32_column(raw: bytes, start: int, count: int, size: int, field: int) -> Sequence[int]:
    """The little-endian u32 at byte `field` of each of `count` records of `size` bytes from
    `start`, decoded in C: one strided view where native words are little-endian."""
    table = memoryview(raw)[start : start + count * size]
    if _NATIVE_LE and size % 4 == 0 and field % 4 == 0:
        return table.cast("I")[field // 4 :: size // 4].tolist()
    one = struct.Struct(f"<{field}xI{size - field - 4}x")
    return [value for (value,) in one.iter_unpack(table)]


def check_tree(index: GroupIndex) -> None:
    """Raise `FormatError` unless every directory of `index` is reachable by one path only.

    The columns the walk needs (type bits, dirent ranges, child inodes) are read out of the
    tables in C, then the walk visits reachable directories only: each entry is read once
    (ranges that overlap are refused as soon as their total exceeds the dirent table), and a
    directory's children are sorted into directories and the rest in C too, so the Python
    work is O(directories). Unreachable records are harmless to readers (never served) and
    are reported by `weenv verify`, not here; each record's other fields are checked when it
    is used.
    """
    h = index.header
    raw = index.raw
    inode_end = h.inode_offset + h.inode_count * C.INODE.size
    is_dir = raw[h.inode_offset + _MODE_TYPE_BYTE : inode_end : C.INODE.size].translate(_DIRECTORY)
    firsts = _u32_column(raw, h.inode_offset, h.inode_count, C.INODE.size, _DATA_FIRST)
    counts = _u32_column(raw, h.inode_offset, h.inode_count, C.INODE.size, _DATA_COUNT)
    entries = _u32_column(raw, h.dirent_offset, h.dirent_count, C.DIRENT.size, _CHILD)
    seen = {ROOT_INODE}
    stack = [ROOT_INODE]
    budget = h.dirent_count
    while stack:
        parent = stack.pop()
        first, count = firsts[parent], counts[parent]
        if not count:
            continue
        if first + count > h.dirent_count:
            raise FormatError(f"inode {parent} data",
                              f"dirent range {first}+{count} exceeds {h.dirent_count}")
        budget -= count
        if budget < 0:
            raise FormatError(
                f"directory inode {parent}", "entries overlap another directory's (shared)"
            )
        children = entries[first : first + count]
        try:  # a child past the inode table fails the lookup of its type
            kinds = itemgetter(*children)(is_dir) if count > 1 else (is_dir[children[0]],)
        except IndexError:
            _refuse_child(parent, next(c for c in children if c >= h.inode_count))
        for child in compress(children, kinds):
            if child == ROOT_INODE:  # the root is a directory: only its own entries name it
                _refuse_child(parent, child)
            if child in seen:
                raise FormatError(
                    f"directory inode {child}",
                    "reachable by more than one path (a directory hardlink or a cycle)",
                )
            seen.add(child)
            stack.append(child)


def _refuse_child(parent: int, child: int) -> NoReturn:
    raise FormatError(f"directory inode {parent} entry", f"{child} is not a valid child inode")
