"""The binary group index: decoded in place, looked up by binary search.

`GroupIndex` wraps the decompressed bytes without building per-entry objects: every accessor
unpacks the one record it needs with `struct.unpack_from` and validates it before use (offsets
and lengths against their tables), so loading costs O(1) Python work however many files the
group holds. `encode_index` (in `index_writer`) produces the bytes; SPEC.md is normative.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from typing import NamedTuple

from . import constants as C
from .chunk import decompress_object
from .errors import FormatError, UnsupportedFormat

ROOT_INODE = 0


class Inode(NamedTuple):
    """One inode record (field order as in SPEC.md)."""

    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    mtime_sec: int
    mtime_nsec: int
    flags: int
    rdev: int
    data_first: int
    data_count: int
    inner_offset: int
    xattr_first: int
    xattr_count: int

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_lnk(self) -> bool:
        return stat.S_ISLNK(self.mode)

    @property
    def whiteout(self) -> bool:
        return bool(self.flags & C.INODE_WHITEOUT)

    @property
    def opaque(self) -> bool:
        return bool(self.flags & C.INODE_OPAQUE)

    @property
    def implied(self) -> bool:
        return bool(self.flags & C.INODE_IMPLIED)

    @property
    def mtime_ns(self) -> int:
        return self.mtime_sec * 1_000_000_000 + self.mtime_nsec


assert Inode._fields == tuple(C.INODE_AT)  # the column readers name the same fields


class ChunkRecord(NamedTuple):
    """One chunk record: where a chunk's frame lives and what its plaintext hashes to."""

    digest: bytes
    blob: int
    flags: int
    offset: int
    clen: int
    ulen: int

    @property
    def zero(self) -> bool:
        return bool(self.flags & C.CHUNK_ZERO)


class Header(NamedTuple):
    magic: bytes
    version: int
    header_size: int
    feature_compat: int
    feature_incompat: int
    chunk_size: int
    inode_count: int
    dirent_count: int
    chunk_count: int
    xattr_count: int
    blob_count: int
    file_digest_count: int
    string_size: int
    inode_offset: int
    dirent_offset: int
    chunk_offset: int
    xattr_offset: int
    blob_offset: int
    file_digest_offset: int
    string_offset: int


# (table name, count field, offset field, record size) in the order tables MUST appear.
_TABLES = (
    ("inode", "inode_count", "inode_offset", C.INODE.size),
    ("dirent", "dirent_count", "dirent_offset", C.DIRENT.size),
    ("chunk", "chunk_count", "chunk_offset", C.CHUNK.size),
    ("xattr", "xattr_count", "xattr_offset", C.XATTR.size),
    ("blob", "blob_count", "blob_offset", C.BLOB.size),
    ("file_digest", "file_digest_count", "file_digest_offset", C.FILE_DIGEST.size),
    ("string", "string_size", "string_offset", 1),
)


def decode_header(buf: bytes | memoryview) -> Header:
    """Parse and validate the header and table layout; raise `FormatError` naming the field."""
    if len(buf) < C.INDEX_HEADER.size:
        raise FormatError("index header", f"need {C.INDEX_HEADER.size} bytes, got {len(buf)}")
    hdr = Header(*C.INDEX_HEADER.unpack_from(buf, 0))
    if hdr.magic != C.INDEX_MAGIC:
        raise FormatError("index magic", f"expected {C.INDEX_MAGIC!r}, got {hdr.magic!r}")
    if hdr.version not in C.SUPPORTED_INDEX_VERSIONS:
        raise UnsupportedFormat("index version", f"{hdr.version} is not supported")
    unknown = hdr.feature_incompat & ~C.KNOWN_INCOMPAT
    if unknown:
        raise UnsupportedFormat("index feature_incompat", f"unknown bits {unknown:#x}")
    if hdr.header_size < C.INDEX_HEADER.size or hdr.header_size % C.TABLE_ALIGN:
        raise FormatError("index header_size", f"invalid value {hdr.header_size}")
    if not C.MIN_CHUNK_SIZE <= hdr.chunk_size <= C.MAX_CHUNK_SIZE:
        raise FormatError("index chunk_size", f"{hdr.chunk_size} outside the allowed range")
    if hdr.inode_count < 1:
        raise FormatError("index inode_count", "an index holds at least the root directory")
    end = hdr.header_size
    for name, count_field, offset_field, size in _TABLES:
        count, offset = getattr(hdr, count_field), getattr(hdr, offset_field)
        if offset % C.TABLE_ALIGN:
            raise FormatError(f"index {offset_field}", f"{offset:#x} is not 8-byte aligned")
        if offset < end:
            raise FormatError(f"index {offset_field}", f"{offset:#x} overlaps the previous table")
        end = offset + count * size
        if end > len(buf):
            raise FormatError(
                f"index {name} table", f"ends at {end:#x}, past the index size {len(buf):#x}"
            )
    return hdr


