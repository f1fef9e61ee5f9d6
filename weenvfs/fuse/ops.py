"""The pyfuse3 `Operations` of a WeEnv mount. This is a protocol adapter only.

It converts arguments (inode numbers, names, flags) into calls of the core (`core.tree.Tree`
for names and attributes, `core.reader.Reader` for data) and the results into pyfuse3 types
(`EntryAttributes`, `FileInfo`, `StatvfsData`); errors leave through `@errno_boundary`
(errno_map.py), the one errno table. What the file system looks like is decided in
core/tree.py, here and nowhere else; no operation here holds state beyond that conversion.

Kernel caching: content is immutable, so entries and attributes carry very long timeouts and
files are opened with `keep_cache`: a second read of a file never reaches this process.

Every operation that would change the file system fails with EROFS. Statistics reach
`weenv stats MOUNTPOINT` as the virtual xattr `user.weenv.stats` of the root directory (JSON,
see `STATS_XATTR`): not listed by listxattr, computed on each read, so a plain
`getfattr -n user.weenv.stats MOUNTPOINT` works too and no socket has to be managed.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import pyfuse3

from weenvfs.core.reader import Reader
from weenvfs.core.tree import BLOCK_SIZE, ROOT_INODE, Attr, Tree, may_access

from . import STATS_XATTR
from .errno_map import OnceLog, errno_boundary

# Content never changes while mounted: let the kernel keep what it learns for a day.
TIMEOUT = 86400.0
NAME_MAX = 255

StatsProvider = Callable[[], dict[str, Any]]


def entry_attributes(attr: Attr) -> pyfuse3.EntryAttributes:
    """The pyfuse3 form of a core `Attr`."""
    out = pyfuse3.EntryAttributes()
    out.st_ino = attr.inode
    out.generation = 0
    out.entry_timeout = TIMEOUT
    out.attr_timeout = TIMEOUT
    out.st_mode = attr.mode
    out.st_nlink = attr.nlink
    out.st_uid = attr.uid
    out.st_gid = attr.gid
    out.st_rdev = attr.rdev
    out.st_size = attr.size
    out.st_blksize = BLOCK_SIZE
    out.st_blocks = attr.blocks
    out.st_atime_ns = attr.mtime_ns
    out.st_mtime_ns = attr.mtime_ns
    out.st_ctime_ns = attr.mtime_ns
    return out


def negative_entry() -> pyfuse3.EntryAttributes:
    """The answer to a lookup of a missing name: inode 0, cached for TIMEOUT."""
    out = pyfuse3.EntryAttributes()
    out.st_ino = 0
    out.entry_timeout = TIMEOUT
    return out


def _read_only() -> OSError:
    return OSError(errno.EROFS, "read-only file system")


class Operations(pyfuse3.Operations):
    """Serves `tree` (names, attributes) and `reader` (file data) to the kernel."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, tree: Tree, reader: Reader, stats: StatsProvider | None = None) -> None:
        super().__init__()
        self.tree = tree
        self.reader = reader
        self.stats = stats
        self.error_log = OnceLog()

    # -- names and attributes ---------------------------------------------------------------

    @errno_boundary
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """The attributes of `name` in directory `parent_inode` ('.' and '..' too); a name
        that does not exist gets a negative entry, which the kernel caches like a positive one
        (the loader and Python probe many missing paths, often the same ones again)."""
        try:
            return entry_attributes(self.tree.lookup(parent_inode, name))
        except FileNotFoundError:
            return negative_entry()

    @errno_boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """The attributes of `inode`."""
        return entry_attributes(self.tree.attr(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """Nothing to free: directories stay known for the life of the mount (core/tree.py)."""

    @errno_boundary
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        """The target of symlink `inode`."""
        return self.tree.readlink(inode)

    @errno_boundary
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        """Whether the caller may access `inode` with `mode` (modes as the kernel checks)."""
        # Only called without default_permissions; the mount sets it, the rule is the same.
        if mode & os.W_OK:
            raise _read_only()
        gids = {ctx.gid} | pyfuse3.get_sup_groups(ctx.pid)
        return may_access(self.tree.attr(inode), mode, ctx.uid, gids)

    # -- directories ------------------------------------------------------------------------

    @errno_boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        """Open directory `inode`; its number is the handle."""
        self.tree.children(inode)  # ENOTDIR/ENOENT now rather than in readdir
        return inode

    @errno_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """List directory `fh` from position `start_id`, attributes included (readdirplus)."""
        children = self.tree.children(fh)
        for position in range(start_id, len(children)):
            name, inode = children[position]
            attrs = entry_attributes(self.tree.attr(inode))
            if not pyfuse3.readdir_reply(token, name, attrs, position + 1):
                break

    async def releasedir(self, fh: int) -> None:
        """Nothing to release: a directory handle is its inode number."""

    @errno_boundary
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        """Nothing to flush on a read-only file system."""

    # -- files ------------------------------------------------------------------------------

    @errno_boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        """Open regular file `inode` for reading (EROFS for anything else), kernel cache kept."""
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise _read_only()
        self.tree.file(inode)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @errno_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes:
        """`size` bytes of file `fh` at `off` (fewer at end of file); served at once when
        its chunks are cached and verified already."""
        data = self.reader.read_cached(fh, off, size)
        return data if data is not None else await self.reader.read(fh, off, size)

    async def flush(self, fh: int) -> None:
        """Not implemented, on purpose: ENOSYS tells the kernel never to send FLUSH again
        (it comes with every close(), and a read-only file system has nothing to flush)."""
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @errno_boundary
    async def fsync(self, fh: int, datasync: bool) -> None:
        """Nothing to sync on a read-only file system."""

    async def release(self, fh: int) -> None:
        """Nothing to release: a file handle is its inode number."""

    # -- extended attributes ----------------------------------------------------------------

    @errno_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        """Xattr `name` of `inode` (ENOATTR if absent); the root adds `user.weenv.stats`."""
        if inode == ROOT_INODE and name == STATS_XATTR and self.stats is not None:
            return json.dumps(self.stats(), sort_keys=True).encode()
        return self.tree.getxattr(inode, name)

    @errno_boundary
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        """The xattr names of `inode` (the virtual stats attribute is not listed)."""
        return [name for name, _ in self.tree.xattrs(inode)]

    # -- the file system --------------------------------------------------------------------

    @errno_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """Totals of the environment: stored bytes, inode records, nothing free."""
        usage = self.tree.usage()
        out = pyfuse3.StatvfsData()
        out.f_bsize = BLOCK_SIZE
        out.f_frsize = BLOCK_SIZE
        out.f_blocks = -(-usage.data_bytes // BLOCK_SIZE)
        out.f_bfree = out.f_bavail = 0
        out.f_files = usage.inodes
        out.f_ffree = out.f_favail = 0
        out.f_namemax = NAME_MAX
        return out

    # -- everything that writes: EROFS ------------------------------------------------------

    @errno_boundary
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        raise _read_only()

    @errno_boundary
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        raise _read_only()

    @errno_boundary
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
        raise _read_only()

    @errno_boundary
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        raise _read_only()

    @errno_boundary
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        raise _read_only()

    @errno_boundary
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        raise _read_only()

    @errno_boundary
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:
        raise _read_only()

    @errno_boundary
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        raise _read_only()

    @errno_boundary
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        raise _read_only()

    @errno_boundary
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> Any:
        raise _read_only()

    @errno_boundary
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        raise _read_only()

    @errno_boundary
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        raise _read_only()
