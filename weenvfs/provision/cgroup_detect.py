"""Picking the node's cgroup driver: `detect_driver()`, v2 where a cgroup2 mount offers memory
and cpu, else v1.

Owns only that choice. It lives apart from cgroup.py, whose interface both drivers import, so
that imports point one way (drivers -> cgroup; this module -> the drivers). The drivers are
imported when `detect_driver` runs, not with the package (the runtime imports it at start-up).
Must not: read or write limits (the drivers do). Nothing here does I/O at import.
"""

from __future__ import annotations

from .cgroup_driver import V1_CONTROLLERS, CgroupDriver, NoCgroups, read_mounts, v2_controllers


def detect_driver(mounts_file: str = "/proc/self/mounts") -> CgroupDriver:
    """The driver for this node: cgroup v2 if a cgroup2 mount offers memory and cpu, else v1.

    Raises NoCgroups when neither works.
    """
    from .cgroup_v1 import CgroupV1Driver
    from .cgroup_v2 import CgroupV2Driver

    mounts = read_mounts(mounts_file)
    for root in mounts.v2:
        if {"memory", "cpu"} <= v2_controllers(root):
            return CgroupV2Driver(root)
    if all(name in mounts.v1 for name in V1_CONTROLLERS):
        return CgroupV1Driver(mounts.v1)
    offered = {str(root): sorted(v2_controllers(root)) for root in mounts.v2}
    raise NoCgroups(
        f"no cgroup hierarchy with memory and cpu: v1 has {sorted(mounts.v1)}, v2 {offered}"
    )
