"""`MountConfig`: everything a mount needs besides the environment itself.

Owns that plain record, its defaults (`default_cache_dir`) and `mount_args`, the one place
that turns mount options back into the daemon's command line (used by `weenv mount`, the
runtime and `weenv hints record`: the Python API takes it from here, not from the CLI). It
lives apart from mount.py so that `weenv mount` can build it in the parent process without
importing pyfuse3, trio and the core (the daemon pays for those; the parent only starts it
and waits, see DESIGN.md "mount to first `stat /`").
Must not: import anything beyond the standard library at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class MountConfig:
    """Everything a mount needs besides the environment itself."""

    mountpoint: Path
    cache_dir: Path
    cache_size: int
    deadline: float
    allow_other: bool = False
    hint: str = "latest"  # a hint tag, a hint digest, or "none" (core/node_hints.py find_hint)
    fetch_all: bool = False  # after the hint, fetch every chunk (survive a store outage)
    record_tag: str | None = None  # record reads; on unmount merge them into this hint tag
    record_result: Path | None = None  # where to write what was published (JSON)
    record_replace: bool = False  # publish the recorded run alone, not merged
    coalesce: bool = True  # merge neighbouring chunks into one ranged GET (off: benchmarks)
    neighbours: bool = True  # fetch a missed chunk's blob neighbourhood too (off: benchmarks)
    layer: int | None = None  # serve only this group, as an overlayfs lower layer
    path: str = "auto"  # "kernel" (EROFS images over lazy devices), "fuse" (the tree), "auto"
    # Group position -> a mount of that group (a layer mount of the same stack): the hint
    # replay reads that group's hinted files through it too (core/page_warm.py).
    page_roots: Mapping[int, Path] = field(default_factory=dict)


# Where `weenv mountd` serves the node's metrics unless told otherwise (exporter.py).
DEFAULT_METRICS = "127.0.0.1:9387"
PATHS = ("auto", "kernel", "fuse")


def default_cache_dir() -> Path:
    """The node cache shared by every mount and `weenv cache` (core/cache.py decides; imported
    here on first use, so that this module stays light)."""
    from weenvfs.core.cache import default_cache_dir as cache_default

    return cache_default()


def cache_dir_of(cache: str | Path | None) -> Path:
    """The node cache a command or call names (`--cache`, `cache=`), absolute; None: the
    node's default (`default_cache_dir`)."""
    return (Path(cache) if cache is not None else default_cache_dir()).absolute()


def is_url(store: str) -> bool:
    """Whether `--store` names a URL (`scheme://...`, or `file:/path` as RFC 8089 allows)
    rather than a directory path, which callers make absolute for a daemon that runs in /."""
    return "://" in store or store[:5].lower() == "file:"


def mount_args(
    ref: str, mountpoint: Path, store: str, cache_dir: Path, *, log_file: Path,
    cache_size: int | None = None, deadline: float | None = None,
    allow_other: bool | None = None, hint: str | None = None, fetch_all: bool = False,
    record_tag: str | None = None, record_result: Path | None = None,
    record_replace: bool = False, coalesce: bool = True, neighbours: bool = True,
    layer: int | None = None, path: str = "auto", verbose: int = 0, nonempty: bool = False,
    page_roots: Mapping[int, Path] | None = None,
) -> list[str]:
    """The arguments of `weenv mount REF MOUNTPOINT --foreground` for `spawn.spawn`.

    Keywords are MountConfig's fields; None leaves an option to the daemon's default. The
    daemon runs in / (so that it pins no working directory): a store folder is made
    absolute here, every other path must be absolute already."""
    store = store if is_url(store) else os.path.abspath(store)
    optional: list[str] = []
    if cache_size is not None:
        optional += ["--cache-size", str(cache_size)]
    if deadline is not None:
        optional += ["--deadline", repr(deadline)]
    if allow_other is not None:
        optional.append("--allow-other" if allow_other else "--no-allow-other")
    if hint is not None:
        optional += ["--hint", hint]
    if layer is not None:
        optional += ["--layer", str(layer)]
    if path != "auto":
        optional += ["--path", path]
    for group, root in sorted((page_roots or {}).items()):
        optional += ["--pages-through", f"{group}={root}"]
    return [
        *(["-" + "v" * verbose] if verbose else []), "--log-file", str(log_file),
        "mount", ref, str(mountpoint), "--store", store, "--cache", str(cache_dir),
        "--foreground", *optional,
        *(["--fetch-all"] if fetch_all else []),
        *(["--record-hints", record_tag] if record_tag is not None else []),
        *(["--record-result", str(record_result)] if record_result else []),
        *(["--record-replace"] if record_replace else []),
        *([] if coalesce else ["--no-coalesce"]),
        *([] if neighbours else ["--no-neighbours"]),
        *(["--nonempty"] if nonempty else []),
    ]
