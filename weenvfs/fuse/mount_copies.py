"""Copies of our mounts in other mount namespaces: releasing them, and naming who holds them.

A mount namespace made while one of our mounts is up (`ip netns exec`, `unshare -m`, a
service with private mounts) holds a copy of it. On a host whose root mount is private (no
`shared:` propagation: no umount reaches the copy) that copy keeps the superblock, so the
kernel never releases the mount's data devices or FUSE connection and its daemon serves on
after we unmounted it: an eviction waited its full timeout twice per mount and left the
daemons running (found in a benchmark whose store ran under `ip netns exec`).

Owns:
- `remove_mount_folder`: remove a folder we unmounted. Linux (3.18 on) detaches every mount
  other namespaces have on a removed folder, lazily (their open files keep working), so this
  is how our umount reaches the copies, private or not;
- `unescape_mount_field`: a path as /proc's mount tables print it, decoded;
- `holders_elsewhere`: which other mount namespaces still show a mount at given paths (for
  an error that names them when a folder cannot be removed: a user's own mount point).

Must not: unmount anything itself, or enter another namespace.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

_PROC = Path("/proc")


def remove_mount_folder(folder: Path) -> None:
    """Remove `folder`, once unmounted here, so that copies of the mount other mount
    namespaces made go with it; never fails (a folder still mounted here, or not empty,
    stays)."""
    with contextlib.suppress(OSError):
        folder.rmdir()


def holders_elsewhere(paths: Iterable[Path], limit: int = 5) -> list[tuple[int, str]]:
    """(pid, command name) of one process per other mount namespace whose mount table shows
    a mount at one of `paths`, at most `limit` of them."""
    wanted = {os.fsencode(str(path)) for path in paths}
    try:
        ours = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return []
    seen = {ours}
    found: list[tuple[int, str]] = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or len(found) >= limit:
            continue
        try:
            namespace = os.stat(entry / "ns" / "mnt").st_ino
            if namespace in seen:
                continue
            seen.add(namespace)
            table = (entry / "mountinfo").read_bytes()
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue  # gone, or a kernel thread
        if any(unescape_mount_field(line.split(b" ")[4]) in wanted
               for line in table.splitlines() if line.count(b" ") > 4):
            found.append((int(entry.name), name))
    return found


def unescape_mount_field(field: bytes) -> bytes:
    """Undo the octal escapes (\\040 for a space) of /proc/*/mounts and mountinfo."""
    if b"\\" not in field:
        return field  # nearly every line: no regular expression for it
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field)


def describe(holders: list[tuple[int, str]]) -> str:
    """`pid 123 (sleep), pid 456 (ip)`."""
    return ", ".join(f"pid {pid} ({name})" for pid, name in holders)
