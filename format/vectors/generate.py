"""Golden vectors of the WeEnv format (SPEC.md section 13): small trees, their bytes and digests.

Owns: the vector trees (declared below), a tiny deterministic builder (chunking, batching, holes,
blob packing) and the files of this folder: for each vector `<group>.index.bin` (raw index),
`<group>.index.zst` (stored index object), `<group>.blob` (packed chunk frames, when the group
has data), `<vector>.manifest.json`, `<vector>.hint.zst`, and `vectors.json` with every digest
and the expected entries, reads and (for `env`) composed tree. The derived EROFS image
(SPEC.md section 15) of the declared tree `EROFS_TREE` is `erofs-tree.img`; its data device is
rebuilt by `build_erofs` (its digest is in vectors.json) rather than stored. The canonical JSON
vectors (SPEC.md 8.2) in `canonical-json/` come from `canonical_json_vectors.py` beside this
file, and are written and checked with the rest.

Deterministic: no clock, no randomness, and no dependency on the zstd version: every frame here
is a zstd frame of *raw* (stored) blocks, which every zstd decoder reads and no compressor
upgrade changes. Real writers compress; the format allows both (SPEC.md 5.1).

Must not: import anything but the stdlib and `weenvfs.format` (tests import it by path).
Changing the vectors' bytes is a format change: bump the version and the changelog.

    python format/vectors/generate.py            # (re)write the vectors next to this file
    python format/vectors/generate.py --check    # compare, write nothing; exit 1 on a difference
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from weenvfs.format import constants as C
from weenvfs.format.chunk import decode_chunk, decompress_object
from weenvfs.format.digest import digest_bytes, digest_hex
from weenvfs.format.erofs import BLOCK_SIZE, HOLE, ErofsInode, write_image
from weenvfs.format.hints import Hint, HintPack, HintRecord, encode_hint
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import ChunkRef, Node, encode_index
from weenvfs.format.manifest import GroupRef, Manifest, RuntimeConfig, encode_manifest

HERE = Path(__file__).resolve().parent
VECTOR_CHUNK_SIZE = 4096  # the smallest allowed, so tiny files make multi-chunk files
T0 = 1_700_000_000_123_456_789  # a fixed mtime with a nanosecond part
_TYPES = {
    "dir": stat.S_IFDIR,
    "reg": stat.S_IFREG,
    "lnk": stat.S_IFLNK,
    "chr": stat.S_IFCHR,
    "blk": stat.S_IFBLK,
    "fifo": stat.S_IFIFO,
    "sock": stat.S_IFSOCK,
    "whiteout": stat.S_IFCHR,
}


@dataclass(frozen=True)
class E:
    """One declared entry. `kind` is a key of _TYPES or 'hard' (a hardlink to `target`)."""

    path: bytes
    kind: str
    perm: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime_ns: int = T0
    data: bytes = b""
    target: bytes = b""
    rdev: int = 0
    xattrs: tuple[tuple[bytes, bytes], ...] = ()
    opaque: bool = False
    implied: bool = False


@dataclass(frozen=True)
class Group:
    """A built group: its tree, its blob, its raw index and its stored index object."""

    root: Node
    blob: bytes
    raw: bytes
    stored: bytes


def pattern(seed: bytes, size: int) -> bytes:
    """`size` incompressible, reproducible bytes (SHA-256 in counter mode)."""
    out = b"".join(
        hashlib.sha256(seed + struct.pack("<I", i)).digest() for i in range(size // 32 + 1)
    )
    return out[:size]


def stored_frame(plain: bytes) -> bytes:
    """One zstd frame of raw blocks with a 4-byte content size (RFC 8878 3.1.1)."""
    out = bytearray(struct.pack("<IBI", 0xFD2FB528, 0xA0, len(plain)))  # FCS 4 bytes, 1 segment
    block = 128 << 10
    for pos in range(0, max(len(plain), 1), block):
        piece = plain[pos : pos + block]
        last = pos + block >= len(plain)
        out += (int(last) | (len(piece) << 3)).to_bytes(3, "little")  # Block_Type 0 = Raw
        out += piece
    return bytes(out)


def mode_of(e: E) -> int:
    """Type bits and permissions; a whiteout is a char device with mode 0 (SPEC.md 7.1)."""
    return _TYPES[e.kind] | (0 if e.kind == "whiteout" else e.perm)


def _components(path: bytes) -> tuple[bytes, ...]:
    return tuple(p for p in path.split(b"/") if p)


def canonical_order(entries: list[E]) -> list[E]:
    """Entries in inode order: depth-first with names sorted by bytes = sorted by components."""
    return sorted(entries, key=lambda e: _components(e.path))


def build_tree(entries: list[E]) -> tuple[Node, dict[bytes, Node]]:
    """The Node tree of `entries` (parents declared before children), and path -> Node."""
    root = Node(stat.S_IFDIR | 0o755)
    nodes = {b"": root}
    for e in entries:
        if e.kind == "hard":
            node = nodes[e.target]
        else:
            node = Node(0) if e.path else root
            node.mode = mode_of(e)
            node.uid, node.gid, node.mtime_ns, node.rdev = e.uid, e.gid, e.mtime_ns, e.rdev
            node.whiteout, node.opaque, node.implied = e.kind == "whiteout", e.opaque, e.implied
            node.target, node.xattrs = e.target, dict(e.xattrs)
            node.size = len(e.target) if e.kind == "lnk" else len(e.data)
        if e.path:
            parent, _, name = e.path.rpartition(b"/")
            nodes[parent].children[name] = node
        nodes[e.path] = node
    return root, nodes


class _Packer:
    """Packs chunk frames into one blob (deduplicated by digest) and batches small files."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.threshold = chunk_size // 4  # files below it are batched
        self.blob = bytearray()
        self.frames: dict[bytes, tuple[int, int]] = {}
        self.batch = bytearray()
        self.pending: list[Node] = []
        self.placed: dict[bytes, int] = {}  # file digest -> inner offset in the open batch
        self.runs: dict[int, list[tuple[bytes, bool, int]]] = {}  # id(node) -> (digest, zero, ulen)

    def _put(self, plain: bytes) -> bytes:
        d = digest_bytes(plain)
        if d not in self.frames:
            frame = stored_frame(plain)
            self.frames[d] = (len(self.blob), len(frame))
            self.blob += frame
        return d

    def add(self, node: Node, data: bytes) -> None:
        if not data:
            return
        if len(data) < self.threshold:
            self._add_small(node, data)
            return
        run = []
        for pos in range(0, len(data), self.chunk_size):
            piece = data[pos : pos + self.chunk_size]
            if piece.count(0) == len(piece):  # a hole: stored nowhere
                run.append((digest_bytes(piece), True, len(piece)))
            else:
                run.append((self._put(piece), False, len(piece)))
        self.runs[id(node)] = run

    def _add_small(self, node: Node, data: bytes) -> None:
        node.file_digest = digest_bytes(data)
        inner = self.placed.get(node.file_digest)  # same content: same bytes of the batch
        if inner is None:
            if len(self.batch) + len(data) > self.chunk_size:
                self.flush()
            inner = self.placed[node.file_digest] = len(self.batch)
            self.batch += data
        node.inner_offset = inner
        self.pending.append(node)

    def flush(self) -> None:
        if not self.batch:
            return
        d = self._put(bytes(self.batch))
        for node in self.pending:
            self.runs[id(node)] = [(d, False, len(self.batch))]
        self.batch, self.pending, self.placed = bytearray(), [], {}

    def finish(self, nodes: list[Node]) -> bytes:
        """Close the blob and give every node its ChunkRefs (the blob digest is known now)."""
        self.flush()
        blob = bytes(self.blob)
        name = digest_hex(blob) if blob else None
        for node in nodes:
            node.chunks = [
                ChunkRef(d, None, 0, 0, ulen) if zero else ChunkRef(d, name, *self.frames[d], ulen)
                for d, zero, ulen in self.runs.get(id(node), [])
            ]
        return blob


