"""The paths the runtime makes or mounts on inside a sandbox's root, checked before runc runs.

A hostile image can put a symlink where the runtime works: `/dev -> /tmp/victim`. runc
resolves each mount's destination inside the root (securejoin), but then creates /dev/fd,
/dev/ptmx, /dev/stdin... by plain path *before* it pivots into the root, so an absolute link
at /dev is followed on the host and root writes there. So:

- `check_system_dirs`: /dev, /proc and /sys (what runc mounts on and writes below) must be
  real directories, with no symlink in the way, or be absent (then they are made); anything
  else refuses the image with one line naming the path (`UnsafeImage`);
- `ensure_dir`: a directory WeEnv itself needs (the working directory, /tmp) is made inside
  the root, following the image's symlinks *inside* it (`/tmp -> /var/tmp`, or a link to a
  path absent from the image, `/work -> /host/dir`, creates that path in the sandbox's upper);
  a loop or a file in the way refuses the image with one line.

Every access goes through rootfs.py's openat2(RESOLVE_IN_ROOT) helpers, so `..` and links
never leave the root. Must not: mount anything, or know runc beyond the paths it writes to.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
from pathlib import Path

from weenvfs.errors import WeenvError

from . import rootfs

SYSTEM_DIRS = ("/dev", "/proc", "/sys")
RESOLVE_NO_SYMLINKS = 0x04
MAX_LINKS = 40  # as the kernel's ELOOP limit for one lookup


class UnsafeImage(WeenvError):
    """The environment has something in a place the runtime must use that it cannot use
    safely (a symlink at /dev, a loop at /tmp, ...)."""


def _open_no_symlinks(root: Path, path: str) -> int:
    """openat2(O_PATH|O_DIRECTORY) of `path` in `root`, refusing any symlink on the way."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = rootfs._OpenHow(os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0,
                              rootfs.RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS)
        fd = rootfs._libc.syscall(rootfs.SYS_OPENAT2, root_fd,
                                  os.fsencode(path.lstrip("/") or "."), ctypes.byref(how),
                                  ctypes.sizeof(how))
    finally:
        os.close(root_fd)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return int(fd)


def _link_target(root: Path, path: str) -> str | None:
    """The target of `path` if it is a symlink (its parent resolved inside `root`)."""
    parent, name = posixpath.split(path.rstrip("/"))
    try:
        fd = rootfs.open_in_root(root, parent or "/", os.O_PATH | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        return os.readlink(name, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def check_system_dirs(root: Path) -> None:
    """Make sure runc can mount on and write below /dev, /proc and /sys of `root` without
    following a link: each is a real directory (made if absent) or the image is refused."""
    for path in SYSTEM_DIRS:
        try:
            os.close(_open_no_symlinks(root, path))
        except FileNotFoundError:
            rootfs.make_dirs(root, path, (0, 0))
        except OSError as error:
            if error.errno == errno.ELOOP:
                target = _link_target(root, path)
                raise UnsafeImage(
                    f"the environment's {path} is a symlink (to {target}); sandboxes need a "
                    "real directory there") from None
            if error.errno == errno.ENOTDIR:
                raise UnsafeImage(f"the environment's {path} is not a directory; sandboxes "
                                  "need a real directory there") from None
            raise


def ensure_dir(root: Path, path: str, owner: tuple[int, int], mode: int = 0o755) -> None:
    """`mkdir -p path` inside `root`, following the image's symlinks inside it; UnsafeImage
    naming `path` if that cannot give a directory (a loop, a file in the way)."""
    try:
        _make(root, path, owner, mode, MAX_LINKS)
    except OSError as error:
        reason = "it loops" if error.errno == errno.ELOOP else error.strerror
        raise UnsafeImage(f"the environment's {path} cannot be made a directory: "
                          f"{reason}") from None


def _make(root: Path, path: str, owner: tuple[int, int], mode: int, links: int) -> None:
    if rootfs.is_dir_in_root(root, path):
        return
    parts = [p for p in posixpath.normpath("/" + path).split("/") if p]
    for depth in range(1, len(parts) + 1):
        here = "/" + "/".join(parts[:depth])
        if rootfs.is_dir_in_root(root, here):
            continue
        target = _link_target(root, here)
        if target is None:  # nothing there (or not a link): make it, or fail naming why
            rootfs.make_dirs(root, here, owner, mode)
            os.close(rootfs.open_in_root(root, here, os.O_PATH | os.O_DIRECTORY))
            continue
        # A dangling link: make what it points to, as the sandbox will see it.
        if links == 0:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        base = posixpath.dirname(here)
        resolved = posixpath.normpath(target if target.startswith("/")
                                      else posixpath.join(base, target))
        _make(root, resolved, owner, mode, links - 1)
        os.close(rootfs.open_in_root(root, here, os.O_PATH | os.O_DIRECTORY))
