"""Elastic CPU and memory limits for sandboxes, from observed usage (DESIGN.md: Provisioning).

The room stands alone: it imports only the stdlib and trio. Its parts:
- `cgroup_driver` (the driver interface, `CgroupLimits`, `Sample`), `cgroup_v1`, `cgroup_v2`, and
  `cgroup_detect` (which driver this node needs);
- `policy` and `budget`: pure sizing rules for a sandbox and for a node, tested on traces;
- `sidecar`: the trio loop, one per node, and `status`: its event log and status file;
- `registry`: how the runtime hands sandboxes to the sidecar (a spool folder);
- `history`: per-environment usage on the node, seeding initial limits;
- `trace` and `simulator`: demand traces and the same policy on a simulated node;
- `commands`: `weenv provision run|status|stop|simulate|trace`.
This module re-exports what the runtime calls; importing it does not import trio.
"""

from __future__ import annotations

from .cgroup_detect import detect_driver
from .cgroup_driver import (
    Cgroup,
    CgroupDriver,
    CgroupGone,
    CgroupLimits,
    NoCgroups,
    ProvisionError,
    Sample,
)
from .policy import PolicyConfig
from .registry import (
    Registration,
    ensure_sidecar,
    read_status,
    register,
    registrations,
    running_pid,
    stop_sidecar,
    unregister,
)

__all__ = [
    "Cgroup",
    "CgroupDriver",
    "CgroupGone",
    "CgroupLimits",
    "NoCgroups",
    "PolicyConfig",
    "ProvisionError",
    "Registration",
    "Sample",
    "detect_driver",
    "ensure_sidecar",
    "read_status",
    "register",
    "registrations",
    "running_pid",
    "stop_sidecar",
    "unregister",
]