def build_group(entries: list[E], chunk_size: int = VECTOR_CHUNK_SIZE) -> Group:
    """Build one group: tree, blob, raw index and stored index object."""
    root, nodes = build_tree(entries)
    packer = _Packer(chunk_size)
    for e in canonical_order(entries):
        if e.kind == "reg":  # hardlinks ('hard') share the Node of their 'reg' entry
            packer.add(nodes[e.path], e.data)
    blob = packer.finish(list(nodes.values()))
    raw = encode_index(root, chunk_size)
    return Group(root, blob, raw, stored_frame(raw))


def stored_hint(hint: Hint) -> bytes:
    """The codec's hint encoding, re-framed with raw blocks (see the module docstring)."""
    return stored_frame(decompress_object(encode_hint(hint), "hint", 1 << 30))


# -- the vectors -------------------------------------------------------------------------------


def _d(path: str | bytes, **kw: Any) -> E:
    return E(os.fsencode(path), "dir", kw.pop("perm", 0o755), **kw)


def _f(path: str | bytes, data: bytes, **kw: Any) -> E:
    return E(os.fsencode(path), "reg", data=data, **kw)


def _w(path: str | bytes) -> E:
    return E(os.fsencode(path), "whiteout", mtime_ns=0)


LONG_NAME = b"n" * C.MAX_NAME
LATIN1_NAME = b"caf\xe9"  # not UTF-8
CS = VECTOR_CHUNK_SIZE
# Four chunks: data, a hole (stored nowhere), data, and a short last chunk.
BIG = pattern(b"big", CS) + bytes(CS) + pattern(b"mid", CS) + pattern(b"end", 1000)
CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)  # v2: cap_net_bind_service

