"""OCI union semantics over decoded group indexes, computed lazily per directory.

A composed directory is the list of its *layers*: (group position, inode) pairs, topmost first,
of every group that has a directory at that path, cut below an opaque directory or below a group
where the path is not a directory. Lookup and listing merge those layers on demand, so the cost
of composing grows with the directories visited, never with the size of the groups. Pure; no I/O.

Rules (as the OCI image spec applies layers): an upper entry hides the same name below it; a
whiteout hides the name below and is itself invisible; an opaque directory hides everything below
it in lower groups; a non-directory hides a lower directory of the same name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from .index import ROOT_INODE, GroupIndex

Layer = tuple[int, int]  # (group position, inode number in that group's index)


class Entry(NamedTuple):
    """A composed entry: the topmost layer that defines it, and for directories all layers."""

    group: int
    inode: int
    layers: tuple[Layer, ...]  # empty for non-directories

    @property
    def is_dir(self) -> bool:
        return bool(self.layers)


class ComposedTree:
    """The union of `groups` (lowest first, as in a manifest)."""

    def __init__(self, groups: Sequence[GroupIndex]) -> None:
        self.groups = list(groups)
        top = len(self.groups) - 1
        self.root = Entry(
            top, ROOT_INODE, self._dir_layers([(g, ROOT_INODE) for g in range(top, -1, -1)])
        )

    def _dir_layers(self, candidates: list[Layer]) -> tuple[Layer, ...]:
        """Keep candidate directory layers down to the first opaque one."""
        layers = []
        for g, ino in candidates:
            layers.append((g, ino))
            if self.groups[g].inode(ino).opaque:
                break
        return tuple(layers)

    def lookup(self, parent: Entry, name: bytes) -> Entry | None:
        """The entry `name` in composed directory `parent`, or None."""
        dirs: list[Layer] = []
        for g, dir_ino in parent.layers:
            index = self.groups[g]
            ino = index.lookup(dir_ino, name)
            if ino is None:
                continue
            rec = index.inode(ino)
            if rec.whiteout:
                break
            if not rec.is_dir:
                if not dirs:
                    return Entry(g, ino, ())
                break  # a lower non-directory is hidden by the directory above it
            dirs.append((g, ino))
            if rec.opaque:
                break
        if not dirs:
            return None
        g, ino = dirs[0]
        return Entry(g, ino, self._dir_layers(dirs))

    def names(self, parent: Entry) -> list[bytes]:
        """The visible names of composed directory `parent`, sorted by bytes."""
        visible: set[bytes] = set()
        hidden: set[bytes] = set()
        for g, dir_ino in parent.layers:
            index = self.groups[g]
            for name, ino in index.entries(dir_ino):
                if name in hidden or name in visible:
                    continue
                if index.inode(ino).whiteout:
                    hidden.add(name)
                else:
                    visible.add(name)
        return sorted(visible)

    def entries(self, parent: Entry) -> Iterator[tuple[bytes, Entry]]:
        """(name, entry) of composed directory `parent` in name order."""
        for name in self.names(parent):
            entry = self.lookup(parent, name)
            if entry is not None:
                yield name, entry

    def resolve(self, path: bytes) -> Entry | None:
        """The entry at relative `path` (no symlinks followed), or None."""
        entry: Entry | None = self.root
        for part in path.split(b"/"):
            if part in (b"", b"."):
                continue
            if entry is None or not entry.is_dir:
                return None
            entry = self.lookup(entry, part)
        return entry

    def walk(self) -> Iterator[tuple[bytes, Entry]]:
        """Every (path, entry) of the composed tree, depth-first in name order (root is b'')."""
        stack: list[tuple[bytes, Entry]] = [(b"", self.root)]
        while stack:
            path, entry = stack.pop()
            yield path, entry
            if entry.is_dir:
                children = [(path + b"/" + n if path else n, e) for n, e in self.entries(entry)]
                stack.extend(reversed(children))
