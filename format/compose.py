"""OCI union semantics over decoded group indexes, computed lazily per directory.

A composed directory is the list of its *layers*: (group position, inode) pairs, topmost first,
of every group that has a directory at that path, cut below an opaque directory or below a group
where the path is not a directory. Lookup and listing merge those layers on demand, so the cost
of composing grows with the directories visited, never with the size of the groups. Pure; no I/O.

Rules (as the OCI image spec applies layers): an upper entry hides the same name below it; a
whiteout hides the name below and is itself invisible; an opaque directory hides everything below
it in lower groups; a non-directory hides a lower directory of the same name. A hardlinked
file has as many links as it has visible names (`link_count`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from .errors import FormatError
from .index import ROOT_INODE, GroupIndex

Layer = tuple[int, int]  # (group position, inode number in that group's index)


class Entry(NamedTuple):
    """A composed entry: the record whose attributes it shows, and for directories all layers.

    A directory shows the attributes of the topmost directory at its path that is not
    *implied* (a directory a layer tar only implied by a path below it or marked opaque), or
    of its lowest layer if all are implied. That directory may lie below an opaque layer, so
    outside `layers`: an opaque marker hides a lower directory's entries, not its attributes.
    """

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
        self.root = self._dir_entry(iter([(g, ROOT_INODE) for g in range(top, -1, -1)]))
        # Group -> {record: its paths in that group}, for hardlinked non-directories; built
        # on first use per group (see link_count).
        self._link_paths: dict[int, dict[int, list[bytes]]] = {}
        self._link_counts: dict[Layer, int] = {}

    def _dir_entry(self, chain: Iterator[Layer]) -> Entry:
        """The directory whose same-path directories, topmost first, `chain` yields (it ends
        at a whiteout or a non-directory): its layers are cut below the first opaque one, its
        attributes come from the topmost one not implied, looked for past the cut too."""
        layers: list[Layer] = []
        shown: Layer | None = None
        cut = False
        for g, ino in chain:
            rec = self.groups[g].inode(ino)
            if shown is None and not rec.implied:
                shown = (g, ino)
            if not cut:
                layers.append((g, ino))
                cut = rec.opaque
            if cut and shown is not None:
                break
        g, ino = shown or layers[-1]
        return Entry(g, ino, tuple(layers))

    def _same_path(self, parent: Entry, name: bytes) -> Iterator[Layer]:
        """The directories `name` of the layers of `parent`, topmost first, up to the first
        whiteout or non-directory (which hide everything below them)."""
        for g, dir_ino in parent.layers:
            index = self.groups[g]
            ino = index.lookup(dir_ino, name)
            if ino is None:
                continue
            rec = index.inode(ino)
            if rec.whiteout or not rec.is_dir:
                return
            yield g, ino

    def lookup(self, parent: Entry, name: bytes) -> Entry | None:
        """The entry `name` in composed directory `parent`, or None."""
        for g, dir_ino in parent.layers:
            index = self.groups[g]
            ino = index.lookup(dir_ino, name)
            if ino is None:
                continue
            rec = index.inode(ino)
            if rec.whiteout:
                return None
            if not rec.is_dir:
                return Entry(g, ino, ())
            break  # the topmost is a directory: compose it
        else:
            return None
        return self._dir_entry(self._same_path(parent, name))

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

    def link_count(self, entry: Entry) -> int:
        """The number of visible names of non-directory `entry`. Its index's nlink counts its
        names in its own group, some of which an upper group may hide; those of the topmost
        group are all visible. Otherwise counted once per record, on first use."""
        g, ino = entry.group, entry.inode
        nlink = self.groups[g].inode(ino).nlink
        if nlink <= 1 or g == len(self.groups) - 1:
            return nlink
        count = self._link_counts.get((g, ino))
        if count is None:
            count = self._link_counts[(g, ino)] = max(len(self.visible_paths(entry)), 1)
        return count

    def visible_paths(self, entry: Entry) -> list[bytes]:
        """Every path at which hardlinked non-directory `entry` (nlink > 1) is visible."""
        paths = self._paths_in_group(entry.group).get(entry.inode, [])
        found = (self.resolve(p) for p in paths)
        return [p for p, e in zip(paths, found, strict=True) if e == (entry.group, entry.inode, ())]

    def _paths_in_group(self, g: int) -> dict[int, list[bytes]]:
        """{record: its paths in group `g`} of `g`'s hardlinked non-directories (one walk of
        `g`'s directories, on first use; small: only hardlinked records are kept)."""
        known = self._link_paths.get(g)
        if known is not None:
            return known
        index, out = self.groups[g], {}
        stack, seen = [(b"", ROOT_INODE)], {ROOT_INODE}
        while stack:
            path, dir_ino = stack.pop()
            for name, ino in index.entries(dir_ino):
                rec = index.inode(ino)
                child = path + b"/" + name if path else name
                if rec.is_dir:
                    if ino in seen:
                        raise FormatError(f"group {g} inode {ino}", "directory cycle")
                    seen.add(ino)
                    stack.append((child, ino))
                elif rec.nlink > 1 and not rec.whiteout:
                    out.setdefault(ino, []).append(child)
        self._link_paths[g] = out
        return out

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
        seen: set[Layer] = set()
        while stack:
            path, entry = stack.pop()
            yield path, entry
            if entry.is_dir:
                # Each directory of a group has one path; a layer met twice means a corrupt
                # group whose cycles would make this walk endless.
                if not seen.isdisjoint(entry.layers):
                    raise FormatError(f"group {entry.group} inode {entry.inode}", "directory cycle")
                seen.update(entry.layers)
                children = [(path + b"/" + n if path else n, e) for n, e in self.entries(entry)]
                stack.extend(reversed(children))
