"""Files the node keeps beside its chunk cache (group indexes, EROFS images, device layouts):
written whole or not at all, and able to carry a verdict about their content.

Each such file is checked against a digest every time it is used (hashing a few MB costs a
millisecond or two), so damage, whether a torn write before a power loss or a change by hand,
is never served. What costs more than a hash is a verdict about the content, such as "this
index is a tree" (25 ms at 100k files): it is recorded on the file as an xattr whose name says
which check gave it, and holds as long as the file still hashes to the same digest.

Owns: atomic writes, verdict markers, and `touch`: the cache evicts these files with its
chunks, least recently used first by mtime (cache.py), so each use refreshes it. Must not:
decide what a file means or how it is checked (node_copies.py, kernel_image.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

TOUCH_INTERVAL = 60.0  # seconds between mtime refreshes of one file (the cache's LRU resolution)


def touch(path: Path) -> None:
    """Mark `path` as used now (its mtime), at most once per TOUCH_INTERVAL; best effort."""
    with contextlib.suppress(OSError):
        if time.time() - os.stat(path).st_mtime > TOUCH_INTERVAL:
            os.utime(path)


def has_verdict(path: Path, name: str) -> bool:
    """Whether `path` carries verdict `name` (False without xattr support)."""
    try:
        return os.getxattr(path, name) == b"1"
    except OSError:
        return False


def set_verdict(path: Path, name: str) -> None:
    """Record verdict `name` on `path` (best effort: without xattrs, the check runs again)."""
    with contextlib.suppress(OSError):
        os.setxattr(path, name, b"1")


def hash_file(path: Path, digest: Callable[[bytes | memoryview], str]) -> str:
    """`digest` of the content of `path`, hashed where it lies (mapped, not read: reading a
    14 MB EROFS image into memory cost three times its hashing, at every mount)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return digest(b"")
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
            return digest(view)


def write_atomically(path: Path, data: bytes | memoryview) -> None:
    """Write `path` through a temporary file and a rename: a reader sees all of it or none.
    The temporary file is this thread's own: the threads of one process (16 sandboxes opened
    at once, the parallel loads of a mount) may write the same node copy together."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
