"""Assembling entries into one group's `Node` tree, with OCI layer semantics.

Owns: applying the entries of one or more layers, in order, into a single tree that the
index writer encodes. Within one layer a later entry for a path replaces an earlier one (as
tar extraction does). Across the layers of one group (`begin_layer`), as the OCI image spec
applies layers:

- a whiteout removes what earlier layers of the group put at that path and leaves a
  whiteout marker, so the name stays hidden in lower *groups* too;
- an opaque marker removes everything earlier layers put under its directory (what this
  layer put there stays) and keeps the directory's opaque flag for lower groups;
- a non-directory replacing a directory drops the subtree; a directory replacing a
  non-directory or a whiteout becomes opaque (a lower group's directory of that name was
  hidden by what it replaces, and must stay hidden);
- a directory entry over an existing directory updates its metadata and keeps its children.

Markers apply to earlier layers only (OCI applies a layer's markers before its entries), so
they never hide an entry of their own layer, wherever they sit in the tar. The directories on
a marker's path belong to its layer, as an entry's parents do (format/SPEC.md 7.1): a missing
one is created (implied), and one that another marker of the layer removes comes back fresh,
so `d/.wh..wh..opq` with `d/c/.wh.x` leaves an empty `d/c` in either order. A whiteout under a
non-directory is a no-op. A directory that a marker of this layer removed and something of the
layer re-creates is *fresh*: default attributes of its own (not implied, so lower groups'
attributes never show through it) and opaque.
Hardlinks are the same `Node` under several names; their target must already be in the tree.
Directories implied by a path but never declared get 0755 root:root, mtime 0.

Must not: read data or know about chunks; structural refusals go through `entries.refuse`.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, fields

from weenvfs.format.index_writer import Node

from .entries import DEFAULT_DIR_MODE, Entry, Kind, refuse, show

_FILE_TYPES = {
    Kind.DIR: stat.S_IFDIR,
    Kind.REG: stat.S_IFREG,
    Kind.SYMLINK: stat.S_IFLNK,
    Kind.CHR: stat.S_IFCHR,
    Kind.BLK: stat.S_IFBLK,
    Kind.FIFO: stat.S_IFIFO,
    Kind.SOCK: stat.S_IFSOCK,
}


def implied_dir() -> Node:
    """A directory no entry declared: 0755, root-owned, mtime 0, and flagged *implied* so a
    lower group's attributes for the same directory show through when groups compose."""
    return Node(mode=stat.S_IFDIR | DEFAULT_DIR_MODE, implied=True)


def whiteout_node() -> Node:
    """The marker that hides a name in lower groups (a 0/0 character device, as overlayfs)."""
    return Node(mode=stat.S_IFCHR, whiteout=True)


