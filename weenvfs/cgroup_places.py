"""Where this process's cgroups are: each hierarchy it belongs to (a line of /proc/self/cgroup),
the folder that hierarchy is mounted at here, and its cgroup there.

Two rooms need the same mapping: the node service, which moves itself to each hierarchy's
root (fuse/mountd.py `leave_caller_cgroups`), and the runtime, which writes its pid into its
own cgroup to warm the kernel's cgroup lock (runtime/cgroups.py `prime_migrations`).

Must not: import anything but the standard library, or write to any cgroup (its callers do).
"""

from __future__ import annotations

import contextlib
from pathlib import Path


def own_cgroups() -> list[tuple[str, Path, str]]:
    """(hierarchy, mount point, cgroup) for each hierarchy this process is in that is
    mounted here: the hierarchy as /proc/self/cgroup names its controllers (`cgroup2` for
    the unified one), the cgroup as a path below the mount point (`/` at its root). A
    hierarchy mounted twice counts once; /proc unreadable: none; a line that does not parse
    is skipped."""
    v1: dict[frozenset[str], Path] = {}
    unified: Path | None = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            tail = fields[fields.index("-") + 1:] if "-" in fields else []
            if len(tail) < 3 or len(fields) < 5:
                continue
            if tail[0] == "cgroup2":
                unified = unified or Path(fields[4])
            elif tail[0] == "cgroup":
                names = frozenset(o for o in tail[2].split(",") if o not in ("rw", "ro"))
                v1.setdefault(names, Path(fields[4]))
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            _, controllers, where = parts
            wanted = set(controllers.split(","))
            root = unified if not controllers else next(
                (mount for names, mount in v1.items() if wanted <= names), None)
            if root is not None:
                found.append((controllers or "cgroup2", root, where))
    return found
