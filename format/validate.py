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

import stat
import struct

from . import constants as C
from .errors import FormatError
from .index import ROOT_INODE, GroupIndex

_MODE = struct.Struct(f"<I{C.INODE.size - 4}x")  # the mode is an inode record's first field
_S_IFMT, _DIR = 0o170000, stat.S_IFDIR


def check_tree(index: GroupIndex) -> None:
    """Raise `FormatError` unless every directory of `index` is reachable by one path only.

    One pass over the inode table (for the type bits) and over the directory entries of
    reachable directories: each entry is read once (ranges that overlap are refused as soon as
    their total exceeds the dirent table), so the cost is O(inode_count + dirent_count), each
    table unpacked by `iter_unpack`. Unreachable records are harmless to readers (never
    served) and are reported by `weenv verify`, not here.
    """
    h = index.header
    mv = memoryview(index.raw)
    # One C-level pass over the inode table for the type bits: the set of directories.
    inodes = mv[h.inode_offset : h.inode_offset + h.inode_count * C.INODE.size]
    dirs = {ino for ino, (mode,) in enumerate(_MODE.iter_unpack(inodes)) if mode & _S_IFMT == _DIR}
    seen = {ROOT_INODE}
    stack = [ROOT_INODE]
    budget = h.dirent_count
    while stack:
        parent = stack.pop()
        rec = index.inode(parent)  # validates the dirent range against the table
        budget -= rec.data_count
        if budget < 0:
            raise FormatError(
                f"directory inode {parent}", "entries overlap another directory's (shared)"
            )
        start = h.dirent_offset + rec.data_first * C.DIRENT.size
        entries = mv[start : start + rec.data_count * C.DIRENT.size]
        children = [child for _, _, child in C.DIRENT.iter_unpack(entries)]
        if children and not 0 < min(children) <= max(children) < h.inode_count:
            bad = next(c for c in children if not 0 < c < h.inode_count)
            raise FormatError(
                f"directory inode {parent} entry", f"{bad} is not a valid child inode"
            )
        for child in children:
            if child not in dirs:
                continue
            if child in seen:
                raise FormatError(
                    f"directory inode {child}",
                    "reachable by more than one path (a directory hardlink or a cycle)",
                )
            seen.add(child)
            stack.append(child)