MINIMAL = [_d("", mtime_ns=0)]

FILES = [
    _d("", mtime_ns=T0),
    _f("big.bin", BIG),
    _f("big-copy.bin", BIG),  # another inode with the same chunks: it shares the records
    _d("bin"),
    _f(
        "bin/tool",
        pattern(b"tool", 2000),
        perm=0o4755,
        xattrs=((b"security.capability", CAPABILITY),),
    ),
    _d("dev"),
    E(b"dev/null", "chr", 0o666, rdev=os.makedev(1, 3)),
    E(b"dev/sda", "blk", 0o660, gid=6, rdev=os.makedev(8, 0)),
    E(b"dev/big", "chr", 0o600, rdev=os.makedev(4100, 70000)),  # needs the 64-bit encoding
    E(b"dev/fifo", "fifo", 0o644),
    E(b"dev/socket", "sock", 0o755),
    _f("empty", b""),
    _d("etc", xattrs=((b"user.comment", b"hello"), (b"trusted.empty", b""))),
    _f("etc/hostname", b"vectors\n"),
    _f("etc/hostname.bak", b"vectors\n"),  # same content: same batch bytes, shared record
    _f("etc/hosts", b"127.0.0.1 localhost\n", mtime_ns=T0 + 1),
    _f("etc/motd", b"welcome\n"),
    E(b"etc/issue", "hard", target=b"etc/motd"),  # sorts first: the inode is numbered here
    _d("home", perm=0o700, uid=1000, gid=1000),
    _d("home/user", uid=1000, gid=1000),
    _f(b"home/user/" + LATIN1_NAME, b"latin-1 name\n", uid=1000, gid=1000),
    _f(b"home/user/" + LONG_NAME, b"a name of 255 bytes\n", uid=1000, gid=1000),
    E(b"link", "lnk", 0o777, target=b"etc/hosts"),
    E(b"link-dangling", "lnk", 0o777, target=b"../nowhere"),
    _f("old", b"from before 1970\n", mtime_ns=-1_500_000_000),
]

