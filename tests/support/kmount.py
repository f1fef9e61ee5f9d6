"""Kernel mounts for tests, through the project's own mount(2)/umount2(2) calls
(`weenvfs.fuse.syscalls`).

Owns: the `mounted` context manager (always unmounts, lazily as a last resort), plus
`can_mount_erofs`/`can_mount_overlay` for skips. An EROFS
image *file* mounts directly (the kernel's file-backed mode, no loop device); its extra
devices are given as `device=/abs/path` options.

Must not: know any WeEnv format; it mounts what it is given.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from weenvfs.fuse import syscalls


def _filesystems() -> set[str]:
    with open("/proc/filesystems", encoding="ascii") as f:
        return {line.split()[-1] for line in f if line.strip()}


def can_mount_erofs() -> bool:
    """Root, and the kernel knows erofs."""
    return os.geteuid() == 0 and "erofs" in _filesystems()


def can_mount_overlay() -> bool:
    """Root, and the kernel knows overlayfs."""
    return os.geteuid() == 0 and "overlay" in _filesystems()


@contextlib.contextmanager
def mounted(
    source: str | Path, target: str | Path, fstype: str, options: str = "",
    flags: int = syscalls.MS_RDONLY,
) -> Iterator[Path]:
    """Mount for the duration of the block; always unmount (detached if still busy)."""
    syscalls.mount(source, target, fstype, options, flags)
    try:
        yield Path(target)
    finally:
        try:
            syscalls.umount(target)
        except OSError:
            syscalls.umount(target, detach=True)


def mounted_erofs(
    image: Path, device: Path, target: Path
) -> contextlib.AbstractContextManager[Path]:
    """Mount an EROFS image file read-only with one extra device (a plain file)."""
    return mounted(image, target, "erofs", f"device={device.resolve()}")
