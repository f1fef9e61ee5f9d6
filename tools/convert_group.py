"""Building one group of a converted image on top of the groups below it, without tagging.

Owns: `StackedTree`, a `tree.GroupTree` that also sees the composed tree of the lower groups
(`LowerView`), for the two OCI rules a group cannot apply alone:

- a path may not go through a symlink, or a non-directory, that a lower layer left there
  (applying it would write outside the root, or replace a file with an implied directory):
  entries, whiteouts, opaque markers and hardlink targets are refused, as within a group;
- a hardlink may name a file of a lower layer. Groups cannot share an inode, so the file is
  copied up (as overlayfs does): every visible name of the lower inode is re-created in this
  group as one inode with the same attributes and data (read back from the store and
  deduplicated against the lower group, so nothing is uploaded twice), then linked. The
  copies stand for what lay below the layer, so a whiteout of the same layer hides them
  wherever it sits in the tar (OCI applies a layer's markers before its entries).

And `build_group_untagged`: layers -> tree, then chunks, blobs and the index stored through
the builder's pipeline (group_pipeline.py), nothing tagged (the conversion tags every group
and the environment only once all are stored).

Must not: parse layers (layers.py) or decide grouping, reuse or tags (convert.py).
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from weenvfs.format.compose import ComposedTree
from weenvfs.format.compose import Entry as LowerEntry
from weenvfs.format.digest import short
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import Node
from weenvfs.store.repository import Repository

from .chunker import Chunker, ChunkOptions, DedupTable
from .entries import KIND_OF_MODE, DataStream, Entry, Kind, refuse, show
from .group_pipeline import GroupOutcome, stage_and_store
from .layout import LayoutOrder
from .progress import Progress
from .reader import ChunkReader
from .tree import GroupTree, TreeCounts

log = logging.getLogger(__name__)



def _parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0]


class LowerView:
    """The composed tree of the groups below the one being built (lowest first)."""

    def __init__(self, groups: Sequence[GroupIndex], reader: ChunkReader | None) -> None:
        self.tree = ComposedTree(groups) if groups else None
        self.reader = reader

    def lookup(self, path: bytes) -> LowerEntry | None:
        """The lower entry at `path` (no symlinks followed), or None."""
        return None if self.tree is None else self.tree.resolve(path)

    def kind(self, entry: LowerEntry) -> int:
        assert self.tree is not None
        return stat.S_IFMT(self.tree.groups[entry.group].inode(entry.inode).mode)

    def names_of(self, entry: LowerEntry) -> list[bytes]:
        """Every visible path of the lower hardlinked inode of `entry` (one walk of its
        group's directories on first use, not of the whole composed tree)."""
        assert self.tree is not None
        return self.tree.visible_paths(entry)

    def copy(self, path: bytes, entry: LowerEntry) -> Entry:
        """An Entry re-creating the lower non-directory `entry` at `path`."""
        assert self.tree is not None and self.reader is not None
        index = self.tree.groups[entry.group]
        rec = index.inode(entry.inode)
        out = Entry(
            path,
            KIND_OF_MODE[stat.S_IFMT(rec.mode)],
            mode=stat.S_IMODE(rec.mode),
            uid=rec.uid,
            gid=rec.gid,
            mtime_ns=rec.mtime_sec * 1_000_000_000 + rec.mtime_nsec,
            size=rec.size if rec.is_reg else 0,
            rdev=rec.rdev,
            xattrs=dict(index.xattrs(entry.inode)),
        )
        if rec.is_lnk:
            out.target = index.readlink(entry.inode)
        elif rec.is_reg:
            reader, ino = self.reader, entry.inode
            out.open_data = lambda: DataStream(reader.open_file(index, ino))
        return out


class StackedTree:
    """A GroupTree checked against, and completed from, the lower groups (module doc)."""

    def __init__(self, lower: LowerView) -> None:
        self.tree = GroupTree()
        self.lower = lower
        self.copied_up = 0
        self._usable: set[bytes] = set()  # directory paths _check_dirs accepted

    @property
    def root(self) -> Node:
        return self.tree.root

    def begin_layer(self) -> None:
        self.tree.begin_layer()

    def add(self, entry: Entry) -> list[tuple[Entry, Node]]:
        """Apply `entry` (after any copy-up it needs); return the regular files whose data
        the caller must read now, in order."""
        out: list[tuple[Entry, Node]] = []
        if self.lower.tree is not None:
            marker = entry.kind in (Kind.WHITEOUT, Kind.OPAQUE)
            inner = entry.path if entry.kind is Kind.OPAQUE else _parent(entry.path)
            if not self._check_dirs(inner, entry.path, marker):
                return out  # a marker under a lower non-directory: nothing to hide
            if entry.kind is Kind.HARDLINK:
                self._check_dirs(_parent(entry.target), entry.path, False)
                self._copy_up(entry.target, out)
        node = self.tree.add(entry)
        if node is not None:
            out.append((entry, node))
        return out

    def _current(self, path: bytes) -> tuple[Node | None, bool]:
        """(this group's node at `path` or None, whether lower groups still show there)."""
        node: Node | None = self.tree.root
        lower_visible = not self.tree.root.opaque
        for part in path.split(b"/") if path else []:
            child = node.children.get(part) if node is not None and node.is_dir else None
            if child is None:
                return None, lower_visible
            if child.whiteout:
                return child, False
            if child.is_dir and child.opaque:
                lower_visible = False
            node = child
        return node, lower_visible

    def _check_dirs(self, path: bytes, for_path: bytes, marker: bool) -> bool:
        """Whether directory `path` is usable as seen through the lower groups: refuse a
        component that is a lower symlink, or (for an entry) a lower non-directory; False
        for a marker under a lower non-directory (OCI: nothing there to hide)."""
        if path in self._usable:
            return True
        done = b""
        for part in path.split(b"/") if path else []:
            done = done + b"/" + part if done else part
            node, lower_visible = self._current(done)
            if (node is not None and (node.whiteout or not node.is_dir)) or not lower_visible:
                break  # a fresh directory, or GroupTree's own rules apply
            if node is not None:
                continue
            low = self.lower.lookup(done)
            if low is None:
                break
            if low.is_dir:
                continue
            if self.lower.kind(low) == stat.S_IFLNK:
                raise refuse(
                    for_path,
                    f"parent {show(done)!r} is a symlink in a lower layer (symlink traversal)",
                )
            if marker:
                return False
            raise refuse(for_path, f"parent {show(done)!r} is not a directory in a lower layer")
        # Later entries of this group can only add directories, whiteouts or non-directories
        # (which GroupTree checks itself) on the way, so a usable path stays usable.
        self._usable.add(path)
        return True

    def _copy_up(self, target: bytes, out: list[tuple[Entry, Node]]) -> None:
        node, lower_visible = self._current(target)
        if node is not None or not lower_visible:
            return  # in this group already, or hidden: GroupTree links or refuses
        low = self.lower.lookup(target)
        if low is None or low.is_dir:
            return  # GroupTree refuses
        names = [target] + [
            n for n in self.lower.names_of(low) if n != target and self._shows_lower(n, low)
        ]
        log.debug("copying up %s (%d names) for a hardlink", show(target), len(names))
        for n, name in enumerate(names):
            if n == 0:
                copy = self.lower.copy(name, low)
            else:
                copy = Entry(name, Kind.HARDLINK, target=target)
            made = self.tree.add(copy, copied_up=True)
            if made is not None:
                out.append((copy, made))
        self.copied_up += 1

    def _shows_lower(self, path: bytes, low: LowerEntry) -> bool:
        node, lower_visible = self._current(path)
        return node is None and lower_visible and self.lower.lookup(path) == low

    def counts(self) -> TreeCounts:
        return self.tree.counts()


@dataclass(kw_only=True)
class StoredGroup(GroupOutcome):
    """A group built and stored (blobs and index), not tagged."""

    index: GroupIndex
    copied_up: int


LayerReader = Callable[[StackedTree, Chunker], None]


def build_group_untagged(
    read_layers: Sequence[LayerReader],
    lower: LowerView,
    repo: Repository,
    chunk: ChunkOptions,
    table: DedupTable,
    progress: Progress,
    tmp_dir: Path | None = None,
    layout: LayoutOrder | None = None,
) -> StoredGroup:
    """Apply the layers (each a function feeding a StackedTree and a Chunker) into one
    group, store its blobs and its index, and return what was stored."""
    tree = StackedTree(lower)

    def feed(chunker: Chunker) -> None:
        for read_layer in read_layers:
            tree.begin_layer()
            read_layer(tree, chunker)

    staged = stage_and_store(tree, feed, repo, chunk, table, progress, kind="convert",
                             tmp_dir=tmp_dir, layout=layout)  # layout: hinted data first
    digest = staged.stored.index_digest
    index = GroupIndex.from_object(staged.index_object)
    log.info("stored group index %s (%d new blobs)", short(digest), staged.blobs_new)
    return StoredGroup(index=index, copied_up=tree.copied_up, **staged.outcome(tree.counts()))
