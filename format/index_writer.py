"""Encoding a group index from an in-memory tree.

The writer takes a tree of `Node`s (hardlinks are the same `Node` reached by several names) and
produces the canonical bytes of SPEC.md: inodes numbered depth-first in name order, each
directory's entries sorted by name bytes, strings interned in first-use order, the blob table
sorted. Same tree, same bytes, whatever order it was built in. Pure; no I/O.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field

from . import constants as C
from .chunk import compress_object
from .digest import check_digest
from .errors import FormatError


@dataclass(frozen=True)
class ChunkRef:
    """A chunk as the writer sees it: its plaintext digest and where its frame lives.

    `blob` is the hex digest of the blob holding the frame, or None for an all-zero chunk.
    """

    digest: bytes
    blob: str | None
    offset: int
    clen: int
    ulen: int


@dataclass(eq=False)
class Node:
    """One inode of the tree being encoded (identity matters: hardlinks share a Node)."""

    mode: int
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    rdev: int = 0
    whiteout: bool = False
    opaque: bool = False
    target: bytes = b""
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    chunks: list[ChunkRef] = field(default_factory=list)
    inner_offset: int = 0
    file_digest: bytes | None = None
    children: dict[bytes, Node] = field(default_factory=dict)
    implied: bool = False  # a directory only implied by a source path (INODE_IMPLIED)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class _Strings:
    def __init__(self) -> None:
        self._offsets: dict[bytes, int] = {}
        self._parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> tuple[int, int]:
        off = self._offsets.get(data)
        if off is None:
            off = self._offsets[data] = self.size
            self._parts.append(data)
            self.size += len(data)
        return off, len(data)

    def encode(self) -> bytes:
        return b"".join(self._parts)


def _number_inodes(root: Node) -> list[Node]:
    """Inodes in canonical order: depth-first, children by name bytes, first reach wins."""
    if not root.is_dir:
        raise FormatError("index root", "must be a directory")
    order: list[Node] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        if node.is_dir:
            stack.extend(node.children[name] for name in sorted(node.children, reverse=True))
    return order


def _link_counts(order: list[Node]) -> dict[int, int]:
    counts = {id(n): 0 for n in order}
    counts[id(order[0])] = 1  # the root has a name already: it may not appear as an entry
    for node in order:
        if node.is_dir:
            for child in node.children.values():
                if child.is_dir and counts[id(child)]:
                    raise FormatError("index tree", "a directory is reachable by two names")
                counts[id(child)] += 1
    for node in order:
        if node.is_dir:
            counts[id(node)] = 2 + sum(c.is_dir for c in node.children.values())
    return counts


_U32, _U64, _I64_SECONDS = 1 << 32, 1 << 64, 1 << 63


def _check_fields(node: Node) -> None:
    # Refuse what the reader refuses (and what struct.pack would reject with a bare error).
    kind = stat.S_IFMT(node.mode)
    dir_only = node.opaque or node.implied
    if (node.whiteout and kind != stat.S_IFCHR) or (dir_only and kind != stat.S_IFDIR):
        raise FormatError("node flags", "whiteout needs a char device, opaque/implied a dir")
    for name, value, limit in (
        ("mode", node.mode, _U32),
        ("uid", node.uid, _U32),
        ("gid", node.gid, _U32),
        ("size", node.size, _U64),
        ("rdev", node.rdev, _U64),
        ("inner_offset", node.inner_offset, _U32),
    ):
        if not 0 <= value < limit:
            raise FormatError(f"node {name}", f"{value} out of range")
    if not -_I64_SECONDS <= node.mtime_ns // 1_000_000_000 < _I64_SECONDS:
        raise FormatError("node mtime_ns", f"{node.mtime_ns} out of range")
    if node.file_digest is not None and len(node.file_digest) != 32:
        raise FormatError("node file_digest", "must be 32 bytes")


def _check_chunks(node: Node, chunk_size: int) -> None:
    """The chunk layout rules of SPEC.md, as `GroupIndex.file_chunks`/`file_spans` apply them."""
    chunks = node.chunks
    if chunks and not stat.S_ISREG(node.mode):
        raise FormatError("node chunks", "only regular files have chunks")
    for c in chunks:
        if len(c.digest) != 32 or not 0 <= c.ulen <= C.MAX_CHUNK_SIZE:
            raise FormatError("chunk ref", f"bad digest or length {c.ulen}")
        if c.blob is None and (c.offset or c.clen):
            raise FormatError("chunk ref", "a zero chunk has no offset or compressed length")
        if c.blob is not None:
            check_digest(c.blob, "chunk ref blob")
        if not (0 <= c.offset < _U64 and 0 <= c.clen <= C.max_frame_size(c.ulen)):
            raise FormatError("chunk ref", f"offset {c.offset} or length {c.clen} out of range")
    if not chunks:
        bad = node.size != 0 and stat.S_ISREG(node.mode)
    elif len(chunks) == 1:
        bad = node.inner_offset + node.size > chunks[0].ulen
    else:
        lengths = [min(chunk_size, node.size - k * chunk_size) for k in range(len(chunks))]
        bad = node.inner_offset != 0 or len(chunks) != -(-node.size // chunk_size)
        bad = bad or [c.ulen for c in chunks] != lengths
    if bad:
        raise FormatError("node chunks", f"{len(chunks)} chunks do not fit size {node.size}")


def _check_node(node: Node, chunk_size: int) -> None:
    _check_fields(node)
    _check_chunks(node, chunk_size)
    kind = stat.S_IFMT(node.mode)
    if kind not in (
        stat.S_IFDIR,
        stat.S_IFREG,
        stat.S_IFLNK,
        stat.S_IFCHR,
        stat.S_IFBLK,
        stat.S_IFIFO,
        stat.S_IFSOCK,
    ):
        raise FormatError("node mode", f"unknown file type {node.mode:#o}")
    for name in node.children:
        if (
            not 0 < len(name) <= C.MAX_NAME
            or b"/" in name
            or b"\0" in name
            or name
            in (
                b".",
                b"..",
            )
        ):
            raise FormatError("entry name", f"invalid name {name!r:.80}")
    if len(node.target) > C.MAX_SYMLINK:
        raise FormatError("symlink target", f"{len(node.target)} bytes exceeds {C.MAX_SYMLINK}")
    for key, value in node.xattrs.items():
        if not 0 < len(key) <= C.MAX_XATTR_KEY or len(value) > C.MAX_XATTR_VALUE:
            raise FormatError("xattr", f"key or value too long: {key!r:.80}")
    total = sum(len(key) + len(value) for key, value in node.xattrs.items())
    if total > C.MAX_INODE_XATTRS:
        raise FormatError("xattrs", f"{total} bytes on one entry exceed {C.MAX_INODE_XATTRS}")


def encode_index(root: Node, chunk_size: int = C.DEFAULT_CHUNK_SIZE) -> bytes:
    """The uncompressed canonical index bytes of the tree under `root`."""
    if not C.MIN_CHUNK_SIZE <= chunk_size <= C.MAX_CHUNK_SIZE:
        raise FormatError("chunk_size", f"{chunk_size} outside the allowed range")
    order = _number_inodes(root)
    if len(order) >= C.MAX_U32:
        raise FormatError("index", f"{len(order)} inodes exceed the limit")
    number = {id(n): i for i, n in enumerate(order)}
    nlinks = _link_counts(order)
    strings = _Strings()
    blobs = sorted({c.blob for n in order for c in n.chunks if c.blob is not None})
    blob_number = {b: i for i, b in enumerate(blobs)}
    inodes, dirents, chunks, xattrs, file_digests = [], [], [], [], []
    chunk_runs: dict[tuple[ChunkRef, ...], int] = {}
    incompat = 0
    for ino, node in enumerate(order):
        _check_node(node, chunk_size)
        data_first = data_count = 0
        if node.is_dir:
            data_first, data_count = len(dirents), len(node.children)
            for name in sorted(node.children):
                off, length = strings.add(name)
                dirents.append(C.DIRENT.pack(off, length, number[id(node.children[name])]))
        elif stat.S_ISLNK(node.mode):
            data_first, data_count = strings.add(node.target)
        elif stat.S_ISREG(node.mode) and node.chunks:
            run = tuple(node.chunks)
            data_first = chunk_runs.get(run, -1)
            if data_first < 0:
                data_first = chunk_runs[run] = len(chunks)
                for c in run:
                    zero = c.blob is None
                    incompat |= C.INCOMPAT_ZERO_CHUNKS if zero else 0
                    blob = C.NO_BLOB if zero else blob_number[c.blob]
                    flags = C.CHUNK_ZERO if zero else 0
                    chunks.append(C.CHUNK.pack(c.digest, blob, flags, c.offset, c.clen, c.ulen))
            data_count = len(run)
        if node.file_digest is not None:
            file_digests.append(C.FILE_DIGEST.pack(ino, node.file_digest))
        xattr_first = len(xattrs)
        for key in sorted(node.xattrs):
            xattrs.append(C.XATTR.pack(*strings.add(key), *strings.add(node.xattrs[key])))
        flags = (
            (C.INODE_WHITEOUT if node.whiteout else 0)
            | (C.INODE_OPAQUE if node.opaque else 0)
            | (C.INODE_IMPLIED if node.implied else 0)
        )
        sec, nsec = divmod(node.mtime_ns, 1_000_000_000)
        inodes.append(
            C.INODE.pack(
                node.mode,
                node.uid,
                node.gid,
                nlinks[id(node)],
                node.size,
                sec,
                nsec,
                flags,
                node.rdev,
                data_first,
                data_count,
                node.inner_offset,
                xattr_first,
                len(xattrs) - xattr_first,
            )
        )
    compat = C.COMPAT_FILE_DIGESTS if file_digests else 0
    tables = [
        b"".join(inodes),
        b"".join(dirents),
        b"".join(chunks),
        b"".join(xattrs),
        b"".join(bytes.fromhex(b) for b in blobs),
        b"".join(file_digests),
        strings.encode(),
    ]
    return _assemble(
        tables,
        chunk_size,
        compat,
        incompat,
        counts=(len(inodes), len(dirents), len(chunks), len(xattrs), len(blobs), len(file_digests)),
    )


def _assemble(
    tables: list[bytes], chunk_size: int, compat: int, incompat: int, counts: tuple[int, ...]
) -> bytes:
    offsets, pos, parts = [], C.INDEX_HEADER.size, []
    for table in tables:
        offsets.append(pos)
        pad = -len(table) % C.TABLE_ALIGN
        parts.append(table + b"\0" * pad)
        pos += len(table) + pad
    if pos > C.MAX_INDEX_SIZE:
        raise FormatError("index", f"{pos} bytes exceed the limit {C.MAX_INDEX_SIZE}")
    header = C.INDEX_HEADER.pack(
        C.INDEX_MAGIC,
        C.INDEX_VERSION,
        C.INDEX_HEADER.size,
        compat,
        incompat,
        chunk_size,
        *counts,
        len(tables[-1]),
        *offsets,
    )
    return header + b"".join(parts)


def encode_index_object(root: Node, chunk_size: int = C.DEFAULT_CHUNK_SIZE) -> bytes:
    """The stored (zstd-compressed) index object of the tree under `root`."""
    return compress_object(encode_index(root, chunk_size))