ENV_BASE = [
    _d(""),
    _d("etc"),
    _f("etc/hostname", b"base\n"),
    _f("etc/keep.conf", b"keep\n"),
    _f("etc/old.conf", b"old\n"),
    _d("opt"),
    _d("opt/app"),
    _f("opt/app/run", b"#!/bin/sh\n", perm=0o755),
    _d("usr"),
    _d("usr/bin"),
    _f("usr/bin/tool", pattern(b"tool v1", 5000), perm=0o755),
    _d("var"),
    _d("var/cache"),
    _f("var/cache/a", b"a\n"),
    _d("var/cache/sub"),
    _f("var/cache/sub/b", b"b\n"),
    _d("x"),
    _f("x/inner", b"inner\n"),
    _f("y", b"y is a file\n"),
]
ENV_MID = [
    _d("", mtime_ns=T0 + 10),
    _d("etc", perm=0o750, mtime_ns=T0 + 10),
    _w("etc/old.conf"),
    _d("usr"),
    _d("usr/bin"),
    _f("usr/bin/tool", pattern(b"tool v2", 6000), perm=0o755),
    _d("var"),
    _d("var/cache", opaque=True),
    _f("var/cache/c", b"c\n"),
    _f("x", b"x is a file now\n"),
    _d("y"),
    _f("y/inside", b"inside\n"),
]
ENV_TOP = [
    _d("", mtime_ns=0, implied=True),  # as a layer tar that never lists "./" gives it
    _d("etc", mtime_ns=T0 + 20),
    _f("etc/new.conf", b"new\n"),
    _f("etc/old.conf", b"old is back\n"),
    _w("opt"),
    _d("var", mtime_ns=0, implied=True),
    _d("var/cache"),
    _f("var/cache/a", b"a again\n"),
]
# The composed tree of env (SPEC.md 7.3): (path, group whose attributes it shows, type).
ENV_COMPOSED = [
    ("", 1, "dir"),
    ("etc", 2, "dir"),
    ("etc/hostname", 0, "reg"),
    ("etc/keep.conf", 0, "reg"),
    ("etc/new.conf", 2, "reg"),
    ("etc/old.conf", 2, "reg"),
    ("usr", 1, "dir"),
    ("usr/bin", 1, "dir"),
    ("usr/bin/tool", 1, "reg"),
    ("var", 1, "dir"),
    ("var/cache", 2, "dir"),
    ("var/cache/a", 2, "reg"),
    ("var/cache/c", 1, "reg"),
    ("x", 1, "reg"),
    ("y", 1, "dir"),
    ("y/inside", 1, "reg"),
]


@dataclass(frozen=True)
class Vector:
    """Groups lowest first as (name, entries); reads as (group, path, offset, length)."""

    chunk_size: int
    groups: list[tuple[str, list[E]]]
    reads: list[tuple[int, bytes, int, int]]
    config: RuntimeConfig
    composed: list[tuple[str, int, str]] | None = None


VECTORS = {
    "minimal": Vector(C.DEFAULT_CHUNK_SIZE, [("minimal", MINIMAL)], [], RuntimeConfig()),
    "files": Vector(
        VECTOR_CHUNK_SIZE,
        [("files", FILES)],
        [
            (0, b"big.bin", 4000, 200),  # across the first chunk boundary
            (0, b"big.bin", 8180, 40),  # the hole, then data
            (0, b"big.bin", 13000, 1000),  # the last, short chunk, clipped at end of file
            (0, b"etc/hosts", 10, 100),  # inside the batch chunk at an inner offset
            (0, b"etc/issue", 0, 8),  # through the hardlink
            (0, b"home/user/" + LATIN1_NAME, 0, 64),
        ],
        RuntimeConfig(
            env=("PATH=/usr/bin:/bin", "HOME=/home/user"),
            cwd="/home/user",
            user="1000:1000",
            cmd=("/bin/tool", "--flag"),
            labels={"org.opencontainers.image.title": "vectors/files", "note": "ünïcødé ✓"},
        ),
    ),
    "env": Vector(
        VECTOR_CHUNK_SIZE,
        [("env-base", ENV_BASE), ("env-mid", ENV_MID), ("env-top", ENV_TOP)],
        [(0, b"usr/bin/tool", 4090, 20), (1, b"usr/bin/tool", 0, 16)],
        RuntimeConfig(
            env=("PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"),
            entrypoint=("/usr/bin/tool",),
            cmd=("--help",),
        ),
        ENV_COMPOSED,
    ),
}


