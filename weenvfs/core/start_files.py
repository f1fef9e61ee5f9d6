"""The files the runtime reads from every sandbox's root before its command starts, fetched by
a mount while it is being made.

Making a sandbox reads /etc/passwd and /etc/group (runtime/rootfs.py `resolve_user`: the uid,
groups and home of its user) as soon as its overlay is mounted. On a cold node each is a
store round trip after the mount is ready: 16-31 ms of every cold start of the reference
image (a first run and a run with a hint alike; the hint's replay has rarely reached them by
then). A mount fetches them itself while its EROFS image is made (fuse/mount.py), so the
runtime finds their chunks in the node cache.

Owns: `START_FILES` and `fetch_start_files`. Reads go through the mount's `Reader` (the node
cache, the chunk locks, verification and a recording mount's recorder, as any read). A
mount serving one group as an overlay layer fetches the files that group holds itself (the
top group's own view): a lower group's copy under an upper one's costs one chunk for nothing.
Must not: fail or delay a mount (errors are the runtime's read's to report), know sandboxes.
"""

from __future__ import annotations

import logging
import stat

from weenvfs.errors import WeenvError
from weenvfs.format.errors import FormatError

from .reader import Reader
from .tree import ROOT_INODE, Tree

log = logging.getLogger(__name__)

START_FILES = (b"etc/passwd", b"etc/group")


async def fetch_start_files(tree: Tree, reader: Reader) -> int:
    """Read each of START_FILES that `tree` shows as a regular file through `reader`
    (fetching and caching its chunks); the bytes read. Never raises for a missing file or a
    failed fetch (the runtime's own read reports it)."""
    done = 0
    for path in START_FILES:
        try:
            inode = ROOT_INODE
            for name in path.split(b"/"):
                attr = tree.lookup(inode, name)
                inode = attr.inode
            if not stat.S_ISREG(attr.mode) or not attr.size:
                continue
            done += len(await reader.read(inode, 0, attr.size))
        except (OSError, WeenvError, FormatError) as error:
            log.debug("start file /%s not fetched ahead: %s", path.decode(), error)
    return done
