"""The writer: canonical bytes whatever the build order, and refusal of what readers refuse.

- the same tree built in two insertion orders gives the same bytes (canonical ordering);
- hardlinks: one inode, nlink = names; equal chunk runs share records;
- invalid trees are refused with `FormatError` (not struct.error): bad names, types, flags on
  the wrong type, out-of-range numbers, chunk layouts a reader would refuse, a directory
  reachable twice (the root included), oversized strings, chunk size out of range.
"""

from __future__ import annotations

import stat
from collections.abc import Callable

import pytest
from format_support import describe_index, describe_tree, exercise

from weenvfs.format import constants as C
from weenvfs.format.digest import digest_bytes
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import ChunkRef, Node, encode_index, encode_index_object

CS = 4096
DIR, REG = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644
BLOB = "cd" * 32


def ref(n: int, ulen: int = CS, blob: str | None = BLOB) -> ChunkRef:
    return ChunkRef(
        digest_bytes(n.to_bytes(4, "little")),
        blob,
        0 if blob is None else n,
        0 if blob is None else 9,
        ulen,
    )


def _tree(order: Callable[[list[bytes]], list[bytes]]) -> Node:
    shared = Node(REG, size=3, chunks=[ref(1, 10)], inner_offset=2)
    names = [b"b", b"a", b"c", b"\xff", b"a-b"]
    root = Node(DIR)
    for name in order(names):
        d = Node(DIR, mtime_ns=-1)
        root.children[name] = d
        for sub in order([b"y", b"x", b"link"]):
            d.children[sub] = shared if sub == b"link" else Node(REG, size=0)
    return root


def test_same_tree_any_build_order_same_bytes() -> None:
    one = encode_index(_tree(lambda n: n), CS)
    two = encode_index(_tree(lambda n: sorted(n, reverse=True)), CS)
    assert one == two
    assert encode_index_object(_tree(list), CS) == encode_index_object(_tree(list), CS)


def test_hardlinks_and_shared_runs() -> None:
    index = GroupIndex(encode_index(_tree(list), CS))
    assert exercise(index) == 1 + 5 + 15
    links = {ino for path, ino in index.walk() if path.endswith(b"/link")}
    assert len(links) == 1 and index.inode(links.pop()).nlink == 5
    assert index.header.chunk_count == 1
    assert index.inode(0).nlink == 2 + 5
    assert describe_index(index) == describe_tree(_tree(list))


def test_file_digest_and_zero_chunks_set_their_feature_bits() -> None:
    root = Node(DIR)
    root.children[b"f"] = Node(REG, size=3, chunks=[ref(1, 3)], file_digest=bytes(32))
    h = GroupIndex(encode_index(root, CS)).header
    assert (h.feature_compat, h.feature_incompat) == (C.COMPAT_FILE_DIGESTS, 0)
    root.children[b"f"] = Node(REG, size=CS + 1, chunks=[ref(0, CS, None), ref(2, 1)])
    h = GroupIndex(encode_index(root, CS)).header
    assert (h.feature_compat, h.feature_incompat) == (0, C.INCOMPAT_ZERO_CHUNKS)


def _with(child: Node, name: bytes = b"x") -> Node:
    root = Node(DIR)
    root.children[name] = child
    return root


BAD_TREES = {
    "empty name": _with(Node(REG), b""),
    "dot": _with(Node(REG), b"."),
    "dotdot": _with(Node(REG), b".."),
    "slash": _with(Node(REG), b"a/b"),
    "nul": _with(Node(REG), b"a\0"),
    "long name": _with(Node(REG), b"n" * 256),
    "unknown type": _with(Node(0o030644)),
    "whiteout file": _with(Node(REG, whiteout=True)),
    "opaque file": _with(Node(REG, opaque=True)),
    "uid": _with(Node(REG, uid=1 << 32)),
    "gid": _with(Node(REG, gid=-1)),
    "mtime": _with(Node(REG, mtime_ns=1 << 100)),
    "rdev": _with(Node(stat.S_IFCHR, rdev=1 << 64)),
    "symlink": _with(Node(stat.S_IFLNK | 0o777, target=b"t" * 4096)),
    "xattr key": _with(Node(REG, xattrs={b"": b"v"})),
    "xattr value": _with(Node(REG, xattrs={b"user.k": bytes(65537)})),
    "file digest": _with(Node(REG, file_digest=b"short")),
    "chunks on a dir": _with(Node(DIR, chunks=[ref(1)])),
    "size without chunks": _with(Node(REG, size=1)),
    "past one chunk": _with(Node(REG, size=5, inner_offset=8, chunks=[ref(1, 12)])),
    "chunk count": _with(Node(REG, size=CS + 1, chunks=[ref(1), ref(2, 1), ref(3, 1)])),
    "short middle": _with(Node(REG, size=CS + 1, chunks=[ref(1, CS - 1), ref(2, 2)])),
    "inner offset": _with(Node(REG, size=CS + 1, inner_offset=1, chunks=[ref(1), ref(2, 1)])),
    "zero with offset": _with(Node(REG, size=4, chunks=[ChunkRef(bytes(32), None, 5, 0, 4)])),
    "bad blob name": _with(Node(REG, size=4, chunks=[ChunkRef(bytes(32), "AB" * 32, 0, 9, 4)])),
    "short digest": _with(Node(REG, size=4, chunks=[ChunkRef(b"x", BLOB, 0, 9, 4)])),
    "frame over its bound": _with(
        Node(REG, size=4, chunks=[ChunkRef(bytes(32), BLOB, 0, C.max_frame_size(4) + 1, 4)])
    ),
    "xattrs over the inode limit": _with(
        Node(REG, xattrs={b"user.%d" % k: bytes(65536) for k in range(4)})
    ),
    "root not a dir": Node(REG),
}


@pytest.mark.parametrize("name", sorted(BAD_TREES))
def test_writer_refuses(name: str) -> None:
    with pytest.raises(FormatError):
        encode_index(BAD_TREES[name], CS)


def test_directory_reachable_twice() -> None:
    root = Node(DIR)
    d = Node(DIR)
    root.children[b"a"] = root.children[b"b"] = d
    with pytest.raises(FormatError, match="two names"):
        encode_index(root, CS)
    loop = Node(DIR)
    loop.children[b"self"] = loop
    with pytest.raises(FormatError, match="two names"):
        encode_index(loop, CS)


@pytest.mark.parametrize("chunk_size", [0, C.MIN_CHUNK_SIZE - 1, C.MAX_CHUNK_SIZE + 1])
def test_chunk_size_range(chunk_size: int) -> None:
    with pytest.raises(FormatError, match="chunk_size"):
        encode_index(Node(DIR), chunk_size)
