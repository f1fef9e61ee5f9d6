"""Byte tables of the format, mirrored from SPEC.md as `struct.Struct`s.

Sizes are asserted at import so that a change here that is not a deliberate format change fails
at once (erofs `BUILD_BUG_ON`). All integers are little-endian.
"""

from __future__ import annotations

import re
import struct


def field_offsets(record: struct.Struct, names: str) -> dict[str, int]:
    """The byte offset of each field of `record`, named in order by `names` (padding `x` has
    no name): column readers (columns.py) take them from here, not from formats of their own."""
    offsets, at = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z?])", record.format.lstrip("<")):
        n = int(count or 1)
        if code == "s":  # one field of n bytes
            offsets.append(at)
            at += n
        elif code == "x":
            at += n
        else:
            width = struct.calcsize("<" + code)
            offsets.extend(range(at, at + n * width, width))
            at += n * width
    if at != record.size:
        raise ValueError(f"cannot read the fields of {record.format}")
    return dict(zip(names.split(), offsets, strict=True))  # a name missing or extra: raises


# -- group index ----------------------------------------------------------------------------

INDEX_MAGIC = b"WEENVIDX"
INDEX_VERSION = 1
SUPPORTED_INDEX_VERSIONS = frozenset({1})

# Feature bits. Readers MUST refuse unknown incompat bits and MUST ignore unknown compat bits.
INCOMPAT_ZERO_CHUNKS = 1 << 0  # chunk records with CHUNK_ZERO (holes) may occur
KNOWN_INCOMPAT = INCOMPAT_ZERO_CHUNKS
COMPAT_FILE_DIGESTS = 1 << 0  # the file-digest table is present (dedup of small files)

# magic, version, header_size, feature_compat, feature_incompat, chunk_size,
# inode/dirent/chunk/xattr/blob/file-digest counts, string table size,
# inode/dirent/chunk/xattr/blob/file-digest/string table offsets, reserved
INDEX_HEADER = struct.Struct("<8sHHIII6IQ7Q16x")
assert INDEX_HEADER.size == 128

# (4 bytes of padding keep every table 8-byte aligned)
INODE = struct.Struct("<IIIIQqIIQIIIII4x")
assert INODE.size == 72
INODE_AT = field_offsets(INODE, "mode uid gid nlink size mtime_sec mtime_nsec flags rdev "
                                "data_first data_count inner_offset xattr_first xattr_count")

INODE_WHITEOUT = 1 << 0  # the entry hides the same name in lower groups
INODE_OPAQUE = 1 << 1  # directory: hides everything below it in lower groups
# directory no source entry declared (a layer tar that omits a parent): it takes its attributes
# from the same directory in a lower group, as applying the layer to that group would leave them
INODE_IMPLIED = 1 << 2
KNOWN_INODE_FLAGS = INODE_WHITEOUT | INODE_OPAQUE | INODE_IMPLIED

DIRENT = struct.Struct("<IHxxI")
assert DIRENT.size == 12
DIRENT_AT = field_offsets(DIRENT, "name_offset name_length inode")

# digest, blob, flags, compressed offset, compressed length, uncompressed length
CHUNK = struct.Struct("<32sIIQII")
assert CHUNK.size == 56
CHUNK_ZERO = 1 << 0  # all-zero plaintext, stored nowhere (a hole); blob MUST be NO_BLOB
KNOWN_CHUNK_FLAGS = CHUNK_ZERO
NO_BLOB = 0xFFFFFFFF

# key_offset, key_length, value_offset, value_length
XATTR = struct.Struct("<IIII")
assert XATTR.size == 16

BLOB = struct.Struct("<32s")
assert BLOB.size == 32

# inode, digest of the whole file's plaintext
FILE_DIGEST = struct.Struct("<I32s")
assert FILE_DIGEST.size == 36

TABLE_ALIGN = 8

# -- limits ---------------------------------------------------------------------------------

MAX_NAME = 255
MAX_SYMLINK = 4095
MAX_XATTR_KEY = 255
MAX_XATTR_VALUE = 65536
# Key and value bytes of all of one inode's xattrs: about what one EROFS inode can hold (its
# i_xattr_icount reaches some 256 KiB). Records may share strings, so without this a small
# index could make every getxattr or image of an inode materialize gigabytes.
MAX_INODE_XATTRS = 256 << 10
MAX_CHUNK_SIZE = 64 << 20  # largest chunk_size and chunk ulen (64x the default chunk size)
MAX_BLOB_OFFSET = 1 << 63  # a chunk frame ends at or below this byte of its blob
MIN_CHUNK_SIZE = 4 << 10
DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_BATCH_THRESHOLD = 64 << 10  # files smaller than this are batched
MAX_U32 = 0xFFFFFFFF

# -- prefetch hints -------------------------------------------------------------------------

