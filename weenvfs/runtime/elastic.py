"""Elastic sandboxes: the runtime's side of the node's provisioner (weenvfs.provision).

An elastic sandbox (`--elastic`, `Environment.open(..., elastic=True)`) has two cgroups:

    /weenv/ID        made with the provisioner's driver when the sandbox is created and
                     registered with the node's sidecar (started if none runs) before any
                     process of the sandbox exists; holds the memory and CPU limits the sidecar
                     moves; removed only when the sandbox is destroyed
    /weenv/ID/runc   runc's (`cgroups.create_cgroup`): made with each start of the init and
                     deleted with it at every reset; holds the processes and the pids limit

Limits bind a whole subtree (v1 with use_hierarchy, CFS bandwidth, and v2), so the parent's
apply to everything runc starts below it. A reset therefore leaves the registration, the
sidecar's statistics and the limits it has reached untouched: there is nothing to re-register.

Owns: `attach` (create and register, first limits from `--memory`/`--cpus`, else from the
environment's history on this node), `release` (unregister and wait until the sidecar has
recorded the run in the history, so the next sandbox of the environment is seeded from it),
`NodeView.describe` (the limits in force, for `weenv sandbox ls`) and `drop_orphans` (for gc).
Must not: decide limits (weenvfs.provision) or build sandboxes (sandbox.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weenvfs import provision
from weenvfs.errors import WeenvError

from .cgroups import CGROUP_PARENT, Limits, sandbox_cgroup

log = logging.getLogger(__name__)

RELEASE_WAIT = 5.0  # seconds to wait for the sidecar to let go of a sandbox


def attach(sandbox_id: str, env_digest: str, limits: Limits) -> dict[str, Any]:
    """Create the sandbox's elastic cgroup, give it its first limits and register it with the
    node's provisioner (starting the sidecar if none runs); returns the state's record."""
    try:
        driver = provision.detect_driver()
        cgroup = driver.create(sandbox_cgroup(sandbox_id))
        registration = provision.register(
            sandbox_id, cgroup.paths(), env_digest, driver=driver, start=True,
            memory=limits.memory,
            cpu_millis=None if limits.cpus is None else max(1, round(limits.cpus * 1000)),
        )
    except (provision.ProvisionError, OSError) as error:
        raise WeenvError(
            f"cannot put sandbox {sandbox_id} under the provisioner: {error}"
        ) from None
    log.info("sandbox %s is elastic, first limits %s", sandbox_id, registration.initial)
    return {"cgroup": sandbox_cgroup(sandbox_id), "initial": registration.initial.to_json()}


def release(sandbox_id: str) -> None:
    """Take the sandbox from the provisioner; once the sidecar let go, its run is in the
    environment's history (a sidecar that does not answer in RELEASE_WAIT is not waited for,
    and without a sidecar there is no run to record)."""
    try:
        provision.unregister(sandbox_id, wait=RELEASE_WAIT)
    except provision.ProvisionError as error:
        log.warning("cannot unregister sandbox %s: %s", sandbox_id, error)


@dataclass(frozen=True)
class NodeView:
    """What `describe` needs from the node, read once for a whole `weenv sandbox ls`."""

    driver: provision.CgroupDriver | None
    registered: frozenset[str]
    sidecar: int | None

    @classmethod
    def take(cls) -> NodeView:
        """The node as it is now (no driver when it has no usable cgroups)."""
        try:
            driver: provision.CgroupDriver | None = provision.detect_driver()
        except provision.ProvisionError:
            driver = None
        return cls(driver, frozenset(provision.registrations()), provision.running_pid())

    def describe(self, sandbox_id: str) -> dict[str, Any]:
        """The limits in force on the sandbox's elastic cgroup (read from the kernel), its
        memory usage, and whether the provisioner has it."""
        info: dict[str, Any] = {
            "cgroup": sandbox_cgroup(sandbox_id), "registered": sandbox_id in self.registered,
            "sidecar": self.sidecar, "memory": None, "memory_high": None,
            "memory_usage": None, "cpus": None,
        }
        if self.driver is None:
            return info
        try:
            cgroup = self.driver.resolve([sandbox_cgroup(sandbox_id).lstrip("/")])
            sample = self.driver.read(cgroup)
        except (provision.ProvisionError, OSError) as error:
            info["error"] = str(error)
            return info
        quota = sample.cpu_quota_millis
        info.update(memory=sample.mem_limit, memory_high=sample.mem_high,
                    memory_usage=sample.mem_usage, cpus=None if quota is None else quota / 1000)
        return info


def drop_orphans(is_live: Callable[[str], bool]) -> list[str]:
    """Unregister the runtime's registrations (cgroup `/weenv/ID`) whose sandbox is gone;
    return their ids."""
    dropped = []
    for sandbox_id, registration in provision.registrations().items():
        suffix = f"/{CGROUP_PARENT}/{sandbox_id}"
        ours = any(path.rstrip("/").endswith(suffix) for path in registration.cgroups)
        if ours and not is_live(sandbox_id):
            provision.unregister(sandbox_id)
            dropped.append(sandbox_id)
    return dropped
