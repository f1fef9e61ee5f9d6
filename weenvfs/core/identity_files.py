"""The files a sandbox's build reads before its command starts, asked for as a mount starts.

Building a sandbox reads the environment's /etc/passwd and /etc/group (runtime/rootfs.py
`resolve_user`: the user's uid, gid, groups and home) after its mounts are up and before its
command runs. On a cold first run each read was a demand miss on that critical path: 25-34 ms
of a README first run from SeaweedFS (three runs, timed in the build; docs/design-notes.md,
"Forty-third session"). The mount that serves the environment's top group (the one that
replays its hint: every group's chunks go to the node's one cache) asks for their chunks
as it starts serving, so they are cached, or on their way, when the build reads them.

Owns: which files those are and where the composed environment has them (the union rules
are format/compose.py's: the topmost entry wins, whiteouts and opaque directories hide).
Must not: read the files (the kernel does, through the mount) or fetch (the caller's
fetcher does, as a prefetch).
"""

from __future__ import annotations

from collections.abc import Sequence

from weenvfs.format.compose import ComposedTree
from weenvfs.format.index import GroupIndex

from .chunk_plan import ChunkLoc, chunk_loc

# Paths relative to the root, as a sandbox's build reads them (rootfs.resolve_user).
IDENTITY_FILES = (b"etc/passwd", b"etc/group")


def identity_locs(groups: Sequence[GroupIndex]) -> list[ChunkLoc]:
    """The chunks of the regular files IDENTITY_FILES name in the union of `groups`
    (lowest first), in path order; a path the union does not have as a regular file (absent,
    hidden, a symlink) adds none. FormatError for a malformed index."""
    composed = ComposedTree(groups)
    locs: list[ChunkLoc] = []
    for path in IDENTITY_FILES:
        entry = composed.resolve(path)
        if entry is None or entry.is_dir:
            continue
        index = groups[entry.group]
        if index.inode(entry.inode).is_reg:
            locs += [chunk_loc(index, n) for n in index.file_chunks(entry.inode)]
    return locs
