"""One group of an environment as a kernel overlayfs lower layer (`weenv mount --layer N`).

The merged view (core/tree.py) composes every group in this process. A sandbox can instead
stack one mount per group with kernel overlayfs, as Docker's overlay2 stacks layers: every
environment that shares a group then shares that group's mount, so its kernel inodes, dentry
cache and page cache too (32 environments on one Python runtime group read numpy once).
The mount of group N is keyed by the groups 0..N it sits on (runtime/layers.py), so that the
attributes it shows can depend on the groups below it.

What this view shows, so that overlayfs with the groups' layer mounts as `lowerdir` (topmost
first) gives exactly the merged view's tree:
- only group N's own entries; lookups and listings never look at other groups;
- a whiteout as overlayfs' whiteout, a character device 0/0, but only in a directory that has
  something below it in groups 0..N-1 (overlayfs lists a directory found in one layer
  straight from that layer, whiteouts included, and there they hide nothing anyway);
- an opaque directory with the xattr `trusted.overlay.opaque=y`;
- an implied directory with the attributes the merged view gives it (its topmost declared
  layer at or below N; see format/SPEC.md 7.1), so that overlayfs, which shows the topmost
  layer's directory, shows the same;
- no `trusted.overlay.*` xattr of the group's own (an image must not steer overlayfs).

Inode numbers are the merged view's (`make_inode(group, record)`), so a file's number is the
same in both views; a directory shows its composed entry's number.

Must not: import pyfuse3 or know about mounts (fuse/), or compose groups above N.
"""

from __future__ import annotations

import errno
import stat
from collections.abc import Iterator, Sequence

from weenvfs.format.compose import Entry
from weenvfs.format.index import GroupIndex, Inode

from .tree import Attr, Tree, split_inode

OVERLAY_XATTR_PREFIX = b"trusted.overlay."
OPAQUE_XATTR = (b"trusted.overlay.opaque", b"y")
WHITEOUT_MODE = stat.S_IFCHR  # with rdev 0: what overlayfs takes for a whiteout


class LayerTree(Tree):
    """The topmost of `groups` (lowest first) as an overlayfs lower layer."""

    def __init__(self, groups: Sequence[GroupIndex]) -> None:
        super().__init__(groups)
        self.top = len(self.groups) - 1

    def _own(self, directory: Entry) -> int:
        """The record of `directory` in the top group (every directory here has one)."""
        group, ino = directory.layers[0]
        assert group == self.top
        return ino

    def entry(self, inode: int) -> Entry:
        if inode not in self._dirs and split_inode(inode)[0] != self.top:
            raise FileNotFoundError(errno.ENOENT, f"no inode {inode}")
        return super().entry(inode)

    def lookup(self, parent: int, name: bytes) -> Attr:
        if name in (b".", b".."):
            return super().lookup(parent, name)
        directory = self._directory(parent)
        found = self._child(directory, name)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"no entry {name!r:.80} in inode {parent}")
        return self.attr(self._number(found, parent))

    def _child(self, directory: Entry, name: bytes) -> Entry | None:
        """Entry `name` of the top group's `directory` as this view shows it, or None."""
        index = self.groups[self.top]
        ino = index.lookup(self._own(directory), name)
        if ino is None:
            return None
        return self._shown(directory, name, ino, index.inode(ino))

    def _shown(self, directory: Entry, name: bytes, ino: int, rec: Inode) -> Entry | None:
        if rec.whiteout:
            return Entry(self.top, ino, ()) if len(directory.layers) > 1 else None
        if not rec.is_dir:
            return Entry(self.top, ino, ())
        # The composed entry: its layers start with ours, its attributes may be a lower one's.
        return self.composed.lookup(directory, name)

    def _entries(self, directory: Entry) -> Iterator[tuple[bytes, Entry]]:
        index = self.groups[self.top]
        for name, ino in index.entries(self._own(directory)):
            shown = self._shown(directory, name, ino, index.inode(ino))
            if shown is not None:
                yield name, shown

    def _attr(self, inode: int) -> Attr:
        attr = super()._attr(inode)
        if inode in self._dirs:
            return attr
        group, ino = split_inode(inode)
        if self.groups[group].inode(ino).whiteout:
            return Attr(inode, WHITEOUT_MODE, 1, 0, 0, 0, 0, 0, attr.mtime_ns)
        return attr

    def xattrs(self, inode: int) -> list[tuple[bytes, bytes]]:
        own = [(k, v) for k, v in super().xattrs(inode) if not k.startswith(OVERLAY_XATTR_PREFIX)]
        entry = self.entry(inode)
        if entry.is_dir and self.groups[self.top].inode(self._own(entry)).opaque:
            own = sorted([*own, OPAQUE_XATTR])
        return own

    def _shown_groups(self) -> Sequence[GroupIndex]:
        return [self.groups[self.top]]
