"""Random trees (seeded, reproducible; in the spirit of hypothesis, without the dependency).

For each seed: a random tree with every file type, arbitrary byte names, hardlinks, xattrs,
batched, single-chunk and multi-chunk files with holes, whiteouts, opaque and implied dirs;
encode -> decode -> walk gives the same tree (`describe_*`); re-encoding the decoded tree
gives the same bytes; encoding a shuffled build of the same tree gives the same bytes; and
composing random stacks of such groups never fails a consistency check.
"""

from __future__ import annotations

import random
import stat

import pytest
from format_support import (
    describe_index,
    describe_tree,
    exercise,
    exercise_composed,
    tree_from_index,
)

from weenvfs.format import constants as C
from weenvfs.format.compose import ComposedTree
from weenvfs.format.digest import digest_bytes
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import ChunkRef, Node, encode_index

SEEDS = range(120)
_SPECIAL = [stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK]


def _name(rng: random.Random) -> bytes:
    pick = rng.random()
    if pick < 0.5:
        return bytes(rng.choice(b"abcxyz") for _ in range(rng.randint(1, 3)))
    if pick < 0.9:
        size = rng.choice([1, 2, 8, 255])
        return bytes(rng.choice([c for c in range(1, 256) if c != 0x2F]) for _ in range(size))
    return rng.choice([b"...", b".a", b"a.", b"\xff\xfe", b"-"])


def _ref(rng: random.Random, ulen: int, blobs: list[str], zero: bool = False) -> ChunkRef:
    digest = digest_bytes(rng.randbytes(8))
    if zero:
        return ChunkRef(digest, None, 0, 0, ulen)
    return ChunkRef(
        digest, rng.choice(blobs), rng.randrange(1 << 40),
        rng.randint(9, C.max_frame_size(ulen)), ulen,
    )


def _file(rng: random.Random, cs: int, blobs: list[str], batches: list[ChunkRef]) -> Node:
    node = Node(stat.S_IFREG | rng.choice([0o644, 0o755, 0o4755, 0o600]))
    kind = rng.random()
    if kind < 0.2:
        return node  # empty
    if kind < 0.55:  # batched: a slice of a shared batch chunk
        batch = rng.choice(batches)
        node.size = rng.randint(0, batch.ulen)
        node.inner_offset = rng.randint(0, batch.ulen - node.size)
        node.chunks = [batch]
        node.file_digest = digest_bytes(rng.randbytes(4)) if rng.random() < 0.8 else None
        return node
    node.size = rng.choice([1, cs - 1, cs, cs + 1, 3 * cs, 5 * cs + 7])
    if node.size <= cs and rng.random() < 0.7:
        node.chunks = [_ref(rng, node.size + rng.choice([0, 0, 5]), blobs)]
        return node
    count = -(-node.size // cs)
    node.chunks = [
        _ref(rng, min(cs, node.size - k * cs), blobs, zero=rng.random() < 0.2) for k in range(count)
    ]
    return node


def random_tree(seed: int) -> tuple[Node, int]:
    """A random tree and its chunk size."""
    rng = random.Random(seed)
    cs = rng.choice([C.MIN_CHUNK_SIZE, 8192, C.DEFAULT_CHUNK_SIZE])
    blobs = sorted({digest_bytes(rng.randbytes(4)).hex() for _ in range(rng.randint(1, 4))})
    batches = [_ref(rng, rng.randint(1, cs), blobs) for _ in range(2)]
    root = Node(stat.S_IFDIR | 0o755, implied=rng.random() < 0.3, opaque=rng.random() < 0.1)
    dirs, files = [root], []
    for _ in range(rng.randint(0, 60)):
        parent = rng.choice(dirs)
        name = _name(rng)
        if name in (b".", b"..") or name in parent.children:
            continue
        roll = rng.random()
        if roll < 0.25:
            node = Node(stat.S_IFDIR | rng.choice([0o755, 0o700, 0o1777]))
            node.opaque, node.implied = rng.random() < 0.15, rng.random() < 0.15
            dirs.append(node)
        elif roll < 0.6:
            node = _file(rng, cs, blobs, batches)
            files.append(node)
        elif roll < 0.7 and files:
            node = rng.choice(files)  # a hardlink
        elif roll < 0.8:
            target = bytes(rng.randrange(1, 256) for _ in range(rng.randint(0, 40)))
            node = Node(stat.S_IFLNK | 0o777, target=target, size=len(target))
        elif roll < 0.88:
            node = Node(stat.S_IFCHR, whiteout=True)
        else:
            node = Node(rng.choice(_SPECIAL) | 0o640, rdev=rng.randrange(1 << 64))
        node.uid, node.gid = rng.choice([0, 1000, 2**32 - 1]), rng.choice([0, 65534])
        node.mtime_ns = rng.randrange(-(2**62), 2**62)
        if rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                key = b"user." + _name(rng)[:200]
                node.xattrs[key] = rng.randbytes(rng.choice([0, 3, 100]))
        parent.children[name] = node
    return root, cs


def _shuffled(root: Node, seed: int) -> Node:
    """The same tree, every children dict rebuilt in a random insertion order."""
    rng = random.Random(seed)
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen or not node.is_dir:
            continue
        seen.add(id(node))
        items = list(node.children.items())
        rng.shuffle(items)
        node.children = dict(items)
        stack.extend(node.children.values())
    return root


@pytest.mark.parametrize("seed", SEEDS)
def test_encode_decode_walk(seed: int) -> None:
    root, cs = random_tree(seed)
    raw = encode_index(root, cs)
    index = GroupIndex(raw)
    exercise(index)
    assert describe_index(index) == describe_tree(root)
    assert encode_index(tree_from_index(index), cs) == raw
    assert encode_index(_shuffled(root, seed), cs) == raw


@pytest.mark.parametrize("seed", range(40))
def test_random_stacks_compose(seed: int) -> None:
    rng = random.Random(seed)
    groups = []
    for i in range(rng.randint(1, 4)):
        root, cs = random_tree(seed * 10 + i)
        groups.append(GroupIndex(encode_index(root, cs)))
    tree = ComposedTree(groups)
    for path, entry in tree.walk():
        rec = tree.groups[entry.group].inode(entry.inode)
        assert not rec.whiteout, path
        assert rec.is_dir == entry.is_dir
    exercise_composed(tree)
