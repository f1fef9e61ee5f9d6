"""What a test that started daemons and mounts under one folder checks at its end: nothing of
theirs is still mounted or running.

Owns: `mounted_below` (mounts at or below a folder, and the kernel path's device mounts of
weenv mounts there, kept in a run folder named after the mount point) and
`processes_naming` (processes whose command line names the folder).
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from .processes import node_processes


def mounted_below(path: Path) -> list[str]:
    """Lines of /proc/self/mounts for mounts below `path` or named after a mount point
    there (weenv's /run/weenv/kernel/<%-quoted mount point>/devices)."""
    prefix = os.fsencode(str(path))
    quoted = os.fsencode(urllib.parse.quote(str(path) + "/", safe=""))
    with open("/proc/self/mounts", "rb") as f:
        return [line.decode() for line in f
                if line.split()[1].startswith(prefix) or quoted in line.split()[1]]


def processes_naming(path: Path) -> list[str]:
    """Command lines of the processes that name `path` in theirs."""
    needle = os.fsencode(str(path))
    return [proc.command.decode(errors="replace") for proc in node_processes()
            if needle in proc.command]
