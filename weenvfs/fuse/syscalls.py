"""mount(2) and umount2(2) through libc, for the kernel path's EROFS and overlayfs mounts.

Owns only the calls and their errors: `OSError` with the errno and a message naming what
was mounted. mount(8) is not used: it would set up a loop device for an image file, where the
kernel mounts EROFS from the file itself (file-backed mounts), and it costs a process.
Must not: decide what to mount (kernel_mount.py).
"""

from __future__ import annotations

import ctypes
import errno
import os

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2

# The process's own libc (CDLL(None)): ctypes.util.find_library runs `ldconfig -p`, a
# process and ~20 ms on every mount daemon's start.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount(source: str | os.PathLike[str], target: str | os.PathLike[str], fstype: str,
          options: str = "", flags: int = MS_RDONLY | MS_NODEV) -> None:
    """mount(2) `source` on `target` as `fstype` with `options` (comma-separated)."""
    if _libc.mount(os.fsencode(source), os.fsencode(target), fstype.encode(), flags,
                   options.encode() or None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot mount {fstype} on {target}: {os.strerror(code)}")


def umount(target: str | os.PathLike[str], detach: bool = False) -> bool:
    """umount2(2) `target` (lazily with `detach`); False if nothing was mounted there (or
    the folder is gone: whoever unmounted it first removed it, mount_copies.py)."""
    if _libc.umount2(os.fsencode(target), MNT_DETACH if detach else 0) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
        return False
    raise OSError(code, f"cannot unmount {target}: {os.strerror(code)}")