HINT_MAGIC = b"WEENVHNT"
HINT_VERSION = 1  # a hint of chunk records only
HINT_FILES_VERSION = 2  # a hint with a file table after its chunk records (SPEC.md 9.1)
HINT_PACK_VERSION = 3  # version 2 plus a pack table: the hinted chunks in one blob, in order
SUPPORTED_HINT_VERSIONS = frozenset({1, 2, 3})
# magic, version, reserved, manifest digest, record count
HINT_HEADER = struct.Struct("<8sHH32sI")
assert HINT_HEADER.size == 48
# group position, reserved, chunk number, first access in milliseconds since mount
HINT_RECORD = struct.Struct("<HHII")
assert HINT_RECORD.size == 12
MAX_HINT_RECORDS = 1 << 22
# version 2: file count, reserved; then file records: group position, reserved, inode number
# in that group's index, first read in milliseconds since mount (HINT_RECORD's layout)
HINT_FILES_HEAD = struct.Struct("<II")
assert HINT_FILES_HEAD.size == 8
HINT_FILE = HINT_RECORD
MAX_HINT_FILES = 1 << 20
# version 3, after the file table: pack blob digest, pack size, entry count (= record count),
# reserved; then one frame length per record (0: that record's chunk is not in the pack)
HINT_PACK_HEAD = struct.Struct("<32sQII")
assert HINT_PACK_HEAD.size == 48
HINT_PACK_ENTRY = struct.Struct("<I")

# -- manifests ------------------------------------------------------------------------------

MANIFEST_SCHEMA = 1
MANIFEST_SCHEMA_EROFS = 2  # schema 1 plus groups[].erofs (SPEC.md 8.1, 15.9)
MANIFEST_MEDIA_TYPE = "application/vnd.weenv.manifest.v1+json"
MAX_GROUPS = 128

# -- canonical JSON (SPEC.md 8.2) --------------------------------------------------------

# The integers an IEEE-754 double holds exactly (JavaScript's Number.MAX_SAFE_INTEGER), so
# every JSON reader reads them exactly; canonical JSON has no other numbers.
MAX_SAFE_INTEGER = (1 << 53) - 1
MAX_JSON_DEPTH = 16  # arrays and objects nest at most this deep; the outermost is level 1

# -- object size limits (SPEC.md 12.1) ------------------------------------------------------
# Every reader bounds an object by its kind BEFORE it reads it whole or decompresses it, so a
# hostile store cannot make a node allocate more than these; writers never exceed them.

TAG_SIZE = 65  # a tag is exactly "<64 hex digits>\n" (SPEC.md 10): nothing longer is read
MAX_MANIFEST_SIZE = 4 << 20  # 128 groups and a runtime config fit in well under 100 KiB
# Raw (decompressed) bytes of one index: about 130 bytes per entry (measured: 46,733 entries,
# 6.0 MB), so some 2 million files; a mount holds its indexes in memory.
MAX_INDEX_SIZE = 256 << 20
# A full hint: header, MAX_HINT_RECORDS records, the file table head, MAX_HINT_FILES files,
# the pack head and one pack entry per record.
MAX_HINT_SIZE = 48 + 12 * MAX_HINT_RECORDS + 8 + 12 * MAX_HINT_FILES + 48 + 4 * MAX_HINT_RECORDS
assert (HINT_HEADER.size + MAX_HINT_RECORDS * HINT_RECORD.size + HINT_FILES_HEAD.size
        + MAX_HINT_FILES * HINT_FILE.size + HINT_PACK_HEAD.size
        + MAX_HINT_RECORDS * HINT_PACK_ENTRY.size == MAX_HINT_SIZE)
# Raw bytes of an EROFS image (published, or derived by a node from an index): about the size
# of its index for real trees (the one above: 6.0 MB), so twice MAX_INDEX_SIZE.
MAX_IMAGE_SIZE = 2 * MAX_INDEX_SIZE
# A zstd frame of n content bytes is at most n + n/128 + FRAME_SLACK bytes: twice zstd's own
# worst case (ZSTD_compressBound: n + n/256 + 64) and far above raw blocks (3 bytes per
# 128 KiB, a header of at most 18 and a checksum of 4).
FRAME_SLACK = 1024


def max_frame_size(content: int) -> int:
    """The largest stored zstd frame of `content` bytes that a reader accepts: a chunk
    record's `clen` for its `ulen`, a compressed object for its kind's raw limit."""
    return content + (content >> 7) + FRAME_SLACK


# The most bytes a reader reads of a whole stored object, by store kind (blobs are only ever
# read by ranges: one frame, at most max_frame_size(MAX_CHUNK_SIZE), or a coalesced request).
MAX_STORED_INDEX_SIZE = max_frame_size(MAX_INDEX_SIZE)
MAX_STORED_HINT_SIZE = max_frame_size(MAX_HINT_SIZE)
MAX_STORED_IMAGE_SIZE = max_frame_size(MAX_IMAGE_SIZE)
