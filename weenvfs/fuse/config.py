"""`MountConfig`: everything a mount needs besides the environment itself.

Owns only that plain record. It lives apart from mount.py so that `weenv mount` can build it
in the parent process without importing pyfuse3, trio and the core (the daemon pays for
those; the parent only starts it and waits, see DESIGN.md "mount to first `stat /`").
Must not: import anything beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MountConfig:
    """Everything a mount needs besides the environment itself."""

    mountpoint: Path
    cache_dir: Path
    cache_size: int
    deadline: float
    allow_other: bool = False
    hint: str = "latest"  # a hint tag, a hint digest, or "none" (core/hints.py find_hint)
    fetch_all: bool = False  # after the hint, fetch every chunk (survive a store outage)
    record_tag: str | None = None  # record reads; on unmount merge them into this hint tag
    record_result: Path | None = None  # where to write what was published (JSON)
    record_replace: bool = False  # publish the recorded run alone, not merged
    coalesce: bool = True  # merge neighbouring chunks into one ranged GET (off: benchmarks)
    neighbours: bool = True  # fetch a missed chunk's blob neighbourhood too (off: benchmarks)
    layer: int | None = None  # serve only this group, as an overlayfs lower layer
    path: str = "auto"  # "kernel" (EROFS images over lazy devices), "fuse" (the tree), "auto"


PATHS = ("auto", "kernel", "fuse")