# -- the EROFS vector (SPEC.md section 15) ------------------------------------------------------

EROFS_CHUNK_BITS = 0  # 4096-byte chunks: small files make multi-chunk files
EROFS_DEVICE_TAG = b"weenv-vectors/erofs-tree"


def posix_acl(*entries: tuple[int, int, int]) -> bytes:
    """A system.posix_acl_* value: version 2, then (tag, perm, id) entries as Linux stores it."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


_NO_ID = 0xFFFFFFFF  # ACL_UNDEFINED_ID, what the kernel reports for the *_OBJ, MASK, OTHER tags
ACL = posix_acl((1, 6, _NO_ID), (2, 4, 1000), (4, 4, _NO_ID), (0x10, 4, _NO_ID), (0x20, 0, _NO_ID))
HOLEY = pattern(b"holey", BLOCK_SIZE) + bytes(BLOCK_SIZE) + pattern(b"holey end", 100)
MANY = 70  # hardlinks in many/: with 80-byte names their dirents take two blocks

EROFS_TREE = [
    _d("", mtime_ns=T0),
    E(b"!bang", "reg", data=b"sorts before the dot entries\n"),
    _f("big.bin", BIG),  # four chunks: data, a hole, data, a short last one
    E(b"dev", "dir", 0o755),
    E(b"dev/null", "chr", 0o666, rdev=os.makedev(1, 3)),
    E(b"dev/sda", "blk", 0o660, gid=6, rdev=os.makedev(8, 0)),
    E(b"dev/wide", "chr", 0o600, rdev=os.makedev(4095, 0xFFFFF)),  # the widest dev_t EROFS holds
    E(b"dev/fifo", "fifo", 0o644),
    E(b"dev/socket", "sock", 0o755),
    _d("empty"),
    _f("empty-file", b""),
    _d(
        "etc",
        xattrs=(
            (b"user.comment", b"hello"),
            (b"trusted.empty", b""),
            (b"system.posix_acl_default", ACL),
        ),
    ),
    _f("etc/acl", b"acl\n", xattrs=((b"system.posix_acl_access", ACL),)),
    _f("etc/big-xattr", b"x\n", xattrs=((b"user.big", pattern(b"xattr", 5000)),)),
    _f("etc/cap", b"cap\n", perm=0o755, xattrs=((b"security.capability", CAPABILITY),)),
    _f("holey", HOLEY),
    _f(b"home/" + LATIN1_NAME, b"latin-1 name\n", uid=1000, gid=1000),
    _d("home", uid=1000, gid=1000),
    _f(b"home/" + LONG_NAME, b"a name of 255 bytes\n"),
    _f(b"home/\xff\xfe new\nline", b"hostile\n", uid=4294967294, gid=4294967294),
    E(b"link-long", "lnk", 0o777, target=b"t/" * 2047 + b"x"),  # 4095 bytes: a block of its own
    E(b"link-mid", "lnk", 0o777, target=b"m" * 3000),  # packed after its inode
    E(b"link-short", "lnk", 0o777, target=b"big.bin"),
    _d("many"),
    _f("many/target", b"one inode, many names\n"),
    *[E(b"many/" + b"%02d-" % k + b"n" * 77, "hard", target=b"many/target") for k in range(MANY)],
    E(b"hardlink", "hard", target=b"many/target"),
    _f("old", b"from before 1970\n", mtime_ns=-1_500_000_001),
    _d("opaque", opaque=True),
    _f("opaque/inside", b"inside\n"),
    _w("whiteout"),
]


def build_erofs(
    entries: list[E], chunk_bits: int = EROFS_CHUNK_BITS
) -> tuple[list[ErofsInode], bytes, dict[bytes, int]]:
    """The writer's input for a declared tree: inodes in canonical order (the root first), the
    data device (each distinct non-zero chunk once, block aligned; zero chunks are holes) and
    each path's inode index. An opaque directory gets `trusted.overlay.opaque` = "y"."""
    ordered = canonical_order(entries)
    by_path = {e.path: e for e in entries}
    key = {e.path: (e.target if e.kind == "hard" else e.path) for e in entries}
    index: dict[bytes, int] = {}
    for e in ordered:
        index.setdefault(key[e.path], len(index))
    index.update({path: index[key[path]] for path in key})
    children: dict[bytes, list[tuple[bytes, int]]] = {}
    for e in ordered:
        if e.path:
            parent, _, name = e.path.rpartition(b"/")
            children.setdefault(parent, []).append((name, index[e.path]))
    links = {path: sum(1 for k in key.values() if k == path) for path in set(key.values())}
    chunk = BLOCK_SIZE << chunk_bits
    device = bytearray()
    placed: dict[bytes, int] = {}
    inodes: list[ErofsInode | None] = [None] * len(set(key.values()))
    for path, number in index.items():
        e = by_path[key[path]]
        if inodes[number] is not None:
            continue
        xattrs = tuple(sorted(e.xattrs))
        if e.opaque:
            xattrs = tuple(sorted((*xattrs, (b"trusted.overlay.opaque", b"y"))))
        entries_of = tuple(children.get(e.path, ()))
        nlink = 2 + sum(by_path[c].kind == "dir" for c in _child_paths(e.path, children))
        chunks = []
        for pos in range(0, len(e.data), chunk):
            piece = e.data[pos : pos + chunk]
            if piece.count(0) == len(piece):
                chunks.append(HOLE)
                continue
            if piece not in placed:
                placed[piece] = len(device) // BLOCK_SIZE
                device += piece + bytes(-len(piece) % BLOCK_SIZE)
            chunks.append(placed[piece])
        inodes[number] = ErofsInode(
            mode=mode_of(e),
            uid=e.uid,
            gid=e.gid,
            nlink=nlink if e.kind == "dir" else links[e.path],
            mtime_ns=e.mtime_ns,
            rdev=e.rdev,
            xattrs=xattrs,
            entries=entries_of,
            target=e.target if e.kind == "lnk" else b"",
            size=len(e.data),
            chunk_bits=chunk_bits if e.data else 0,
            chunks=tuple(chunks),
        )
    return [n for n in inodes if n is not None], bytes(device), index


