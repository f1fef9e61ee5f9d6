"""The pyfuse3 `Operations` of a kernel-path mount: a folder of virtual data devices.

This is a protocol adapter only, the second one next to ops.py. On the kernel path the
kernel answers every lookup, open, readlink and readdir from a group's EROFS metadata image
(core/kernel_image.py); this process serves just the image's data device, one read-only file
per group (`core.device_reader.DeviceReader`), which the EROFS mount opens by path
(`-o device=`). Files are opened with `direct_io`: the EROFS page cache is the only cache of
the data, never a second copy in this mount's own page cache. Errors leave through
`@errno_boundary`, the one errno table, as on the tree mount; a read that cannot be served
correctly is EIO for the kernel, which EROFS passes on to the reader.

`weenv stats` reads the virtual xattr `user.weenv.stats` of this folder's root. When the
last open handle of a device is released (the kernel dropped the EROFS superblock that held
it: unmounted, lazily or not), `on_released` is called; the mount lifecycle decides whether
that ends the daemon. `PyfuseDevices` mounts and runs them with pyfuse3: the fallback of
native_devices.py (the same folder answered by a C server), behind the same interface.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyfuse3

from weenvfs.core.device_reader import DeviceReader

from . import STATS_XATTR
from .errno_map import OnceLog, errno_boundary
from .ops import TIMEOUT, StatsProvider, negative_entry

ROOT = pyfuse3.ROOT_INODE
DEVICE_MODE = stat.S_IFREG | 0o400
FOLDER_MODE = stat.S_IFDIR | 0o500


class DeviceOperations(pyfuse3.Operations):
    """Serves `devices` (file name -> device) as read-only files of one folder."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, devices: Mapping[bytes, DeviceReader],
                 stats: StatsProvider | None = None,
                 on_released: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.names = sorted(devices)
        self.devices = [devices[name] for name in self.names]  # inode ROOT + 1 + k
        self.stats = stats
        self.on_released = on_released
        self.open_handles = 0
        self.error_log = OnceLog()
        self._uid, self._gid = os.getuid(), os.getgid()

    def _attributes(self, inode: int) -> pyfuse3.EntryAttributes:
        out = pyfuse3.EntryAttributes()
        out.st_ino = inode
        out.entry_timeout = out.attr_timeout = TIMEOUT
        out.st_uid, out.st_gid = self._uid, self._gid
        if inode == ROOT:
            out.st_mode, out.st_nlink = FOLDER_MODE, 2
            return out
        device = self._device(inode)
        out.st_mode, out.st_nlink = DEVICE_MODE, 1
        out.st_size = device.size
        out.st_blocks = -(-device.size // 512)
        out.st_blksize = 1 << 20
        return out

    def _device(self, inode: int) -> DeviceReader:
        k = inode - ROOT - 1
        if not 0 <= k < len(self.devices):
            raise OSError(errno.ENOENT, f"no inode {inode}")
        return self.devices[k]

    @errno_boundary
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """A device by name (negative entries are cached like the tree mount's)."""
        if parent_inode != ROOT:
            raise OSError(errno.ENOTDIR, "devices live in the root folder")
        if name in (b".", b".."):
            return self._attributes(ROOT)
        try:
            return self._attributes(ROOT + 1 + self.names.index(name))
        except ValueError:
            return negative_entry()

    @errno_boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """The folder or a device."""
        return self._attributes(inode)

    @errno_boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        """Only the root is a folder."""
        if inode != ROOT:
            raise OSError(errno.ENOTDIR, f"inode {inode} is not a directory")
        return inode

    @errno_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """The device names."""
        for k in range(start_id, len(self.names)):
            if not pyfuse3.readdir_reply(token, self.names[k],
                                         self._attributes(ROOT + 1 + k), k + 1):
                break

    async def releasedir(self, fh: int) -> None:
        """Nothing to release."""

    @errno_boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        """Open a device for reading, bypassing this mount's page cache (see the docstring)."""
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "read-only device")
        self._device(inode)
        self.open_handles += 1
        return pyfuse3.FileInfo(fh=inode, direct_io=True, keep_cache=False)

    @errno_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes:
        """`size` bytes of device `fh` at `off` (short past its end); served at once when
        its data is cached and verified already, the common request."""
        device = self._device(fh)
        data = device.read_cached(off, size)
        return data if data is not None else await device.read(off, size)

    async def flush(self, fh: int) -> None:
        """ENOSYS: the kernel stops sending FLUSH (see ops.py)."""
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        """Count the handle out; tell the lifecycle when none is left."""
        self.open_handles -= 1
        if self.open_handles == 0 and self.on_released is not None:
            self.on_released()

    @errno_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        """Only the root's virtual `user.weenv.stats`."""
        if inode == ROOT and name == STATS_XATTR and self.stats is not None:
            return json.dumps(self.stats(), sort_keys=True).encode()
        raise OSError(errno.ENODATA, "no such attribute")

    @errno_boundary
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        """None listed."""
        return []

    @errno_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """The devices' total size, nothing free."""
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = 4096
        out.f_blocks = sum(d.layout.blocks for d in self.devices)
        out.f_files = len(self.devices) + 1
        out.f_namemax = 255
        return out

    @errno_boundary
    async def setattr(self, *args: Any) -> Any:
        raise OSError(errno.EROFS, "read-only")


class PyfuseDevices:
    """The folder of `ops` mounted and served by pyfuse3 in this process: the interface of
    native_devices.NativeDevices (which kernel_mount.py uses where it is installed)."""

    def __init__(self, ops: DeviceOperations) -> None:
        self.ops = ops
        self.failure: str | None = None  # pyfuse3's loop does not end on its own

    @property
    def open_handles(self) -> int:
        """Device handles the kernel holds open."""
        return self.ops.open_handles

    def mount(self, folder: Path) -> None:
        """Mount the folder at `folder` (OSError if the kernel refuses)."""
        options = {"fsname=weenv-device", "subtype=weenv", "ro", "default_permissions"}
        try:
            pyfuse3.init(self.ops, str(folder), options)
        except RuntimeError as error:
            raise OSError(errno.EIO, str(error)) from None

    async def main(self) -> None:
        """Serve until `terminate()` or the unmount."""
        await pyfuse3.main()

    def terminate(self) -> None:
        """End `main`."""
        pyfuse3.terminate()

    def close(self) -> None:
        """Unmount the folder (a no-op when it is gone)."""
        pyfuse3.close(unmount=True)
