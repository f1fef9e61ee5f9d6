"""A size-limited writable layer: an ext4 file system in an image file, on a loop device.

`--disk SIZE` gives a sandbox's upper and work dirs a file system of their own, so a runaway
episode gets ENOSPC instead of filling the node's disk. The image is sparse (it costs only
what is written) and made with no reserved blocks (root in the sandbox gets no more than
SIZE) and no journal (the upper is thrown away at reset; `volatile` overlay already skips
syncs). It is mounted with util-linux `mount -o loop`, which sets the loop device to detach
itself at the last unmount: an unmount, lazy or not, releases the device, and nothing else
has to remember it. docs/design-notes.md says why this and not a tmpfs (measured there).

Owns: `make_disk` (create the image, format it) and `mount_disk`. Unmounting is rootfs.py's
`unmount`. Must not: know sandboxes or where their files live.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from weenvfs.errors import UsageError, WeenvError

log = logging.getLogger(__name__)

MIN_DISK = 8 << 20  # below that ext4's own metadata leaves little room for files
TOOL_TIMEOUT = 60.0


def check_size(size: int) -> int:
    """`size` if it can hold a disk (UsageError otherwise)."""
    if size < MIN_DISK:
        raise UsageError(f"--disk must be at least {MIN_DISK >> 20}M, not {size} bytes")
    return size


def make_disk(image: Path, size: int) -> None:
    """A sparse image file of `size` bytes at `image`, formatted as ext4."""
    with open(image, "wb") as f:
        f.truncate(size)
    _run("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
         "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", str(image))


def mount_disk(image: Path, target: Path) -> None:
    """Mount the ext4 `image` at `target` through a loop device freed at its unmount."""
    _run("mount", "-t", "ext4", "-o", "loop,nosuid,nodev", str(image), str(target))


def _run(*argv: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT,
                              check=False, env={**os.environ, "LC_ALL": "C"})
    except FileNotFoundError:
        raise WeenvError(f"{argv[0]} not found (Debian packages e2fsprogs, mount)") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise WeenvError(f"{argv[0]} failed: {lines[-1] if lines else done.returncode}")
