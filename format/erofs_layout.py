"""On-disk structures of the derived EROFS metadata image (SPEC.md section 15).

The subset of Linux `fs/erofs/erofs_fs.h` that `erofs.py` emits, mirrored as `struct.Struct`s
with their sizes asserted at import (as erofs_fs.h does with BUILD_BUG_ON). Field names follow
erofs_fs.h; SPEC.md section 15 has the tables and tests/format/test_spec_tables.py checks them
against these structs. Must not: hold any logic; the writer is `erofs.py`.
"""

from __future__ import annotations

import struct

EROFS_MAGIC = 0xE0F5E1E2
EROFS_SUPER_OFFSET = 1024  # byte offset of the superblock in the image
EROFS_BLKSZBITS = 12  # the image's block size is 1 << 12 = 4096
EROFS_ISLOT = 32  # a nid counts 32-byte slots from the start of the metadata area
EROFS_META_BLKADDR = 1  # block 0 holds the superblock and the device table; metadata follows
EROFS_DEVT_OFFSET = 1152  # the device table follows the 128-byte superblock (devt_slotoff 9)

EROFS_FEATURE_INCOMPAT_CHUNKED_FILE = 0x4
EROFS_FEATURE_INCOMPAT_DEVICE_TABLE = 0x8

# i_format: bit 0 is the inode version (1 = extended), bits 1-3 the data layout
EROFS_INODE_EXTENDED_VERSION = 1
EROFS_INODE_FLAT_PLAIN = 0
EROFS_INODE_FLAT_INLINE = 2
EROFS_INODE_CHUNK_BASED = 4
EROFS_CHUNK_FORMAT_INDEXES = 0x20  # i_u.c.format: 8-byte chunk indexes (with device ids)
EROFS_CHUNK_FORMAT_BLKBITS_MASK = 0x1F  # i_u.c.format: chunk size = block size << these bits
EROFS_NULL_ADDR = 0xFFFFFFFF  # a chunk index's startblk_lo for a hole
EROFS_DATA_DEVICE_ID = 1  # the chunk indexes' device_id of the one extra (data) device

# e_name_index of an xattr entry: the prefix the stored name follows
EROFS_XATTR_INDEX_USER = 1
EROFS_XATTR_INDEX_POSIX_ACL_ACCESS = 2
EROFS_XATTR_INDEX_POSIX_ACL_DEFAULT = 3
EROFS_XATTR_INDEX_TRUSTED = 4
EROFS_XATTR_INDEX_SECURITY = 6

# erofs_dirent.file_type (the kernel's generic FT_* values)
EROFS_FT_REG_FILE = 1
EROFS_FT_DIR = 2
EROFS_FT_CHRDEV = 3
EROFS_FT_BLKDEV = 4
EROFS_FT_FIFO = 5
EROFS_FT_SOCK = 6
EROFS_FT_SYMLINK = 7

# magic, checksum, feature_compat, blkszbits, sb_extslots, root_nid, inos, epoch, fixed_nsec,
# blocks, meta_blkaddr, xattr_blkaddr, uuid, volume_name, feature_incompat,
# available_compr_algs, extra_devices, devt_slotoff, dirblkbits, xattr_prefix_count,
# xattr_prefix_start, packed_nid, reserved
EROFS_SUPER_BLOCK = struct.Struct("<IIIBBHQQIIII16s16sIHHHBBIQ24x")
assert EROFS_SUPER_BLOCK.size == 128

# tag, blocks, mapped_blkaddr, blocks_hi, mapped_blkaddr_hi, reserved
EROFS_DEVICE_SLOT = struct.Struct("<64sIIIH50x")
assert EROFS_DEVICE_SLOT.size == 128

# i_format, i_xattr_icount, i_mode, i_nb, i_size, i_u, i_ino, i_uid, i_gid, i_mtime,
# i_mtime_nsec, i_nlink, reserved
EROFS_INODE_EXTENDED = struct.Struct("<HHHHQIIIIqII16x")
assert EROFS_INODE_EXTENDED.size == 64

# h_name_filter, h_shared_count, reserved
EROFS_XATTR_IBODY_HEADER = struct.Struct("<IB7x")
assert EROFS_XATTR_IBODY_HEADER.size == 12

# e_name_len, e_name_index, e_value_size (then the name suffix and the value, padded to 4)
EROFS_XATTR_ENTRY = struct.Struct("<BBH")
assert EROFS_XATTR_ENTRY.size == 4

# startblk_hi, device_id, startblk_lo
EROFS_CHUNK_INDEX = struct.Struct("<HHI")
assert EROFS_CHUNK_INDEX.size == 8

# nid, nameoff, file_type, reserved
EROFS_DIRENT = struct.Struct("<QHBx")
assert EROFS_DIRENT.size == 12
