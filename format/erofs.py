"""The derived EROFS metadata image of a group (SPEC.md section 15): a pure writer.

Owns: turning a list of `ErofsInode`s (the root first) into the bytes of an uncompressed EROFS
image that the Linux kernel mounts read-only: 4096-byte blocks, 64-byte extended inodes,
inline xattrs, sorted dirent blocks with their tails packed after the inode, and regular files
as chunk-based inodes whose chunks live on ONE extra device (the group's virtual data device).
Same input, same bytes: no clock (build time 0), the uuid is derived from the content.

Must not: read or write files, know the group index or how the data device is served (the node
builds the inode list and serves the device); byte layouts live in `erofs_layout.py`.

Speed matters (the node writes an image at mount time): one pass plans sizes, one places the
inodes, one packs everything into a single preallocated bytearray with `struct.pack_into`.
"""

from __future__ import annotations

import stat
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from . import erofs_layout as L
from .constants import MAX_IMAGE_SIZE
from .errors import FormatError

BLOCK_SIZE = 1 << L.EROFS_BLKSZBITS
HOLE = -1  # a chunk with no data: reads as zeros

_U32 = 1 << 32
_S_IFMT = 0o170000
_VERSION = L.EROFS_INODE_EXTENDED_VERSION
_MIN_NS, _MAX_NS = -(1 << 63) * 10**9, (1 << 63) * 10**9  # i_mtime is a signed 64-bit second
INODE_SIZE = L.EROFS_INODE_EXTENDED.size
DIRENT_SIZE = L.EROFS_DIRENT.size
CHUNK_INDEX_SIZE = L.EROFS_CHUNK_INDEX.size
_MAX_NAME = 255  # EROFS_NAME_LEN, also Linux NAME_MAX and XATTR_NAME_MAX
_MAX_SYMLINK = 4095  # PATH_MAX - 1
_MAX_XATTR_VALUE = 0xFFFF  # e_value_size is a u16
_MAX_XATTR_ICOUNT = 0xFFFF  # i_xattr_icount is a u16
_MAX_CHUNK_BITS = L.EROFS_CHUNK_FORMAT_BLKBITS_MASK
_FTYPE = {
    stat.S_IFREG: L.EROFS_FT_REG_FILE,
    stat.S_IFDIR: L.EROFS_FT_DIR,
    stat.S_IFCHR: L.EROFS_FT_CHRDEV,
    stat.S_IFBLK: L.EROFS_FT_BLKDEV,
    stat.S_IFIFO: L.EROFS_FT_FIFO,
    stat.S_IFSOCK: L.EROFS_FT_SOCK,
    stat.S_IFLNK: L.EROFS_FT_SYMLINK,
}
_SPECIAL = frozenset({stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK})
# Full names stored as an index alone (the ACLs), then prefixes stored as index + suffix.
_XATTR_WHOLE = {
    b"system.posix_acl_access": L.EROFS_XATTR_INDEX_POSIX_ACL_ACCESS,
    b"system.posix_acl_default": L.EROFS_XATTR_INDEX_POSIX_ACL_DEFAULT,
}
_XATTR_PREFIXES = (
    (b"user.", L.EROFS_XATTR_INDEX_USER),
    (b"trusted.", L.EROFS_XATTR_INDEX_TRUSTED),
    (b"security.", L.EROFS_XATTR_INDEX_SECURITY),
)


@dataclass(frozen=True, slots=True)
class ErofsInode:
    """One inode of the image. Directories list (name, index into the inode list) entries
    without "." and ".."; regular files give their chunks' block addresses on the device."""

    mode: int  # full st_mode incl. file type bits
    uid: int
    gid: int
    nlink: int
    mtime_ns: int  # may be negative (before 1970)
    rdev: int = 0  # char/block devices (Linux dev_t as os.makedev gives)
    xattrs: tuple[tuple[bytes, bytes], ...] = ()  # full names, e.g. b"user.x"
    entries: tuple[tuple[bytes, int], ...] = ()  # directory: (name, inode index), any order
    target: bytes = b""  # symlink target
    size: int = 0  # regular file size in bytes
    chunk_bits: int = 0  # regular file: each chunk is BLOCK_SIZE << chunk_bits bytes
    chunks: tuple[int, ...] = ()  # regular file: device block of each chunk (HOLE = none)


