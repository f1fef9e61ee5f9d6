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
from itertools import compress
from operator import itemgetter
from typing import NoReturn

from . import constants as C
from .columns import kind_flags, u32_column
from .errors import FormatError
from .index import ROOT_INODE, GroupIndex


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
    inodes = index.inode_table()
    is_dir = kind_flags(inodes, stat.S_IFDIR)
    firsts = u32_column(inodes, C.INODE.size, C.INODE_AT["data_first"])
    counts = u32_column(inodes, C.INODE.size, C.INODE_AT["data_count"])
    entries = u32_column(index.dirent_table(), C.DIRENT.size, C.DIRENT_AT["inode"])
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
