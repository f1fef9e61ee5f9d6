"""The EROFS metadata image of each group a kernel-path mount stacks, and the node's copies.

The lowest group of a stack (and a group mounted alone) is shown by the image the format
defines for it (`weenvfs.format.erofs_group.group_image`, SPEC.md 15.9): the publisher stores
it as `erofs/<digest>` and names it in the manifest, so a node fetches and checks it (one
small request) instead of deriving it; it derives the same bytes itself when the store has
none (an older manifest). A group higher in a stack depends on what lies below it (which
whiteouts show, what an implied directory looks like, where overlayfs' opaque marker goes):
`LayerImage` derives it from the `LayerTree` of groups 0..N, answering `GroupImage`'s two
hooks once per directory.

The node keeps every image in the cache folder: a published one as `erofs/<digest>.img`
(its name is its BLAKE3), a derived one as `erofs/<stack key>.img` with its BLAKE3 in
`<stack key>.img.b3`. Before an image reaches the kernel its digest is checked
(`cached_image`): a damaged or half-written copy is fetched or built again, never mounted.
The data device's layout of each group is kept too, as `erofs/<index digest>.layout`
(`cached_layout`): derived from a verified index, saved with its own BLAKE3, and derived again
when the copy does not match it.

Must not: mount anything (fuse/), fetch file data, or encode EROFS bytes itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from weenvfs.format.chunk import decompress_object
from weenvfs.format.constants import MAX_IMAGE_SIZE
from weenvfs.format.device_layout import DeviceLayout
from weenvfs.format.digest import digest_bytes, digest_hex
from weenvfs.format.erofs_group import DEVICE_TAG, DirectoryView, GroupImage
from weenvfs.format.index import GroupIndex
from weenvfs.store.base import Store
from weenvfs.store.repository import Repository

from .layer_tree import LayerTree
from .node_files import hash_file, touch, write_atomically
from .tree import ROOT_INODE, Tree

log = logging.getLogger(__name__)

# Re-exported for the mount lifecycle (fuse/ reaches the format through core only).
__all__ = ["DeviceLayout", "LayerImage", "cached_image", "cached_layout", "derive_image",
           "fetch_group_image", "stack_image", "stack_key"]

IMAGE_DIR = "erofs"
# Bumped whenever what this module or the writer emits changes: old copies are then rebuilt.
IMAGE_VERSION = 1


def stack_key(index_digests: Sequence[str]) -> str:
    """The name of the image of the top group of `index_digests` (lowest first)."""
    h = hashlib.sha256(b"weenv erofs image %d\n" % IMAGE_VERSION)
    for digest in index_digests:
        h.update(digest.encode() + b"\n")
    return h.hexdigest()


class LayerImage(GroupImage):
    """The image of the top group of a `LayerTree`: the walk of `GroupImage`, its two hooks
    answered by the composed tree (once per directory): whether anything lies below a
    directory (so that its whiteouts show), and the attributes and xattrs it shows (an
    implied directory's come from below; an opaque one carries overlayfs' marker). A handle
    is the tree's inode number."""

    def __init__(self, tree: LayerTree, layout: DeviceLayout) -> None:
        super().__init__(tree.groups[tree.top], layout)
        self.tree = tree

    def root(self) -> object:
        return ROOT_INODE

    def own(self, handle: object) -> int:
        assert isinstance(handle, int)
        return self.tree.entry(handle).layers[0][1]

    def directory(self, handle: object) -> DirectoryView:
        assert isinstance(handle, int)
        entry, attr = self.tree.entry(handle), self.tree.attr(handle)
        return DirectoryView(len(entry.layers) > 1, attr.mode, attr.uid, attr.gid,
                             attr.mtime_ns, tuple(self.tree.xattrs(handle)))

    def child(self, handle: object, name: bytes, ino: int) -> object:
        assert isinstance(handle, int)
        return self.tree.lookup(handle, name).inode


def derive_image(tree: Tree, position: int, layout: DeviceLayout) -> bytes:
    """The EROFS image of group `position` of `tree`'s groups, its data on `layout`'s device:
    the lowest group's is `GroupImage`'s (the published bytes: nothing below it to ask about),
    a higher one's `LayerImage`'s over the groups up to it (`tree` itself when it already is
    that `LayerTree`)."""
    if position == 0:
        return GroupImage(tree.groups[0], layout).image(DEVICE_TAG)
    if not (isinstance(tree, LayerTree) and tree.top == position):
        tree = LayerTree(tree.groups[: position + 1])
    return LayerImage(tree, layout).image(DEVICE_TAG)


def stack_image(indexes: Sequence[GroupIndex], position: int) -> bytes:
    """The image of group `position` over the groups below it in `indexes` (lowest first),
    exactly as a node derives it: what a publisher stores for that group (SPEC.md 15.9)."""
    top = list(indexes[: position + 1])
    tree = LayerTree(top) if position else Tree(top)
    return derive_image(tree, position, DeviceLayout(top[-1]))


def fetch_group_image(store: Store, digest: str) -> bytes:
    """The published image `erofs/<digest>` (verified against its digest, decompressed)."""
    data = Repository(store).get_object("erofs", digest)
    return decompress_object(data, f"erofs/{digest[:12]}", MAX_IMAGE_SIZE)


def cached_image(cache_dir: Path, key: str, build: Callable[[], bytes]) -> Path:
    """The verified copy of image `key` in `cache_dir`, made by `build` if it is missing or
    does not match the BLAKE3 recorded next to it. Safe against concurrent builders: each
    writes a temporary file and renames it, the image before its digest."""
    folder = cache_dir / IMAGE_DIR
    path = folder / f"{key}.img"
    digest_path = folder / f"{key}.img.b3"
    with contextlib.suppress(OSError):
        want = digest_path.read_text().strip()
        if hash_file(path, digest_hex) == want:
            touch(path)
            touch(digest_path)
            return path
        log.warning("EROFS image %s does not match its digest: making it again", path)
    data = build()
    write_atomically(path, data)
    write_atomically(digest_path, (digest_hex(data) + "\n").encode())
    return path


def cached_layout(cache_dir: Path, index_digest: str, index: GroupIndex) -> DeviceLayout:
    """The data device's layout of group index `index_digest`: the node's copy when it is
    intact (its BLAKE3 follows it), else derived from `index` (and kept, best effort)."""
    path = cache_dir / IMAGE_DIR / f"{index_digest}.layout"
    with contextlib.suppress(OSError, ValueError):
        saved = path.read_bytes()
        body, digest = saved[:-32], saved[-32:]
        if digest_bytes(body) == digest:
            touch(path)
            return DeviceLayout.from_bytes(body)
        log.warning("the device layout %s does not match its digest: deriving it again", path)
    layout = DeviceLayout(index)
    body = layout.to_bytes()
    try:
        write_atomically(path, body + digest_bytes(body))
    except OSError as error:  # a full or read-only cache costs speed, never the mount
        log.info("cannot keep the device layout in %s: %s", path.parent, error)
    return layout
