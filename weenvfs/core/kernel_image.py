"""A group's EROFS metadata image, derived from its index, and the node's copies of it.

The kernel path mounts, for group N of an environment, an EROFS image that holds everything
but file data: the `LayerTree` of groups 0..N (what overlayfs needs of that layer: whiteouts
as 0/0 character devices, opaque directories marked, implied directories with the merged
view's attributes) walked once and written by `weenvfs.format.erofs`. Its regular files are
chunk-based inodes on the group's data device (device_layout.py): chunk k of a file is block
`start + k * chunk_blocks`, and a zero chunk of the index is a hole the kernel never reads.

The image is a pure function of the index digests of groups 0..N and the writer's version,
so the node keeps one copy per stack in the cache folder (`erofs/<key>.img`) next to its
BLAKE3 digest (`<key>.img.b3`). Before an image reaches the kernel its digest is checked
(`cached_image`): a damaged or half-written copy is rebuilt, never mounted.

Must not: mount anything (fuse/), fetch file data, or encode EROFS bytes itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from weenvfs.format import erofs
from weenvfs.format.constants import CHUNK, CHUNK_ZERO
from weenvfs.format.digest import digest_hex
from weenvfs.format.errors import FormatError
from weenvfs.format.index import Inode

from .device_layout import BLOCK_SIZE, DeviceLayout
from .layer_tree import WHITEOUT_MODE
from .tree import ROOT_INODE, Tree, make_inode

log = logging.getLogger(__name__)

IMAGE_DIR = "erofs"
# Bumped whenever what this module or the writer emits changes: old copies are then rebuilt.
IMAGE_VERSION = 1


def stack_key(index_digests: Sequence[str]) -> str:
    """The name of the image of the top group of `index_digests` (lowest first)."""
    h = hashlib.sha256(b"weenv erofs image %d\n" % IMAGE_VERSION)
    for digest in index_digests:
        h.update(digest.encode() + b"\n")
    return h.hexdigest()


def _chunk_bits(chunk_size: int) -> int | None:
    """log2(chunk_size / BLOCK_SIZE) when the index's chunks can be EROFS chunks, else None."""
    if chunk_size < BLOCK_SIZE or chunk_size & (chunk_size - 1):
        return None
    return chunk_size.bit_length() - BLOCK_SIZE.bit_length()


