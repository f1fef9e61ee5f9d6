"""Helpers of the format tests: the golden vectors, a full exercise of a decoded index, and
turning a decoded index back into the writer's tree.

Owns: `VECTORS_DIR`/`load_generator()` (format/vectors/generate.py imported by path, it is no
package), `exercise(index)` (read every record the way a mount would and assert what the reader
guarantees), `exercise_composed`, `tree_from_index`, `describe_tree`/`describe_index` (the
comparable meaning of a tree), `read_file` (file bytes through `file_spans` and blob frames).
Must not: know any vector's content (that is vectors.json's job).
"""

from __future__ import annotations

import importlib.util
import stat
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import weenvfs.format
from weenvfs.format.chunk import decode_chunk
from weenvfs.format.compose import ComposedTree
from weenvfs.format.index import GroupIndex, file_spans
from weenvfs.format.index_writer import ChunkRef, Node

FORMAT_DIR = Path(weenvfs.format.__file__).resolve().parent
VECTORS_DIR = FORMAT_DIR / "vectors"
SPEC_PATH = FORMAT_DIR / "SPEC.md"


def load_generator() -> ModuleType:
    """format/vectors/generate.py as a module (cached in sys.modules)."""
    name = "weenv_vectors_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, VECTORS_DIR / "generate.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while being defined
        spec.loader.exec_module(module)
    return sys.modules[name]


def exercise(index: GroupIndex) -> int:
    """Walk and read every record; assert the reader's guarantees; return the path count.

    Only `FormatError` may escape from the codec; anything else (or a failed assertion) means a
    missing validation: a reader handed this index would misbehave.
    """
    paths = 0
    for path, ino in index.walk():
        paths += 1
        rec = index.inode(ino)
        assert index.resolve(path) == ino, path
        assert 0 <= rec.mtime_nsec < 1_000_000_000
        if rec.is_dir:
            entries = list(index.entries(ino))
            assert index.entry_count(ino) == len(entries)
            for name, child in entries:
                assert 0 < len(name) <= 255 and b"/" not in name and b"\0" not in name
                assert index.lookup(ino, name) == child
            assert index.lookup(ino, b"\xff" * 256) is None
        elif rec.is_reg:
            _exercise_file(index, ino, rec.size)
        elif rec.is_lnk:
            assert len(index.readlink(ino)) == rec.data_count
        for key, value in index.xattrs(ino):
            assert 0 < len(key) <= 255 and len(value) <= 65536
    for ino, digest in index.file_digests():
        assert 0 <= ino < index.inode_count and len(digest) == 32
    assert all(len(b) == 64 for b in index.blob_digests())
    return paths


def _exercise_file(index: GroupIndex, ino: int, size: int) -> None:
    for n in index.file_chunks(ino):
        chunk = index.chunk(n)
        if not chunk.zero:
            index.blob_digest(chunk.blob)
    spans = file_spans(index, ino, 0, size)
    assert sum(s.end - s.start for s in spans) == size
    for s in spans:
        assert 0 <= s.start <= s.end <= index.chunk(s.chunk).ulen
    if size > 1:
        tail = file_spans(index, ino, size - 1, 10)
        assert sum(s.end - s.start for s in tail) == 1


def exercise_composed(tree: ComposedTree) -> int:
    """Walk a composed tree and look every entry up again; return the path count."""
    paths = 0
    for path, entry in tree.walk():
        paths += 1
        again = tree.resolve(path)
        assert again is not None and (again.group, again.inode) == (entry.group, entry.inode)
        if entry.is_dir:
            assert tree.names(entry) == sorted(tree.names(entry))
    return paths


def tree_from_index(index: GroupIndex) -> Node:
    """The writer's tree that `index` describes (hardlinks share one Node)."""
    blobs = index.blob_digests()
    digests = dict(index.file_digests())
    nodes: dict[int, Node] = {}

    def build(ino: int) -> Node:
        if ino in nodes:
            return nodes[ino]
        rec = index.inode(ino)
        node = nodes[ino] = Node(
            mode=rec.mode,
            uid=rec.uid,
            gid=rec.gid,
            mtime_ns=rec.mtime_ns,
            size=rec.size,
            rdev=rec.rdev,
            whiteout=rec.whiteout,
            opaque=rec.opaque,
            implied=rec.implied,
            target=index.readlink(ino) if rec.is_lnk else b"",
            xattrs=dict(index.xattrs(ino)),
            inner_offset=rec.inner_offset,
            file_digest=digests.get(ino),
        )
        if rec.is_reg:
            for n in index.file_chunks(ino):
                c = index.chunk(n)
                blob = None if c.zero else blobs[c.blob]
                node.chunks.append(ChunkRef(c.digest, blob, c.offset, c.clen, c.ulen))
        if rec.is_dir:
            for name, child in index.entries(ino):
                node.children[name] = build(child)
        return node

    return build(0)


def describe_tree(root: Node) -> dict[bytes, tuple[Any, ...]]:
    """path -> everything a reader can observe, with hardlinks as the first path of the inode."""
    out: dict[bytes, tuple[Any, ...]] = {}
    first: dict[int, bytes] = {}
    stack = [(b"", root)]
    while stack:
        path, node = stack.pop()
        link = first.setdefault(id(node), path)
        chunks = tuple((c.digest, c.blob, c.offset, c.clen, c.ulen) for c in node.chunks)
        out[path] = (
            link,
            node.mode,
            node.uid,
            node.gid,
            node.mtime_ns,
            node.size if stat.S_ISREG(node.mode) or stat.S_ISLNK(node.mode) else None,
            node.rdev,
            node.whiteout,
            node.opaque,
            node.implied,
            node.target,
            tuple(sorted(node.xattrs.items())),
            chunks,
            node.inner_offset if chunks else 0,
            node.file_digest,
        )
        if node.is_dir:
            for name in sorted(node.children, reverse=True):
                stack.append((path + b"/" + name if path else name, node.children[name]))
    return out


def describe_index(index: GroupIndex) -> dict[bytes, tuple[Any, ...]]:
    """`describe_tree` of what `index` decodes to."""
    return describe_tree(tree_from_index(index))


def read_file(
    index: GroupIndex, ino: int, blobs: dict[str, bytes], offset: int, length: int
) -> bytes:
    """Bytes [offset, offset + length) of file `ino`, verified, frames taken from `blobs`."""
    out = []
    for span in file_spans(index, ino, offset, length):
        c = index.chunk(span.chunk)
        if c.zero:
            plain = bytes(c.ulen)
        else:
            blob = blobs[index.blob_digest(c.blob)]
            plain = decode_chunk(blob[c.offset : c.offset + c.clen], c.digest, c.ulen)
        out.append(plain[span.start : span.end])
    return b"".join(out)
