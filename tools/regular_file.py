"""Opening a file a source reads, refusing anything that is not a regular file.

Owns: `open_regular`, which opens with O_NONBLOCK (so a FIFO or a device cannot block the open)
and, inside a source's own tree, O_NOFOLLOW (so a symlink cannot lead the read elsewhere), then
checks with fstat that what it got is a regular file before a byte is read. Every image and
build source (oci_layout.py, docker_archive.py, source_tar.py, source_dir.py) opens files here.

Must not: read the file, or decide what the caller's error message says beyond naming the path.
"""

from __future__ import annotations

import fcntl
import os
import stat
from typing import BinaryIO

from weenvfs.errors import SourceError


def open_regular_fd(path: str | bytes | os.PathLike[str], *, follow: bool) -> int:
    """A read-only descriptor of `path`, blocking again once it is known to be a regular file.

    Raises OSError when the open fails, and SourceError (naming the path) when `path` is not a
    regular file, or is a symlink and `follow` is false."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    shown = os.fsdecode(path)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == 40:  # ELOOP: the last component is a symlink and O_NOFOLLOW refused it
            raise SourceError(f"{shown} is a symlink, not a regular file") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SourceError(f"{shown} is not a regular file ({_kind(mode)})")
        # A regular file never blocks, but later readers should not see EAGAIN semantics.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | bytes | os.PathLike[str], *, follow: bool) -> BinaryIO:
    """`open_regular_fd` as a buffered binary file object (the caller closes it)."""
    return os.fdopen(open_regular_fd(path, follow=follow), "rb")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"