def _child_paths(path: bytes, children: dict[bytes, list[tuple[bytes, int]]]) -> list[bytes]:
    prefix = path + b"/" if path else b""
    return [prefix + name for name, _ in children.get(path, ())]


def erofs_image(entries: list[E], chunk_bits: int = EROFS_CHUNK_BITS) -> tuple[bytes, bytes]:
    """(image, data device) of a declared tree."""
    inodes, device, _ = build_erofs(entries, chunk_bits)
    return write_image(inodes, len(device) // BLOCK_SIZE, EROFS_DEVICE_TAG), device


# -- expectations, computed from the declarations (not by decoding) ----------------------------


def expected_entries(entries: list[E]) -> list[dict[str, Any]]:
    """Per path: inode number, metadata and content digest, as SPEC.md says they must decode."""
    by_path = {e.path: e for e in entries}
    key = {e.path: (e.target if e.kind == "hard" else e.path) for e in entries}
    numbers: dict[bytes, int] = {}
    for e in canonical_order(entries):
        numbers.setdefault(key[e.path], len(numbers))
    out = []
    for e in canonical_order(entries):
        d = by_path[key[e.path]]
        if d.kind == "dir":
            subdirs = [
                c for c in entries if c.kind == "dir" and c.path and _parent(c.path) == d.path
            ]
            nlink = 2 + len(subdirs)
        else:
            nlink = sum(1 for k in key.values() if k == d.path)
        kind = "chr" if d.kind == "whiteout" else d.kind
        out.append(
            {
                "path": _show(e.path),
                "path_hex": e.path.hex(),
                "inode": numbers[d.path],
                "type": kind,
                "mode": mode_of(d),
                "uid": d.uid,
                "gid": d.gid,
                "nlink": nlink,
                "size": len(d.target) if d.kind == "lnk" else len(d.data),
                "mtime_ns": d.mtime_ns,
                "rdev": d.rdev,
                "whiteout": d.kind == "whiteout",
                "opaque": d.opaque,
                "implied": d.implied,
                "target_hex": d.target.hex() if d.kind == "lnk" else None,
                "xattrs_hex": {k.hex(): v.hex() for k, v in sorted(d.xattrs)},
                "content_blake3": digest_hex(d.data) if d.kind == "reg" else None,
            }
        )
    return out


def _parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0]