class GroupIndex:
    """A decoded group index, used in place.

    Inode numbers are positions in the inode table; 0 is the root directory. Every accessor
    raises `FormatError` for records that point outside their tables.
    """

    def __init__(self, buf: bytes) -> None:
        self._buf = buf
        self._mv = memoryview(buf)
        self.header = decode_header(buf)
        h = self.header
        self.chunk_size = h.chunk_size
        self.inode_count = h.inode_count
        self._str_start = h.string_offset
        self._str_end = h.string_offset + h.string_size
        if not self.inode(ROOT_INODE).is_dir:
            raise FormatError("index root inode", "is not a directory")

    @classmethod
    def from_object(cls, data: bytes | memoryview) -> GroupIndex:
        """Decode a stored index object (zstd-compressed)."""
        return cls(decompress_object(data, "index", C.MAX_INDEX_SIZE))

    @property
    def raw(self) -> bytes:
        """The decompressed bytes."""
        return self._buf

    # -- records ----------------------------------------------------------------------------

    def inode(self, ino: int) -> Inode:
        """The inode record `ino`, validated."""
        h = self.header
        if not 0 <= ino < h.inode_count:
            raise FormatError("inode number", f"{ino} not below inode_count {h.inode_count}")
        rec = Inode(*C.INODE.unpack_from(self._mv, h.inode_offset + ino * C.INODE.size))
        if rec.flags & ~C.KNOWN_INODE_FLAGS:
            raise FormatError(f"inode {ino} flags", f"unknown bits {rec.flags:#x}")
        if rec.mtime_nsec >= 1_000_000_000:
            raise FormatError(f"inode {ino} mtime_nsec", f"{rec.mtime_nsec} is not below 10**9")
        kind = stat.S_IFMT(rec.mode)
        dir_only = rec.opaque or rec.implied
        if (rec.whiteout and kind != stat.S_IFCHR) or (dir_only and kind != stat.S_IFDIR):
            raise FormatError(f"inode {ino} flags", f"{rec.flags:#x} do not fit mode {rec.mode:#o}")
        if kind == stat.S_IFDIR:
            limit, table = h.dirent_count, "dirent"
        elif kind == stat.S_IFREG:
            limit, table = h.chunk_count, "chunk"
        elif kind == stat.S_IFLNK:
            limit, table = None, "string"
        elif kind in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK):
            limit, table = 0, "none"
        else:
            raise FormatError(f"inode {ino} mode", f"unknown file type {rec.mode:#o}")
        if limit is None:
            if rec.data_count > C.MAX_SYMLINK:
                raise FormatError(f"inode {ino} symlink target", f"longer than {C.MAX_SYMLINK}")
            self._check_string(rec.data_first, rec.data_count, f"inode {ino} symlink target")
        elif rec.data_first + rec.data_count > limit and rec.data_count:
            raise FormatError(
                f"inode {ino} data",
                f"{table} range {rec.data_first}+{rec.data_count} exceeds {limit}",
            )
        if rec.xattr_count and rec.xattr_first + rec.xattr_count > h.xattr_count:
            raise FormatError(f"inode {ino} xattrs", "range exceeds the xattr table")
        return rec

    def chunk(self, n: int) -> ChunkRecord:
        """Chunk record `n`, validated."""
        h = self.header
        if not 0 <= n < h.chunk_count:
            raise FormatError("chunk number", f"{n} not below chunk_count {h.chunk_count}")
        rec = ChunkRecord(*C.CHUNK.unpack_from(self._mv, h.chunk_offset + n * C.CHUNK.size))
        if rec.flags & ~C.KNOWN_CHUNK_FLAGS:
            raise FormatError(f"chunk {n} flags", f"unknown bits {rec.flags:#x}")
        if rec.zero:
            if rec.blob != C.NO_BLOB or rec.offset or rec.clen:
                raise FormatError(f"chunk {n}", "a zero chunk must not reference a blob")
            if not h.feature_incompat & C.INCOMPAT_ZERO_CHUNKS:
                raise FormatError(f"chunk {n} flags", "zero chunk without INCOMPAT_ZERO_CHUNKS")
        elif rec.blob >= h.blob_count:
            raise FormatError(f"chunk {n} blob", f"{rec.blob} not below blob_count {h.blob_count}")
        elif rec.offset + rec.clen > C.MAX_BLOB_OFFSET:
            # Checked once here so no reader (pread, range requests, int64 offsets) ever sees
            # a frame that ends past 2**63; whether it lies inside its blob is checked where
            # the blob's size is known (a ranged read past the end fails; verify compares).
            raise FormatError(
                f"chunk {n} frame", f"{rec.offset}+{rec.clen} outside 0..2**63"
            )
        if rec.ulen > C.MAX_CHUNK_SIZE:
            raise FormatError(f"chunk {n} length", f"{rec.ulen} exceeds {C.MAX_CHUNK_SIZE}")
        if rec.clen > C.max_frame_size(rec.ulen):
            # Every reader fetches `clen` bytes before it can look at the frame: bound it by
            # the plaintext it must hold, so a record cannot make one read allocate gigabytes.
            raise FormatError(
                f"chunk {n} clen",
                f"{rec.clen} exceeds {C.max_frame_size(rec.ulen)}, the most a frame of "
                f"{rec.ulen} bytes may take",
            )
        return rec

    def raw_chunks(self) -> Iterator[tuple[bytes, int, int, int, int, int]]:
        """Every chunk record as unpacked fields (digest, blob, flags, offset, clen, ulen), in
        one C-level pass and NOT validated: for scans that only select records (a reader
        validates each one it uses through `chunk`). FormatError if the table is short."""
        return C.CHUNK.iter_unpack(self.chunk_table())

    def inode_table(self) -> memoryview:
        """The inode records as stored (SPEC.md 6.4), NOT validated: for column scans and
        readers that take fields in place. FormatError if the table is short."""
        h = self.header
        return self._table("inode", h.inode_offset, h.inode_count, C.INODE.size)

    def dirent_table(self) -> memoryview:
        """The directory entries as stored (SPEC.md 6.5), NOT validated (see `inode_table`)."""
        h = self.header
        return self._table("dirent", h.dirent_offset, h.dirent_count, C.DIRENT.size)

    def chunk_table(self) -> memoryview:
        """The chunk records as stored (SPEC.md 6.6), NOT validated (see `inode_table`)."""
        h = self.header
        return self._table("chunk", h.chunk_offset, h.chunk_count, C.CHUNK.size)

    def _table(self, what: str, offset: int, count: int, size: int) -> memoryview:
        table = memoryview(self._buf)[offset:offset + count * size]
        if len(table) != count * size:
            raise FormatError(f"{what} table", f"shorter than {what}_count")
        return table

    def blob_digest(self, n: int) -> str:
        """Hex digest of blob `n` of the blob table."""
        h = self.header
        if not 0 <= n < h.blob_count:
            raise FormatError("blob number", f"{n} not below blob_count {h.blob_count}")
        return bytes(self._mv[h.blob_offset + n * 32 : h.blob_offset + n * 32 + 32]).hex()

    def blob_digests(self) -> list[str]:
        """Every blob digest this index refers to, in table order."""
        return [self.blob_digest(n) for n in range(self.header.blob_count)]

    def _check_string(self, offset: int, length: int, what: str) -> None:
        if offset + length > self.header.string_size:
            raise FormatError(what, f"string {offset}+{length} exceeds the string table")

    def _string(self, offset: int, length: int, what: str) -> bytes:
        self._check_string(offset, length, what)
        start = self._str_start + offset
        return bytes(self._mv[start : start + length])

    def _dirent(self, n: int) -> tuple[int, int, int]:
        return C.DIRENT.unpack_from(self._mv, self.header.dirent_offset + n * C.DIRENT.size)

    def _dirent_name(self, n: int) -> tuple[bytes, int]:
        off, length, ino = self._dirent(n)
        if not 0 < length <= C.MAX_NAME:
            raise FormatError(f"dirent {n} name_length", f"{length} outside 1..{C.MAX_NAME}")
        if ino >= self.header.inode_count or ino == ROOT_INODE:
            raise FormatError(f"dirent {n} inode", f"{ino} is not a valid child inode")
        name = self._string(off, length, f"dirent {n} name")
        if b"/" in name or b"\0" in name or name in (b".", b".."):
            raise FormatError(f"dirent {n} name", f"{name!r:.80} is not a valid name")
        return name, ino

    # -- directory operations ---------------------------------------------------------------

    def _dir_range(self, ino: int) -> tuple[int, int]:
        rec = self.inode(ino)
        if not rec.is_dir:
            raise FormatError(f"inode {ino}", "is not a directory")
        return rec.data_first, rec.data_first + rec.data_count

    def lookup(self, dir_ino: int, name: bytes) -> int | None:
        """The inode of `name` in directory `dir_ino` (binary search), or None."""
        lo, hi = self._dir_range(dir_ino)
        while lo < hi:
            mid = (lo + hi) // 2
            mid_name, ino = self._dirent_name(mid)
            if mid_name < name:
                lo = mid + 1
            elif mid_name > name:
                hi = mid
            else:
                return ino
        return None

    def entries(self, dir_ino: int, start: int = 0) -> Iterator[tuple[bytes, int]]:
        """(name, inode) of directory `dir_ino` in name order, from position `start`."""
        first, end = self._dir_range(dir_ino)
        previous = self._dirent_name(first + start - 1)[0] if 0 < start <= end - first else None
        for n in range(first + start, end):
            name, ino = self._dirent_name(n)
            # Lookup is a binary search: entries out of order would make names unfindable.
            if previous is not None and name <= previous:
                raise FormatError(f"dirent {n} name", "entries not sorted by strictly rising name")
            previous = name
            yield name, ino

    def entry_count(self, dir_ino: int) -> int:
        """The number of entries of directory `dir_ino`."""
        first, end = self._dir_range(dir_ino)
        return end - first

    def resolve(self, path: bytes) -> int | None:
        """The inode at relative `path` (b'a/b'; no symlinks followed), or None."""
        ino = ROOT_INODE
        for part in path.split(b"/"):
            if part in (b"", b"."):
                continue
            if not self.inode(ino).is_dir:
                return None
            found = self.lookup(ino, part)
            if found is None:
                return None
            ino = found
        return ino

    def walk(self, ino: int = ROOT_INODE, prefix: bytes = b"") -> Iterator[tuple[bytes, int]]:
        """Every (path, inode) below `ino` in depth-first name order (root as b'')."""
        stack = [(prefix, ino)]
        seen_dirs: set[int] = set()
        while stack:
            path, cur = stack.pop()
            yield path, cur
            if self.inode(cur).is_dir:
                # A directory reached twice means a cycle or a shared subtree: refuse, or a
                # corrupt index could make this walk endless or exponential.
                if cur in seen_dirs:
                    raise FormatError(f"inode {cur}", "directory reachable by more than one path")
                seen_dirs.add(cur)
                children = [
                    (path + b"/" + name if path else name, child)
                    for name, child in self.entries(cur)
                ]
                stack.extend(reversed(children))

    # -- file data and metadata -------------------------------------------------------------

    def readlink(self, ino: int) -> bytes:
        """The target of symlink `ino`."""
        rec = self.inode(ino)
        if not rec.is_lnk:
            raise FormatError(f"inode {ino}", "is not a symlink")
        return self._string(rec.data_first, rec.data_count, f"inode {ino} symlink target")

    def xattrs(self, ino: int) -> list[tuple[bytes, bytes]]:
        """The extended attributes of `ino` as (key, value), sorted by key."""
        rec = self.inode(ino)
        if not rec.xattr_count:
            return []
        if rec.xattr_count > C.MAX_INODE_XATTRS:  # every key has a byte at least
            raise FormatError(f"inode {ino} xattrs", f"{rec.xattr_count} records")
        start = self.header.xattr_offset + rec.xattr_first * C.XATTR.size
        table = self._mv[start : start + rec.xattr_count * C.XATTR.size]
        # Lengths first, then strings: records may share strings, so refuse before copying.
        records = list(C.XATTR.iter_unpack(table))
        total = 0
        for n, (_, klen, _, vlen) in enumerate(records, rec.xattr_first):
            if not 0 < klen <= C.MAX_XATTR_KEY or vlen > C.MAX_XATTR_VALUE:
                raise FormatError(f"xattr {n}", f"key length {klen} or value length {vlen}")
            total += klen + vlen
        if total > C.MAX_INODE_XATTRS:
            raise FormatError(f"inode {ino} xattrs", f"{total} bytes exceed {C.MAX_INODE_XATTRS}")
        return [
            (self._string(koff, klen, "xattr key"), self._string(voff, vlen, "xattr"))
            for koff, klen, voff, vlen in records
        ]

    def file_chunks(self, ino: int) -> range:
        """The chunk numbers holding regular file `ino`'s data, in file order.

        A batched file has one chunk and starts at `inode.inner_offset` in it; any other file
        has chunk k covering bytes [k * chunk_size, (k + 1) * chunk_size).
        """
        rec = self.inode(ino)
        if not rec.is_reg:
            raise FormatError(f"inode {ino}", "is not a regular file")
        count = rec.data_count
        if count == 0:
            if rec.size:
                raise FormatError(f"inode {ino} chunks", f"none for a file of {rec.size} bytes")
        elif count == 1:
            if rec.inner_offset + rec.size > self.chunk(rec.data_first).ulen:
                raise FormatError(f"inode {ino} inner_offset", "file extends past its chunk")
        elif rec.inner_offset or count != -(-rec.size // self.chunk_size):
            raise FormatError(
                f"inode {ino} chunks", f"{count} chunks do not fit a size of {rec.size} bytes"
            )
        return range(rec.data_first, rec.data_first + count)

    def file_digests(self) -> Iterator[tuple[int, bytes]]:
        """(inode, whole-file digest) of the table used to dedup small files."""
        h = self.header
        for n in range(h.file_digest_count):
            ino, dig = C.FILE_DIGEST.unpack_from(self._mv, h.file_digest_offset + n * 36)
            if ino >= h.inode_count:
                raise FormatError(f"file digest {n} inode", f"{ino} not below {h.inode_count}")
            yield ino, dig


class Span(NamedTuple):
    """A piece of a file read: bytes [start, end) of chunk number `chunk`'s plaintext."""

    chunk: int
    start: int
    end: int


def file_spans(index: GroupIndex, ino: int, offset: int, length: int) -> list[Span]:
    """The chunk pieces that hold bytes [offset, offset + length) of regular file `ino`.

    Clipped at end of file; an empty list past it. Offset to chunk is a division because every
    chunk of a multi-chunk file but the last holds exactly `chunk_size` bytes.
    """
    rec = index.inode(ino)
    chunks = index.file_chunks(ino)
    end = min(offset + length, rec.size)
    if offset < 0 or length < 0:
        raise ValueError("negative offset or length")
    spans = []
    pos = offset
    size = index.chunk_size
    while pos < end:
        if len(chunks) == 1:
            k, in_chunk = 0, rec.inner_offset + pos
            stop = rec.inner_offset + end
        else:
            k, in_chunk = divmod(pos, size)
            stop = min(size, in_chunk + end - pos)
            # All chunks but the last hold exactly chunk_size bytes, the last the remainder.
            expected = min(size, rec.size - k * size)
            if index.chunk(chunks[k]).ulen != expected:
                raise FormatError(f"inode {ino} chunk {k}", f"length is not {expected}")
        spans.append(Span(chunks[k], in_chunk, stop))
        pos += stop - in_chunk
    return spans