@dataclass
class TreeCounts:
    """What a finished tree holds (hardlinks count the extra names of a shared inode)."""

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    devices: int = 0
    fifos: int = 0
    sockets: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class GroupTree:
    """The tree of one group, built from the entries of one or more layers."""

    def __init__(self) -> None:
        self.root = implied_dir()
        self._touched: set[bytes] = set()  # paths the current layer has put or updated
        self._declared: set[bytes] = set()  # paths the current layer has an entry for
        self.layers = 0

    def begin_layer(self) -> None:
        """Start the next layer: its whiteouts and opaque markers hide what came before."""
        self._touched = set()
        self._declared = set()
        self.layers += 1

    def add(self, entry: Entry, *, copied_up: bool = False) -> Node | None:
        """Apply one entry; return the new Node of a regular file (whose data the caller
        reads), else None. `copied_up` marks an entry that re-creates a lower group's entry
        (convert_group.py): it stands for what lay below this layer, so this layer's markers
        hide it as they would have hidden the original, wherever they sit in the tar."""
        if self.layers == 0:
            self.begin_layer()
        if entry.kind is Kind.OPAQUE:
            self._opaque(entry.path)
            return None
        if not entry.path:
            if entry.kind is not Kind.DIR:
                raise refuse(entry.path, f"the root must be a directory, not a {entry.kind.value}")
            self._update_meta(self.root, entry)
            self._touched.add(b"")
            self._declared.add(b"")
            return None
        parent_path, _, name = entry.path.rpartition(b"/")
        if entry.kind is Kind.WHITEOUT:
            self._whiteout(parent_path, name, entry.path)
            return None
        parent = self._parent(parent_path, entry.path)
        existing = parent.children.get(name)
        if not copied_up:
            self._touch(entry.path)
            self._declared.add(entry.path)
        if entry.kind is Kind.HARDLINK:
            parent.children[name] = self._link_target(entry)
            return None
        if entry.kind is Kind.DIR and existing is not None and existing.is_dir:
            self._update_meta(existing, entry)
            return None
        node = self._new_node(entry)
        if entry.kind is Kind.DIR and existing is not None:
            node.opaque = True  # replaces a non-directory or a whiteout: see the module doc
        parent.children[name] = node
        return node if entry.kind is Kind.REG else None

    # -- helpers ----------------------------------------------------------------------------

    def _touch(self, path: bytes) -> None:
        while path and path not in self._touched:
            self._touched.add(path)
            path = path.rpartition(b"/")[0]

    def _parent(self, parent_path: bytes, for_path: bytes) -> Node:
        """The directory `parent_path`, creating implied directories; refuse traversal."""
        node = self.root
        if not parent_path:
            return node
        done = b""
        for part in parent_path.split(b"/"):
            done = done + b"/" + part if done else part
            child = node.children.get(part)
            if child is None or child.whiteout:
                fresh = implied_dir()
                if child is not None:  # re-creates a whited-out name: see the module doc
                    fresh.opaque, fresh.implied = True, False
                node.children[part] = child = fresh
            elif stat.S_ISLNK(child.mode):
                raise refuse(for_path, f"parent {show(done)!r} is a symlink (symlink traversal)")
            elif not child.is_dir:
                raise refuse(for_path, f"parent {show(done)!r} is not a directory")
            node = child
        return node

    def _lookup(self, path: bytes) -> Node | None:
        node = self.root
        for part in path.split(b"/") if path else []:
            if not node.is_dir:
                return None
            child = node.children.get(part)
            if child is None:
                return None
            node = child
        return node

    def _link_target(self, entry: Entry) -> Node:
        blocker = self._non_dir_ancestor(entry.target.rpartition(b"/")[0])
        if blocker is not None and stat.S_ISLNK(blocker[1].mode):
            raise refuse(entry.path, f"hardlink target goes through symlink {show(blocker[0])!r}")
        target = self._lookup(entry.target)
        if target is None or target.whiteout:
            raise refuse(entry.path, f"hardlink target {show(entry.target)!r} was not seen before")
        if target.is_dir:
            raise refuse(entry.path, f"hardlink target {show(entry.target)!r} is a directory")
        return target

    def _whiteout(self, parent_path: bytes, name: bytes, path: bytes) -> None:
        """Hide `path` as it stood before this layer (OCI applies markers first)."""
        blocker = self._non_dir_ancestor(parent_path)
        if blocker is not None:
            if stat.S_ISLNK(blocker[1].mode):
                raise refuse(path, f"parent {show(blocker[0])!r} is a symlink (symlink traversal)")
            return  # under a non-directory: nothing here or in lower groups to hide
        parent = self._parent(parent_path, path)
        self._touch(parent_path)
        existing = parent.children.get(name)
        if existing is None or path not in self._touched:
            parent.children[name] = whiteout_node()
        elif existing.is_dir:
            # This layer already has the directory (listed, or on the path of one of its
            # entries or markers): keep what the layer put there, drop the rest, and hide the
            # name in lower groups. Unless the layer lists it, it comes back fresh.
            if path not in self._declared:
                self._refresh(existing, implied=False)
            self._prune(existing, path)
            existing.opaque = True

    def _non_dir_ancestor(self, path: bytes) -> tuple[bytes, Node] | None:
        """The first existing non-directory on the way to `path` (whiteouts and missing
        names end the search: there is nothing below them)."""
        node, done = self.root, b""
        for part in path.split(b"/") if path else []:
            done = done + b"/" + part if done else part
            child = node.children.get(part)
            if child is None or child.whiteout:
                return None
            if not child.is_dir:
                return done, child
            node = child
        return None

    def _opaque(self, path: bytes) -> None:
        if path:
            parent_path, _, name = path.rpartition(b"/")
            parent = self._parent(parent_path, path)
            node = parent.children.get(name)
            if node is None or node.whiteout:
                fresh = implied_dir()
                fresh.implied = node is None  # over a whiteout: fresh (see the module doc)
                node = parent.children[name] = fresh
            elif not node.is_dir:
                raise refuse(path, "opaque marker in something that is not a directory")
        else:
            node = self.root
        self._prune(node, path)
        node.opaque = True
        self._touch(path)

    def _prune(self, node: Node, path: bytes) -> None:
        """Drop everything under `node` that the current layer did not put there. A kept
        directory the layer does not list was removed with the rest and re-created as a
        parent: it gets the attributes of an implied directory (nothing lower shows there)."""
        for name in list(node.children):
            child_path = path + b"/" + name if path else name
            child = node.children[name]
            if child_path not in self._touched:
                del node.children[name]
            elif child.is_dir:
                if child_path not in self._declared:
                    self._refresh(child, implied=True)
                self._prune(child, child_path)

    @staticmethod
    def _refresh(node: Node, implied: bool) -> None:
        """Give directory `node` the attributes of a directory no entry declared."""
        fresh = implied_dir()
        node.mode, node.uid, node.gid = fresh.mode, fresh.uid, fresh.gid
        node.mtime_ns, node.xattrs, node.implied = fresh.mtime_ns, {}, implied

    def _new_node(self, entry: Entry) -> Node:
        node = Node(mode=_FILE_TYPES[entry.kind])
        self._update_meta(node, entry)
        if entry.kind is Kind.REG:
            node.size = entry.size
        elif entry.kind is Kind.SYMLINK:
            node.target = entry.target
            node.size = len(entry.target)
        elif entry.kind in (Kind.CHR, Kind.BLK):
            node.rdev = entry.rdev
        return node

    @staticmethod
    def _update_meta(node: Node, entry: Entry) -> None:
        node.implied = False
        node.mode = stat.S_IFMT(node.mode) | entry.mode
        node.uid, node.gid, node.mtime_ns = entry.uid, entry.gid, entry.mtime_ns
        node.xattrs = dict(entry.xattrs)

    def counts(self) -> TreeCounts:
        """Count what the tree holds, each shared inode once plus its extra names."""
        counts = TreeCounts()
        seen: set[int] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                counts.hardlinks += 1
                continue
            seen.add(id(node))
            _count(counts, node)
            if node.is_dir:
                stack.extend(node.children.values())
        return counts


def _count(counts: TreeCounts, node: Node) -> None:
    if node.whiteout:
        counts.whiteouts += 1
        return
    kind = stat.S_IFMT(node.mode)
    if kind == stat.S_IFDIR:
        counts.dirs += 1
        counts.opaque_dirs += node.opaque
    elif kind == stat.S_IFREG:
        counts.files += 1
    elif kind == stat.S_IFLNK:
        counts.symlinks += 1
    elif kind in (stat.S_IFCHR, stat.S_IFBLK):
        counts.devices += 1
    elif kind == stat.S_IFIFO:
        counts.fifos += 1
    else:
        counts.sockets += 1