@dataclass(slots=True)
class _Plan:
    """What one inode needs, known before any nid is: its layout, the bytes that follow the
    inode and do not depend on placement, and the room a directory's tail takes."""

    layout: int
    i_u: int  # raw block address, rdev or chunk format (a block address is set by placement)
    size: int
    icount: int  # i_xattr_icount
    body: bytes  # right after the inode: xattrs, then chunk indexes or an inline symlink
    tail: int = 0  # bytes of a directory's inline last block, written after `body`
    blocks: int = 0  # full data blocks on the image (directories and long symlinks)
    dirents: list[tuple[bytes, int]] | None = None  # sorted, with "." and ".."
    splits: list[int] | None = None  # index of the first dirent of each directory block
    nid: int = 0


def write_image(inodes: Sequence[ErofsInode], device_blocks: int, device_tag: bytes = b"") -> bytes:
    """The EROFS image of `inodes` (inodes[0] is the root directory) whose chunks address one
    extra device of `device_blocks` blocks, tagged `device_tag` (at most 64 bytes).

    A directory appears in exactly one parent's entries (its ".." is that parent; the root's
    is itself); a non-directory may appear in several (hardlinks). Deterministic. Raises
    `FormatError` naming the field for input the format cannot hold."""
    if not 0 <= device_blocks < _U32:
        raise FormatError("device_blocks", f"{device_blocks} does not fit 32 bits")
    if len(device_tag) > 64:
        raise FormatError("device_tag", f"{len(device_tag)} bytes exceeds 64")
    parents = _link(inodes)
    plans = [_plan(i, node, parents, device_blocks) for i, node in enumerate(inodes)]
    meta_bytes = _place(plans)
    meta_blocks = -(-meta_bytes // BLOCK_SIZE)
    next_block = L.EROFS_META_BLKADDR + meta_blocks
    for plan in plans:
        if plan.blocks:
            plan.i_u, next_block = next_block, next_block + plan.blocks
    if next_block >= _U32:
        raise FormatError("image", f"{next_block} blocks exceed 32-bit block addresses")
    if next_block * BLOCK_SIZE > MAX_IMAGE_SIZE:  # before allocating it
        raise FormatError("image", f"{next_block * BLOCK_SIZE} bytes exceed {MAX_IMAGE_SIZE}")
    buf = bytearray(next_block * BLOCK_SIZE)
    ftypes = [_FTYPE[stat.S_IFMT(node.mode)] for node in inodes]
    nids = [plan.nid for plan in plans]
    meta = L.EROFS_META_BLKADDR * BLOCK_SIZE
    pack_inode = L.EROFS_INODE_EXTENDED.pack_into
    for i, (node, plan) in enumerate(zip(inodes, plans, strict=True)):
        pos = meta + plan.nid * L.EROFS_ISLOT
        sec, nsec = divmod(node.mtime_ns, 1_000_000_000)
        # i_ino (only for 32-bit stat) counts inodes from 1; st_ino is the nid
        pack_inode(
            buf,
            pos,
            _VERSION | plan.layout << 1,
            plan.icount,
            node.mode,
            0,
            plan.size,
            plan.i_u,
            i + 1,
            node.uid,
            node.gid,
            sec,
            nsec,
            node.nlink,
        )
        body = plan.body
        start = pos + INODE_SIZE
        if body:
            buf[start : start + len(body)] = body
        if plan.dirents is not None:
            _put_data(buf, plan, _dir_bytes(plan, nids, ftypes), start + len(body))
        elif plan.blocks:  # a symlink too long to follow its inode
            start = plan.i_u * BLOCK_SIZE
            buf[start : start + plan.size] = node.target
    _emit_super(buf, len(inodes), next_block, device_blocks, device_tag)
    return bytes(buf)


# -- validation and the tree ----------------------------------------------------------------


def _check_names(names: list[bytes], where: int) -> None:
    """Every name of one directory, checked with whole-list operations (no per-byte loops)."""
    unique = set(names)
    lengths = list(map(len, names))
    joined = b"/".join(names)
    if (
        len(unique) != len(names)
        or min(lengths) == 0
        or max(lengths) > _MAX_NAME
        or joined.count(b"/") != len(names) - 1
        or b"\0" in joined
        or b"." in unique
        or b".." in unique
    ):
        for name in names:
            if not name or len(name) > _MAX_NAME or b"/" in name or b"\0" in name:
                raise FormatError("entry name", f"invalid name {name[:80]!r} in directory {where}")
            if name in (b".", b".."):
                raise FormatError("entry name", f"{name!r} listed in directory {where}")
        raise FormatError("entry name", f"a name occurs twice in directory {where}")


def _link(inodes: Sequence[ErofsInode]) -> list[int]:
    """Each directory's parent index (the root's is 0); checks the tree's shape."""
    count = len(inodes)
    if not count or not stat.S_ISDIR(inodes[0].mode):
        raise FormatError("inodes", "inodes[0] must be the root directory")
    is_dir = [node.mode & _S_IFMT == stat.S_IFDIR for node in inodes]
    parents = [-1] * count
    parents[0] = 0
    reached = {0}
    stack = [0]
    while stack:
        i = stack.pop()
        entries = inodes[i].entries
        if not entries:
            continue
        names = [name for name, _ in entries]
        children = [child for _, child in entries]
        _check_names(names, i)
        if min(children) < 0 or max(children) >= count:
            raise FormatError("entry inode", f"an entry of directory {i} is out of range")
        reached.update(children)
        for child in [c for c in children if is_dir[c]]:
            if parents[child] >= 0 or child == 0:
                raise FormatError("entries", f"directory {child} listed twice (or a cycle)")
            parents[child] = i
            stack.append(child)
    if len(reached) != count:
        missing = min(set(range(count)) - reached)
        kind = "directory" if is_dir[missing] else "inode"
        raise FormatError("entries", f"{kind} {missing} is not reachable from the root (a cycle?)")
    return parents


def _check_fields(i: int, node: ErofsInode) -> int:
    """The fields every inode has; return the file type bits."""
    mode = node.mode
    kind = mode & _S_IFMT
    if kind not in _FTYPE or not 0 <= mode <= 0xFFFF:
        raise FormatError("mode", f"{mode:#o} of inode {i} is not a file type EROFS holds")
    if not (0 <= node.uid < _U32 and 0 <= node.gid < _U32 and 0 < node.nlink < _U32):
        for name, value in (("uid", node.uid), ("gid", node.gid), ("nlink", node.nlink)):
            if not 0 <= value < _U32 or (name == "nlink" and not value):
                raise FormatError(name, f"{value} of inode {i} does not fit 1..2^32-1")
    if not _MIN_NS <= node.mtime_ns < _MAX_NS:
        raise FormatError("mtime_ns", f"{node.mtime_ns} of inode {i} out of range")
    if kind == stat.S_IFREG and not (node.rdev or node.entries or node.target):
        return kind
    if node.entries and kind != stat.S_IFDIR:
        raise FormatError("entries", f"inode {i} is not a directory")
    if node.rdev and kind not in _SPECIAL:
        raise FormatError("rdev", f"inode {i} is not a device")
    if node.target and kind != stat.S_IFLNK:
        raise FormatError("target", f"inode {i} is not a symlink")
    if kind != stat.S_IFREG and (node.size or node.chunks or node.chunk_bits):
        raise FormatError("size", f"inode {i} is not a regular file")
    return kind


# -- planning -------------------------------------------------------------------------------


def _xattr_key(name: bytes) -> tuple[int, bytes]:
    """(e_name_index, stored name) of a full xattr name; index 0 when EROFS cannot hold it."""
    index = _XATTR_WHOLE.get(name, 0)
    if index:
        return index, b""
    for prefix, index in _XATTR_PREFIXES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return index, name[len(prefix) :]
    return 0, b""


def _xattr_body(i: int, xattrs: tuple[tuple[bytes, bytes], ...]) -> bytes:
    """The inline xattr area: the ibody header, then one 4-aligned entry per xattr, by name."""
    if not xattrs:
        return b""
    parts = [L.EROFS_XATTR_IBODY_HEADER.pack(0, 0)]
    seen = set()
    for name, value in sorted(xattrs):
        if name in seen:
            raise FormatError("xattr name", f"{name[:80]!r} occurs twice on inode {i}")
        seen.add(name)
        index, suffix = _xattr_key(name)
        if not index:
            raise FormatError("xattr name", f"{name[:80]!r} has no EROFS name index")
        if len(name) > _MAX_NAME or b"\0" in name:
            raise FormatError("xattr name", f"{name[:80]!r} is too long or holds NUL")
        if len(value) > _MAX_XATTR_VALUE:
            raise FormatError("xattr value", f"{len(value)} bytes of {name[:80]!r} exceed 65535")
        entry = L.EROFS_XATTR_ENTRY.pack(len(suffix), index, len(value)) + suffix + value
        parts.append(entry + b"\0" * (-len(entry) % 4))
    body = b"".join(parts)
    if (len(body) - L.EROFS_XATTR_IBODY_HEADER.size) // 4 + 1 > _MAX_XATTR_ICOUNT:
        raise FormatError("xattrs", f"{len(body)} bytes of xattrs on inode {i} exceed the limit")
    return body


def _split_dirents(dirents: list[tuple[bytes, int]]) -> tuple[list[int], int]:
    """Greedy packing of sorted dirents into blocks: (first dirent of each block, dir size)."""
    splits = [0]
    used = 0
    for k, (name, _) in enumerate(dirents):
        need = DIRENT_SIZE + len(name)
        if used + need > BLOCK_SIZE:
            splits.append(k)
            used = 0
        used += need
    return splits, (len(splits) - 1) * BLOCK_SIZE + used


def _check_chunks(i: int, node: ErofsInode, device_blocks: int) -> int:
    """Validate a regular file's chunk list; return the number of chunks."""
    if not 0 <= node.chunk_bits <= _MAX_CHUNK_BITS:
        raise FormatError("chunk_bits", f"{node.chunk_bits} of inode {i} outside 0..31")
    if not 0 <= node.size < 1 << 63:
        raise FormatError("size", f"{node.size} of inode {i} out of range")
    chunk = BLOCK_SIZE << node.chunk_bits
    count = -(-node.size // chunk)
    if len(node.chunks) != count:
        raise FormatError("chunks", f"inode {i} has {len(node.chunks)} chunks, size needs {count}")
    if not count:
        return 0
    # Every chunk but the last spans `per` blocks; the last only the blocks the size reaches.
    per = chunk // BLOCK_SIZE
    last = -(-(node.size - (count - 1) * chunk) // BLOCK_SIZE)
    chunks = node.chunks
    bad = False
    if count > 1:
        body = [a for a in chunks[:-1] if a != HOLE] if HOLE in chunks else chunks[:-1]
        bad = bool(body) and (min(body) < 0 or max(body) + per > device_blocks)
    end = chunks[-1]
    if bad or (end != HOLE and (end < 0 or end + last > device_blocks)):
        raise FormatError("chunks", f"a chunk of inode {i} lies off the device")
    return count


def _plan(i: int, node: ErofsInode, parents: list[int], device_blocks: int) -> _Plan:
    kind = _check_fields(i, node)
    xattrs = _xattr_body(i, node.xattrs) if node.xattrs else b""
    icount = (len(xattrs) - L.EROFS_XATTR_IBODY_HEADER.size) // 4 + 1 if xattrs else 0
    if kind == stat.S_IFREG:
        count = _check_chunks(i, node, device_blocks)
        if not count:
            return _Plan(L.EROFS_INODE_FLAT_PLAIN, 0, 0, icount, xattrs)
        chunks = node.chunks
        pad = b"\0" * (-(INODE_SIZE + len(xattrs)) % L.EROFS_CHUNK_INDEX.size)
        if count == 1 and chunks[0] != HOLE:
            indexes = L.EROFS_CHUNK_INDEX.pack(0, L.EROFS_DATA_DEVICE_ID, chunks[0])
        else:
            indexes = _chunk_indexes(chunks)
        fmt = L.EROFS_CHUNK_FORMAT_INDEXES | node.chunk_bits
        return _Plan(L.EROFS_INODE_CHUNK_BASED, fmt, node.size, icount, xattrs + pad + indexes)
    if kind in _SPECIAL:
        return _Plan(L.EROFS_INODE_FLAT_PLAIN, _new_encode_dev(node.rdev, i), 0, icount, xattrs)
    dirents = splits = None
    if kind == stat.S_IFDIR:
        dirents = sorted([*node.entries, (b".", i), (b"..", parents[i])])
        splits, size = _split_dirents(dirents)
    else:
        size = len(node.target)
        if not 0 < size <= _MAX_SYMLINK:
            raise FormatError("target", f"symlink {i} target of {size} bytes (1..4095 allowed)")
    blocks = -(-size // BLOCK_SIZE)
    tail = size - (blocks - 1) * BLOCK_SIZE
    if INODE_SIZE + len(xattrs) + tail > BLOCK_SIZE:  # the last block cannot follow the inode
        return _Plan(L.EROFS_INODE_FLAT_PLAIN, 0, size, icount, xattrs, 0, blocks, dirents, splits)
    if dirents is None:
        return _Plan(L.EROFS_INODE_FLAT_INLINE, 0, size, icount, xattrs + node.target)
    return _Plan(
        L.EROFS_INODE_FLAT_INLINE, 0, size, icount, xattrs, tail, blocks - 1, dirents, splits
    )


def _place(plans: list[_Plan]) -> int:
    """Give each inode its nid, in list order; return the bytes of the metadata area.

    An inode starts on a 32-byte slot and never crosses a block boundary; with an inline tail,
    inode, xattrs and tail sit in one block (the kernel requires the tail not to cross)."""
    pos = 0
    inline = L.EROFS_INODE_FLAT_INLINE
    for plan in plans:
        pos += -pos % L.EROFS_ISLOT
        off = pos % BLOCK_SIZE
        length = INODE_SIZE + len(plan.body) + plan.tail
        span = length if plan.layout == inline else INODE_SIZE
        if off + span > BLOCK_SIZE:
            pos += BLOCK_SIZE - off
        plan.nid = pos // L.EROFS_ISLOT
        pos += length
    return pos


# -- emitting -------------------------------------------------------------------------------


def _new_encode_dev(rdev: int, i: int) -> int:
    """The 32-bit encoding the kernel decodes with new_decode_dev (12-bit major, 20-bit minor)."""
    if not 0 <= rdev < 1 << 64:
        raise FormatError("rdev", f"{rdev} of inode {i} out of range")
    # glibc's dev_t layout (os.major/os.minor), without importing os into the codec
    major = ((rdev >> 8) & 0xFFF) | ((rdev >> 32) & ~0xFFF)
    minor = (rdev & 0xFF) | ((rdev >> 12) & ~0xFF)
    if major > 0xFFF or minor > 0xFFFFF:
        raise FormatError("rdev", f"{major}:{minor} of inode {i} exceeds the kernel's 12:20 bits")
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


def _dir_bytes(plan: _Plan, nids: list[int], ftypes: list[int]) -> list[bytes]:
    """Each directory block's bytes (the last one unpadded: it may be the inline tail)."""
    dirents, splits = plan.dirents, plan.splits
    assert dirents is not None and splits is not None
    out = []
    pack_into = L.EROFS_DIRENT.pack_into
    bounds = [*splits, len(dirents)]
    for b in range(len(splits)):
        group = dirents[bounds[b] : bounds[b + 1]]
        block = bytearray(DIRENT_SIZE * len(group))
        nameoff = len(block)
        for k, (name, child) in enumerate(group):
            pack_into(block, k * DIRENT_SIZE, nids[child], nameoff, ftypes[child])
            nameoff += len(name)
        block += b"".join(name for name, _ in group)
        out.append(bytes(block))
    return out


def _chunk_indexes(chunks: tuple[int, ...]) -> bytes:
    """8-byte chunk indexes as pairs of u32: (startblk_hi | device_id << 16, startblk_lo)."""
    words = array("I", [L.EROFS_DATA_DEVICE_ID << 16, 0]) * len(chunks)
    words[1::2] = array("I", [L.EROFS_NULL_ADDR if a == HOLE else a for a in chunks])
    if HOLE in chunks:
        for k, addr in enumerate(chunks):
            if addr == HOLE:
                words[2 * k] = 0  # a hole names no device
    if sys.byteorder != "little":
        words.byteswap()
    return words.tobytes()


def _put_data(buf: bytearray, plan: _Plan, blocks: list[bytes], after: int) -> None:
    """Full blocks at the inode's block address; the last one inline when the plan says so."""
    inline = plan.layout == L.EROFS_INODE_FLAT_INLINE
    full = blocks[:-1] if inline else blocks
    for k, data in enumerate(full):
        start = (plan.i_u + k) * BLOCK_SIZE
        buf[start : start + len(data)] = data
    if inline:
        buf[after : after + len(blocks[-1])] = blocks[-1]


def _emit_super(
    buf: bytearray, inos: int, blocks: int, device_blocks: int, device_tag: bytes
) -> None:
    L.EROFS_DEVICE_SLOT.pack_into(buf, L.EROFS_DEVT_OFFSET, device_tag, device_blocks, 0, 0, 0)

    def pack(uuid: bytes) -> None:
        L.EROFS_SUPER_BLOCK.pack_into(
            buf,
            L.EROFS_SUPER_OFFSET,
            L.EROFS_MAGIC,
            0,  # checksum: the SB_CHKSUM feature is not set
            0,  # feature_compat
            L.EROFS_BLKSZBITS,
            0,  # sb_extslots
            0,  # root_nid: the root is the first inode of the metadata area
            inos,
            0,  # epoch (build time): fixed
            0,  # fixed_nsec
            blocks,
            L.EROFS_META_BLKADDR,
            0,  # xattr_blkaddr: no shared xattrs
            uuid,
            b"",  # volume_name
            L.EROFS_FEATURE_INCOMPAT_CHUNKED_FILE | L.EROFS_FEATURE_INCOMPAT_DEVICE_TABLE,
            0,  # available_compr_algs
            1,  # extra_devices
            L.EROFS_DEVT_OFFSET // L.EROFS_DEVICE_SLOT.size,
            0,  # dirblkbits: directory blocks are image blocks
            0,  # xattr_prefix_count
            0,  # xattr_prefix_start
            0,  # packed_nid
        )

    pack(bytes(16))
    # The uuid names the content (overlayfs tells layers apart by it): BLAKE3 of the image
    # with a zero uuid, never all zero.
    uuid = blake3.blake3(buf).digest()[:16]
    pack(uuid if any(uuid) else b"\1" + bytes(15))
