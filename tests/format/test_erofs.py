"""The EROFS metadata image writer without the kernel (format/erofs.py, SPEC.md section 15).

- determinism: same inodes, same bytes; a different device tag or content changes the uuid;
- the structure a reader walks: superblock fields, the device slot, the root inode at nid 0,
  dirents sorted across blocks with "." and "..", inline tails that stay inside their block,
  chunk indexes 8-aligned after the xattrs, holes as EROFS_NULL_ADDR, rdev encoding;
- every input the format cannot hold is refused with a one-line FormatError naming the field;
- the golden image (format/vectors/erofs-tree.img) is what the writer makes, byte for byte.
The kernel oracle is tests/format/test_erofs_kernel.py.
"""

from __future__ import annotations

import os
import stat
from types import ModuleType
from typing import Any

import pytest
from format_support import VECTORS_DIR

from weenvfs.format import erofs_layout as L
from weenvfs.format.digest import digest_hex
from weenvfs.format.erofs import BLOCK_SIZE, HOLE, ErofsInode, write_image
from weenvfs.format.errors import FormatError

DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644


def _root(*entries: tuple[bytes, int], nlink: int = 2) -> ErofsInode:
    return ErofsInode(DIR, 0, 0, nlink, 0, entries=entries)


def _file(size: int = 0, chunks: tuple[int, ...] = (), **kw: Any) -> ErofsInode:
    return ErofsInode(REG, 0, 0, 1, 0, size=size, chunks=chunks, **kw)


def _super(img: bytes) -> tuple[Any, ...]:
    return L.EROFS_SUPER_BLOCK.unpack_from(img, L.EROFS_SUPER_OFFSET)


def _inode(img: bytes, nid: int) -> tuple[Any, ...]:
    return L.EROFS_INODE_EXTENDED.unpack_from(img, BLOCK_SIZE * L.EROFS_META_BLKADDR + 32 * nid)