def _whole_file_bits(size: int) -> int:
    """The smallest chunk size (as bits over BLOCK_SIZE) that holds `size` bytes at once."""
    blocks = max(-(-size // BLOCK_SIZE), 1)
    return (blocks - 1).bit_length()


class ImageBuilder:
    """Walks a `LayerTree` (or a one-group `Tree`) into the inode list `erofs.write_image`
    takes.

    Only the top group's own records are walked, each decoded once; the tree is asked only
    what depends on the groups below, once per directory: its composed entry (does anything
    lie below it, so that its whiteouts must show; an implied directory's attributes) and its
    xattrs (the opaque marker). What a layer shows is LayerTree's rule (core/layer_tree.py);
    tests/fuse/test_layer_mounts.py checks both paths against the OCI layer applier."""

    def __init__(self, tree: Tree, layout: DeviceLayout) -> None:
        self.tree = tree
        self.layout = layout
        self.top = len(tree.groups) - 1  # the group shown: a LayerTree's, or the only one
        self.index = tree.groups[self.top]
        self.bits = _chunk_bits(self.index.chunk_size)
        self._records: dict[int, Inode] = {}
        self._zero: bytes | None = None

    def _record(self, ino: int) -> Inode:
        rec = self._records.get(ino)
        if rec is None:
            rec = self._records[ino] = self.index.inode(ino)
        return rec

    def inodes(self) -> list[erofs.ErofsInode]:
        """Every inode reachable from the root, the root first."""
        out: list[erofs.ErofsInode | None] = [None]
        leaves: dict[int, int] = {}  # record -> position (hardlinks share one inode)
        pending = [(ROOT_INODE, 0)]  # (tree inode of a directory, its position in out)
        while pending:
            directory, position = pending.pop()
            entry = self.tree.entry(directory)
            below = len(entry.layers) > 1  # something lies under it: its whiteouts count
            entries, subdirs = [], 0
            for name, ino in self.index.entries(entry.layers[0][1]):
                rec = self._record(ino)
                if rec.is_dir:
                    child = self.tree.lookup(directory, name).inode
                    n = len(out)
                    out.append(None)
                    pending.append((child, n))
                    subdirs += 1
                elif rec.whiteout and not below:
                    continue
                else:
                    n = leaves.get(ino)
                    if n is None:
                        n = leaves[ino] = len(out)
                        out.append(self._leaf(ino, rec))
                entries.append((name, n))
            out[position] = self._directory(directory, tuple(entries), subdirs)
        assert all(inode is not None for inode in out)
        return out  # type: ignore[return-value]

    def _directory(self, inode: int, entries: tuple[tuple[bytes, int], ...],
                   subdirs: int) -> erofs.ErofsInode:
        attr = self.tree.attr(inode)
        # nlink: exact within this layer (the tree says 1 for a merged directory).
        return erofs.ErofsInode(
            mode=attr.mode, uid=attr.uid, gid=attr.gid, nlink=2 + subdirs,
            mtime_ns=attr.mtime_ns, xattrs=tuple(self.tree.xattrs(inode)), entries=entries)

    def _leaf(self, ino: int, rec: Inode) -> erofs.ErofsInode:
        if rec.whiteout:  # overlayfs' whiteout: a character device 0/0, as LayerTree shows
            return erofs.ErofsInode(mode=WHITEOUT_MODE, uid=0, gid=0, nlink=1,
                                    mtime_ns=rec.mtime_ns)
        xattrs = tuple(self.tree.xattrs(make_inode(self.top, ino))) if rec.xattr_count else ()
        common = {"mode": rec.mode, "uid": rec.uid, "gid": rec.gid, "nlink": rec.nlink,
                  "mtime_ns": rec.mtime_ns, "xattrs": xattrs}
        if rec.is_lnk:
            return erofs.ErofsInode(target=self.index.readlink(ino), **common)  # type: ignore[arg-type]
        if not rec.is_reg:
            return erofs.ErofsInode(rdev=rec.rdev, **common)  # type: ignore[arg-type]
        if rec.size == 0:
            return erofs.ErofsInode(**common)  # type: ignore[arg-type]
        if rec.data_first + rec.data_count > self.index.header.chunk_count:
            self.index.file_chunks(ino)  # raises the FormatError that names the problem
        bits, chunks = self._chunks(ino, rec)
        return erofs.ErofsInode(size=rec.size, chunk_bits=bits, chunks=chunks, **common)  # type: ignore[arg-type]

    def _chunks(self, ino: int, rec: Inode) -> tuple[int, tuple[int, ...]]:
        """(chunk bits, device block of each chunk or HOLE) of regular file record `ino`."""
        start = self.layout.start_block(ino)
        count, first, zero = rec.data_count, rec.data_first, self._zero_chunks()
        if count == 1:  # a small file, alone or batched: one chunk holds it all
            return _whole_file_bits(rec.size), (erofs.HOLE if zero[first] else start,)
        if count != -(-rec.size // self.index.chunk_size) or rec.inner_offset:
            self.index.file_chunks(ino)  # raises the FormatError that names the problem
        if self.bits is None:  # chunks EROFS cannot mirror: one extent, zeros served
            return _whole_file_bits(rec.size), (start,)
        step = 1 << self.bits
        return self.bits, tuple(erofs.HOLE if zero[first + k] else start + k * step
                                for k in range(count))

    def _zero_chunks(self) -> bytes:
        """One byte per chunk record of the index: 1 for a zero chunk (a hole), decoded in
        one pass. The fetcher validates every record it reads; a hole is never read."""
        if self._zero is None:
            h = self.index.header
            table = memoryview(self.index.raw)[h.chunk_offset:h.chunk_offset
                                               + h.chunk_count * CHUNK.size]
            self._zero = bytes(flags & CHUNK_ZERO for _, _, flags, _, _, _
                               in CHUNK.iter_unpack(table))
            if len(self._zero) != h.chunk_count:
                raise FormatError("chunk table", "shorter than chunk_count")
        return self._zero


def build_image(tree: Tree, layout: DeviceLayout) -> bytes:
    """The EROFS metadata image of `tree`'s top group, its data on `layout`'s device. `tree`
    is a `LayerTree`, or the `Tree` of a single group (the same view, minus the overlay
    markers a lone mount has no use for)."""
    builder = ImageBuilder(tree, layout)
    return erofs.write_image(builder.inodes(), layout.blocks, b"weenv-group-%d" % builder.top)


def cached_image(cache_dir: Path, key: str, build: Callable[[], bytes]) -> Path:
    """The verified copy of image `key` in `cache_dir`, built (by `build`) if it is missing
    or does not match its recorded digest. Safe against concurrent builders: each writes a
    temporary file and renames it; the digest file is written after the image."""
    folder = cache_dir / IMAGE_DIR
    path = folder / f"{key}.img"
    digest_path = folder / f"{key}.img.b3"
    with contextlib.suppress(OSError):
        want = digest_path.read_text().strip()
        data = path.read_bytes()
        if digest_hex(data) == want:
            return path
        log.warning("EROFS image %s does not match its digest: rebuilding it", path)
    data = build()
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, data)
    _write_atomically(digest_path, (digest_hex(data) + "\n").encode())
    return path


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