def _show(path: bytes) -> str:
    return path.decode("utf-8", "backslashreplace")


def _file(name: str, data: bytes) -> dict[str, Any]:
    return {"file": name, "digest": digest_hex(data), "size": len(data)}


def packed_hint(manifest: bytes, records: list[HintRecord],
                groups: list[Group]) -> tuple[bytes, bytes, list[int]]:
    """A version 3 hint of `records` (SPEC.md 9.1): the pack (each distinct stored chunk
    once, in record order, as a raw-block frame), the stored hint, the frame lengths."""
    pack, lengths, seen = bytearray(), [], set()
    for r in records:
        index = GroupIndex(groups[r.group].raw)
        chunk = index.chunk(r.chunk)
        if chunk.zero or chunk.digest in seen:
            lengths.append(0)
            continue
        seen.add(chunk.digest)
        frame = groups[r.group].blob[chunk.offset : chunk.offset + chunk.clen]
        repacked = stored_frame(decode_chunk(frame, chunk.digest, chunk.ulen))
        pack += repacked
        lengths.append(len(repacked))
    hint = Hint(digest_hex(manifest), tuple(records), (),
                HintPack(digest_hex(bytes(pack)), len(pack), tuple(lengths)))
    return bytes(pack), stored_hint(hint), lengths


