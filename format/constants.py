"""Byte tables of the format, mirrored from SPEC.md as `struct.Struct`s.

Sizes are asserted at import so that a change here that is not a deliberate format change fails
at once (erofs `BUILD_BUG_ON`). All integers are little-endian.
"""

from __future__ import annotations

import struct

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

# mode, uid, gid, nlink, size, mtime_sec, mtime_nsec, flags, rdev,
# data_first, data_count, inner_offset, xattr_first, xattr_count
# (4 bytes of padding keep every table 8-byte aligned)
INODE = struct.Struct("<IIIIQqIIQIIIII4x")
assert INODE.size == 72

INODE_WHITEOUT = 1 << 0  # the entry hides the same name in lower groups
INODE_OPAQUE = 1 << 1  # directory: hides everything below it in lower groups
# directory no source entry declared (a layer tar that omits a parent): it takes its attributes
# from the same directory in a lower group, as applying the layer to that group would leave them
INODE_IMPLIED = 1 << 2
KNOWN_INODE_FLAGS = INODE_WHITEOUT | INODE_OPAQUE | INODE_IMPLIED

# name_offset, name_length, inode
DIRENT = struct.Struct("<IHxxI")
assert DIRENT.size == 12

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
MAX_INDEX_SIZE = 1 << 32  # uncompressed index bytes
MAX_CHUNK_SIZE = 64 << 20
MAX_BLOB_OFFSET = 1 << 63  # a chunk frame ends at or below this byte of its blob
MIN_CHUNK_SIZE = 4 << 10
DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_BATCH_THRESHOLD = 64 << 10  # files smaller than this are batched
MAX_U32 = 0xFFFFFFFF

# -- prefetch hints -------------------------------------------------------------------------

HINT_MAGIC = b"WEENVHNT"
HINT_VERSION = 1
SUPPORTED_HINT_VERSIONS = frozenset({1})
# magic, version, reserved, manifest digest, record count
HINT_HEADER = struct.Struct("<8sHH32sI")
assert HINT_HEADER.size == 48
# group position, reserved, chunk number, first access in milliseconds since mount
HINT_RECORD = struct.Struct("<HHII")
assert HINT_RECORD.size == 12
MAX_HINT_RECORDS = 1 << 22

# -- manifests ------------------------------------------------------------------------------

MANIFEST_SCHEMA = 1
MANIFEST_SCHEMA_EROFS = 2  # schema 1 plus groups[].erofs (SPEC.md 8.1, 15.9)
MANIFEST_MEDIA_TYPE = "application/vnd.weenv.manifest.v1+json"
MAX_MANIFEST_SIZE = 4 << 20
MAX_IMAGE_SIZE = 1 << 31  # uncompressed bytes of a published EROFS image (SPEC.md 15.9)
MAX_GROUPS = 128