def _dirents(img: bytes, nid: int) -> list[tuple[bytes, int, int]]:
    """(name, nid, file_type) of a directory's inline-or-plain blocks, in stored order."""
    fmt, icount, _, _, size, i_u, *_ = _inode(img, nid)
    layout = fmt >> 1
    xsize = 12 + 4 * (icount - 1) if icount else 0
    blocks = -(-size // BLOCK_SIZE)
    out = []
    for b in range(blocks):
        if layout == L.EROFS_INODE_FLAT_INLINE and b == blocks - 1:
            start = BLOCK_SIZE * L.EROFS_META_BLKADDR + 32 * nid + 64 + xsize
        else:
            start = (i_u + b) * BLOCK_SIZE
        length = min(BLOCK_SIZE, size - b * BLOCK_SIZE)
        block = img[start : start + length]
        first = L.EROFS_DIRENT.unpack_from(block, 0)
        count = first[1] // 12
        ents = [L.EROFS_DIRENT.unpack_from(block, 12 * k) for k in range(count)]
        for k, (child, nameoff, ftype) in enumerate(ents):
            end = ents[k + 1][1] if k + 1 < count else length
            out.append((block[nameoff:end].rstrip(b"\0"), child, ftype))
    return out


def test_same_input_same_bytes() -> None:
    tree = [_root((b"a", 1), (b"b", 2)), _file(5, (0,)), _file(0)]
    assert write_image(tree, 4) == write_image(list(tree), 4)
    assert _super(write_image(tree, 4, b"x"))[12] != _super(write_image(tree, 4, b"y"))[12]


def test_superblock_and_device_slot() -> None:
    img = write_image([_root((b"f", 1)), _file(10, (3,))], 7, b"tag")
    assert len(img) % BLOCK_SIZE == 0
    sb = _super(img)
    magic, checksum, compat, blkszbits, extslots, root_nid, inos = sb[:7]
    assert (magic, checksum, compat, blkszbits, extslots, root_nid, inos) == (
        L.EROFS_MAGIC,
        0,
        0,
        12,
        0,
        0,
        2,
    )
    assert sb[7:9] == (0, 0)  # build time
    assert sb[9] == len(img) // BLOCK_SIZE and sb[10] == L.EROFS_META_BLKADDR
    assert any(sb[12])  # a uuid
    incompat, _, extra, slotoff = sb[14:18]
    assert incompat == L.EROFS_FEATURE_INCOMPAT_CHUNKED_FILE | L.EROFS_FEATURE_INCOMPAT_DEVICE_TABLE
    assert (extra, slotoff) == (1, L.EROFS_DEVT_OFFSET // 128)
    tag, blocks, mapped, *_ = L.EROFS_DEVICE_SLOT.unpack_from(img, L.EROFS_DEVT_OFFSET)
    assert (tag.rstrip(b"\0"), blocks, mapped) == (b"tag", 7, 0)


def test_dirents_sorted_across_blocks_with_dot_entries() -> None:
    names = [b"%03d" % k + b"z" * 60 for k in range(150)] + [b"!first", b"-", b"\xff"]
    tree = [_root(*((n, 1) for n in reversed(names))), ErofsInode(REG, 0, 0, len(names), 0)]
    img = write_image(tree, 0)
    found = _dirents(img, 0)
    assert [n for n, _, _ in found] == sorted([*names, b".", b".."])
    assert {(n, c) for n, c, _ in found if n in (b".", b"..")} == {(b".", 0), (b"..", 0)}
    fmt, *_, size, i_u = _inode(img, 0)[:6]
    assert size > BLOCK_SIZE and fmt >> 1 == L.EROFS_INODE_FLAT_INLINE and i_u > 0


def test_inline_tail_never_crosses_a_block() -> None:
    # Symlinks of growing length: each tail must sit in the block of its inode.
    n = 40
    links = [
        ErofsInode(stat.S_IFLNK | 0o777, 0, 0, 1, 0, target=b"t" * (100 * k + 1)) for k in range(n)
    ]
    img = write_image([_root(*((b"l%02d" % k, k + 1) for k in range(n))), *links], 0)
    for name, nid, ftype in _dirents(img, 0):
        if name.startswith(b"l"):
            assert ftype == L.EROFS_FT_SYMLINK
            fmt, _, _, _, size, *_ = _inode(img, nid)
            start = BLOCK_SIZE * L.EROFS_META_BLKADDR + 32 * nid
            if fmt >> 1 == L.EROFS_INODE_FLAT_INLINE:
                assert start // BLOCK_SIZE == (start + 64 + size - 1) // BLOCK_SIZE
                assert img[start + 64 : start + 64 + size] == b"t" * size


def test_chunk_indexes_after_xattrs_and_holes() -> None:
    f = _file(3 * BLOCK_SIZE + 1, (5, HOLE, 6, 9), xattrs=((b"user.a", b"b"),))
    img = write_image([_root((b"f", 1)), f], 10)
    nid = _dirents(img, 0)[-1][1]
    fmt, icount, _, _, size, i_u, *_ = _inode(img, nid)
    assert fmt == 1 | L.EROFS_INODE_CHUNK_BASED << 1 and i_u == L.EROFS_CHUNK_FORMAT_INDEXES
    start = BLOCK_SIZE * L.EROFS_META_BLKADDR + 32 * nid + 64 + 12 + 4 * (icount - 1)
    start += -start % 8
    got = [L.EROFS_CHUNK_INDEX.unpack_from(img, start + 8 * k) for k in range(4)]
    assert got == [(0, 1, 5), (0, 0, L.EROFS_NULL_ADDR), (0, 1, 6), (0, 1, 9)]


def test_rdev_is_the_kernels_new_encoding() -> None:
    dev = ErofsInode(stat.S_IFCHR | 0o600, 0, 0, 1, 0, rdev=os.makedev(0x123, 0x45678))
    img = write_image([_root((b"d", 1)), dev], 0)
    i_u = _inode(img, _dirents(img, 0)[-1][1])[5]
    assert (i_u & 0xFFF00) >> 8 == 0x123
    assert (i_u & 0xFF) | ((i_u >> 12) & 0xFFF00) == 0x45678


def test_negative_mtime() -> None:
    img = write_image([ErofsInode(DIR, 0, 0, 2, -1_500_000_001)], 0)
    assert _inode(img, 0)[9:11] == (-2, 499_999_999)


def _bad(what: str, tree: list[ErofsInode], device_blocks: int = 8, tag: bytes = b"") -> None:
    with pytest.raises(FormatError) as info:
        write_image(tree, device_blocks, tag)
    assert info.value.what == what and "\n" not in str(info.value)


@pytest.mark.parametrize("name", [b"", b"a/b", b"a\0b", b"x" * 256, b".", b".."], ids=repr)
def test_bad_names(name: bytes) -> None:
    _bad("entry name", [_root((name, 1)), _file()])


def test_refusals() -> None:
    f = _file()
    _bad("entry name", [_root((b"a", 1), (b"a", 1)), f])
    _bad("inodes", [f])
    _bad("inodes", [])
    _bad("entry inode", [_root((b"a", 5)), f])
    sub = ErofsInode(DIR, 0, 0, 2, 0)
    _bad("entries", [_root((b"a", 1), (b"b", 1)), sub])  # a directory listed twice
    _bad("entries", [_root((b"a", 0))])  # the root as an entry
    cycle = [
        _root(),
        ErofsInode(DIR, 0, 0, 2, 0, entries=((b"b", 2),)),
        ErofsInode(DIR, 0, 0, 2, 0, entries=((b"a", 1),)),
    ]
    _bad("entries", cycle)
    _bad("entries", [_root(), f])  # unreachable
    _bad("uid", [_root((b"a", 1)), ErofsInode(REG, 1 << 32, 0, 1, 0)])
    _bad("gid", [_root((b"a", 1)), ErofsInode(REG, 0, -1, 1, 0)])
    _bad("nlink", [_root((b"a", 1)), ErofsInode(REG, 0, 0, 0, 0)])
    _bad("mode", [_root((b"a", 1)), ErofsInode(0o644, 0, 0, 1, 0)])
    _bad("mtime_ns", [_root((b"a", 1)), ErofsInode(REG, 0, 0, 1, 1 << 100)])
    _bad("chunks", [_root((b"a", 1)), _file(BLOCK_SIZE + 1, (0,))])  # wrong length
    _bad("chunks", [_root((b"a", 1)), _file(10, (8,))])  # off the device
    _bad("chunks", [_root((b"a", 1)), _file(10, (-2,))])
    _bad("chunks", [_root((b"a", 1)), _file(2 * BLOCK_SIZE, (0, 1 << 32))])
    _bad("chunk_bits", [_root((b"a", 1)), _file(10, (0,), chunk_bits=32)])
    _bad("size", [_root((b"a", 1)), ErofsInode(DIR, 0, 0, 2, 0, size=5)])
    _bad("xattr name", [_root((b"a", 1)), _file(xattrs=((b"os2.x", b""),))])
    _bad("xattr name", [_root((b"a", 1)), _file(xattrs=((b"user.", b""),))])
    _bad("xattr name", [_root((b"a", 1)), _file(xattrs=((b"system.foo", b""),))])
    _bad("xattr name", [_root((b"a", 1)), _file(xattrs=((b"user.a", b""), (b"user.a", b"")))])
    _bad("xattr name", [_root((b"a", 1)), _file(xattrs=((b"user." + b"n" * 251, b""),))])
    _bad("xattr value", [_root((b"a", 1)), _file(xattrs=((b"user.a", bytes(65536)),))])
    many = tuple((b"user.%06d" % k + b"v" * 200, bytes(60000)) for k in range(5))
    _bad("xattrs", [_root((b"a", 1)), _file(xattrs=many)])
    _bad("rdev", [_root((b"a", 1)), ErofsInode(stat.S_IFCHR, 0, 0, 1, 0, rdev=os.makedev(4096, 0))])
    _bad("rdev", [_root((b"a", 1)), _file(rdev=1)])
    _bad("target", [_root((b"a", 1)), ErofsInode(stat.S_IFLNK | 0o777, 0, 0, 1, 0)])
    _bad("target", [_root((b"a", 1)), ErofsInode(stat.S_IFLNK, 0, 0, 1, 0, target=b"t" * 4096)])
    _bad("target", [_root((b"a", 1)), _file(target=b"x")])
    _bad("entries", [_root((b"a", 1)), _file(entries=((b"b", 0),))])
    _bad("device_blocks", [_root()], 1 << 32)
    _bad("device_tag", [_root()], 0, b"t" * 65)


def test_golden_image_is_what_the_writer_makes(
    generator: ModuleType, vectors_doc: dict[str, Any]
) -> None:
    info = vectors_doc["erofs"]
    image, device = generator.erofs_image(generator.EROFS_TREE, info["chunk_bits"])
    stored = (VECTORS_DIR / info["image"]["file"]).read_bytes()
    assert image == stored
    assert digest_hex(stored) == info["image"]["digest"] and len(stored) == info["image"]["size"]
    assert digest_hex(device) == info["device"]["digest"] and len(device) == info["device"]["size"]
    assert info["device_tag"].encode() == generator.EROFS_DEVICE_TAG


def test_golden_tree_covers_the_brief(generator: ModuleType) -> None:
    inodes, device, index = generator.build_erofs(generator.EROFS_TREE)
    kinds = {stat.S_IFMT(n.mode) for n in inodes}
    assert kinds == {
        stat.S_IFDIR,
        stat.S_IFREG,
        stat.S_IFLNK,
        stat.S_IFCHR,
        stat.S_IFBLK,
        stat.S_IFIFO,
        stat.S_IFSOCK,
    }
    assert any(HOLE in n.chunks for n in inodes) and any(len(n.chunks) > 2 for n in inodes)
    assert any(n.mtime_ns < 0 for n in inodes)
    assert any(stat.S_ISCHR(n.mode) and n.rdev == 0 for n in inodes)  # a whiteout
    names = [p.rpartition(b"/")[2] for p in index]
    assert any(len(n) == 255 for n in names)
    assert any(not _utf8(n) for n in names)
    xattr_names = {k for n in inodes for k, _ in n.xattrs}
    assert {b"system.posix_acl_access", b"trusted.overlay.opaque", b"security.capability"} <= (
        xattr_names
    )
    img = write_image(inodes, len(device) // BLOCK_SIZE)
    sizes = [_inode(img, nid)[4] for _, nid, ft in _dirents(img, 0) if ft == L.EROFS_FT_DIR]
    assert max(sizes) > BLOCK_SIZE  # a directory of two blocks


def _utf8(name: bytes) -> bool:
    try:
        name.decode()
    except UnicodeDecodeError:
        return False
    return True