def build_vector(name: str, vector: Vector) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The files of one vector and its entry in vectors.json."""
    files: dict[str, bytes] = {}
    groups, refs, records, built = [], [], [], []
    for position, (gname, entries) in enumerate(vector.groups):
        group = build_group(entries, vector.chunk_size)
        built.append(group)
        files[f"{gname}.index.bin"] = group.raw
        files[f"{gname}.index.zst"] = group.stored
        info = {
            "name": gname,
            "index_object": _file(f"{gname}.index.zst", group.stored),
            "index_raw": _file(f"{gname}.index.bin", group.raw),
            "blob": _file(f"{gname}.blob", group.blob) if group.blob else None,
            "entries": expected_entries(entries),
        }
        if group.blob:
            files[f"{gname}.blob"] = group.blob
        groups.append(info)
        refs.append(GroupRef(gname, digest_hex(group.stored)))
        count = GroupIndex(group.raw).header.chunk_count
        # First access order of a pretend run: every chunk, last group first.
        records[:0] = [HintRecord(position, n, 0) for n in range(count)]
    records = [HintRecord(r.group, r.chunk, 7 * i) for i, r in enumerate(records)]
    provenance = {"generator": "format/vectors/generate.py", "vector": name}
    manifest = encode_manifest(Manifest(tuple(refs), vector.config, None, provenance))
    hint = stored_hint(Hint(digest_hex(manifest), tuple(records)))
    files[f"{name}.manifest.json"] = manifest
    files[f"{name}.hint.zst"] = hint
    reads = []
    for position, path, offset, length in vector.reads:
        entries = {e.path: e for e in vector.groups[position][1]}
        e = entries[path]
        e = entries[e.target] if e.kind == "hard" else e
        data = e.data[offset : offset + length]
        reads.append(
            {"group": position, "path_hex": path.hex(), "path": _show(path)}
            | {"offset": offset, "length": length, "data_hex": data.hex()}
        )
    entry = {
        "name": name,
        "chunk_size": vector.chunk_size,
        "groups": groups,
        "manifest": _file(f"{name}.manifest.json", manifest),
        "hint": _file(f"{name}.hint.zst", hint)
        | {"manifest": digest_hex(manifest), "records": [list(r) for r in records]},
        "reads": reads,
    }
    if len(built) > 1:  # the same records, packed: hint version 3
        pack, packed, lengths = packed_hint(manifest, records, built)
        files[f"{name}.pack.blob"] = pack
        files[f"{name}.packed-hint.zst"] = packed
        entry["packed_hint"] = _file(f"{name}.packed-hint.zst", packed) | {
            "pack": _file(f"{name}.pack.blob", pack), "lengths": lengths}
    if vector.composed is not None:
        entry["composed"] = [
            {"path": p, "path_hex": p.encode().hex(), "group": g, "type": t}
            for p, g, t in vector.composed
        ]
    return files, entry


def _canonical_json_vectors() -> ModuleType:
    """canonical_json_vectors.py beside this file (imported by path: this folder is no
    package)."""
    name = "weenv_canonical_json_vectors"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "canonical_json_vectors.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def build_all() -> dict[str, bytes]:
    """Every generated file of this folder, by path inside it."""
    files = {f"canonical-json/{name}": data
             for name, data in _canonical_json_vectors().build_files().items()}
    listing = []
    for name, vector in VECTORS.items():
        vfiles, entry = build_vector(name, vector)
        files.update(vfiles)
        listing.append(entry)
    image, device = erofs_image(EROFS_TREE)
    files["erofs-tree.img"] = image
    doc = {
        "description": "WeEnv format golden vectors; see format/SPEC.md section 13",
        "erofs": {
            "image": _file("erofs-tree.img", image),
            "device": {"digest": digest_hex(device), "size": len(device)},
            "device_tag": EROFS_DEVICE_TAG.decode(),
            "chunk_bits": EROFS_CHUNK_BITS,
        },
        "versions": {
            "index": C.INDEX_VERSION,
            "hint": C.HINT_VERSION,
            "hint_pack": C.HINT_PACK_VERSION,
            "manifest_schema": C.MANIFEST_SCHEMA,
        },
        "vectors": listing,
    }
    files["vectors.json"] = (
        json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    ).encode()
    return files


def _differences(out: Path, files: dict[str, bytes]) -> list[str]:
    problems = []
    for name, data in sorted(files.items()):
        path = out / name
        if not path.is_file():
            problems.append(f"missing: {name}")
        elif path.read_bytes() != data:
            problems.append(f"differs: {name}")
    keep = set(files) | {Path(__file__).name, "canonical_json_vectors.py"}
    for path in sorted(out.rglob("*")):
        name = path.relative_to(out).as_posix()
        if path.is_file() and name not in keep and "__pycache__" not in name:
            problems.append(f"stale: {name}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Write the vectors (or, with --check, compare them) and return an exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only, write nothing")
    parser.add_argument("--out", type=Path, default=HERE, help="folder (default: this one)")
    args = parser.parse_args(argv)
    files = build_all()
    if args.check:
        problems = _differences(args.out, files)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print(
                "vectors differ from generate.py (changing them is a format change)",
                file=sys.stderr,
            )
        return 1 if problems else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (args.out / name).parent.mkdir(parents=True, exist_ok=True)
        (args.out / name).write_bytes(data)
    print(f"wrote {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
