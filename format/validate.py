"""Whole-index validation that the per-record accessors of `GroupIndex` cannot do.

`GroupIndex` checks each record when it is used, so loading stays O(1); but one rule is a
property of the whole directory graph: it must be a tree, every directory reachable from the
root by exactly one path (SPEC.md 6.15). A shared directory (a "directory hardlink") or a cycle
passes every record check, yet a reader that walks the tree would loop or serve the same
directory twice. `check_tree` is the one validator every reader of an index calls once, after
decoding it: the mount (core/environment.py), inspect, export and verify.

Must not: do I/O, or repeat the per-record checks beyond what the walk needs.
"""

from __future__ import annotations

import stat

from . import constants as C
from .errors import FormatError
from .index import ROOT_INODE, GroupIndex


def check_tree(index: GroupIndex) -> None:
    """Raise `FormatError` unless every directory of `index` is reachable by one path only.

    One pass over the directory entries of reachable directories: each entry is read once
    (ranges that overlap are refused as soon as the total exceeds the dirent table), so the
    cost is O(dirent_count) with a struct unpack per entry. Unreachable records are harmless
    to readers (never served) and are reported by `weenv verify`, not here.
    """
    h = index.header
    mv = memoryview(index.raw)
    inode_at, inode_size = h.inode_offset, C.INODE.size
    dirent_at, dirent_size = h.dirent_offset, C.DIRENT.size
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
        for n in range(rec.data_first, rec.data_first + rec.data_count):
            child = C.DIRENT.unpack_from(mv, dirent_at + n * dirent_size)[2]
            if not 0 < child < h.inode_count:
                raise FormatError(f"dirent {n} inode", f"{child} is not a valid child inode")
            # The mode is the first field of an inode record.
            mode = int.from_bytes(
                mv[inode_at + child * inode_size : inode_at + child * inode_size + 4], "little"
            )
            if not stat.S_ISDIR(mode):
                continue
            if child in seen:
                raise FormatError(
                    f"directory inode {child}",
                    "reachable by more than one path (a directory hardlink or a cycle)",
                )
            seen.add(child)
            stack.append(child)
