"""Kernel mounts for tests, through libc `mount(2)`/`umount2(2)` with ctypes.

Owns: `mount`, `umount` and the `mounted` context manager (always unmounts, lazily with
MNT_DETACH as a last resort), plus `can_mount_erofs`/`can_mount_overlay` for skips. An EROFS
image *file* mounts directly (the kernel's file-backed mode, no loop device); its extra
devices are given as `device=/abs/path` options.

Must not: know any WeEnv format; it mounts what it is given.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from pathlib import Path

MS_RDONLY = 1
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _filesystems() -> set[str]:
    with open("/proc/filesystems", encoding="ascii") as f:
        return {line.split()[-1] for line in f if line.strip()}


def can_mount_erofs() -> bool:
    """Root, and the kernel knows erofs."""
    return os.geteuid() == 0 and "erofs" in _filesystems()


def can_mount_overlay() -> bool:
    """Root, and the kernel knows overlayfs."""
    return os.geteuid() == 0 and "overlay" in _filesystems()


def mount(source: str | Path, target: str | Path, fstype: str, flags: int, options: str) -> None:
    """mount(2); raise OSError with the errno on failure."""
    rc = _libc.mount(
        os.fsencode(source), os.fsencode(target), fstype.encode(), flags, options.encode()
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t {fstype} {source} {target} -o {options}: {os.strerror(err)}")


def umount(target: str | Path, flags: int = 0) -> None:
    """umount2(2); raise OSError with the errno on failure."""
    if _libc.umount2(os.fsencode(target), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


@contextlib.contextmanager
def mounted(
    source: str | Path, target: str | Path, fstype: str, options: str = "", flags: int = MS_RDONLY
) -> Iterator[Path]:
    """Mount for the duration of the block; always unmount (detached if still busy)."""
    mount(source, target, fstype, flags, options)
    try:
        yield Path(target)
    finally:
        try:
            umount(target)
        except OSError:
            umount(target, MNT_DETACH)


def mounted_erofs(
    image: Path, device: Path, target: Path
) -> contextlib.AbstractContextManager[Path]:
    """Mount an EROFS image file read-only with one extra device (a plain file)."""
    return mounted(image, target, "erofs", f"device={device.resolve()}")
