"""Sandbox cgroups: the hook that creates them, their limits, and the files we read.

Owns: `Limits` (what `--cpus/--memory/--pids` ask for), their OCI form (`oci_resources`), the
hook every sandbox start goes through (`cgroup_factory`, replaced by `set_cgroup_factory`),
and the few cgroup file operations the runtime needs whatever the version: the directories
of a cgroup in every mounted hierarchy (`cgroup_dirs`; v1 has one per controller, v2 one),
its pids, killing one session in it, and forced removal (kill what is left, rmdir); and
`prime_migrations`, which has the kernel's cgroup lock warm before the OCI runtime moves a
sandbox's process.

The hook runs at every start of a sandbox's init (create and reset), since a reset kills the
init and runc removes the cgroup with it. The default, `create_cgroup`, names `/weenv/ID`
and lets runc create it (memory, cpu, pids and the other v1 controllers, or one v2
directory) and write the limits. For an elastic sandbox (`Limits.elastic`) it names runc's
child `/weenv/ID/runc` with the pids limit only: `/weenv/ID` itself is the provisioner's,
made and registered once by elastic.py, so its limits and registration outlive every reset
(limits bind a whole subtree). A replacement hook (`set_cgroup_factory`) must do the same.

Must not: decide limits over time (weenvfs.provision) or know sandboxes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weenvfs.cgroup_places import own_cgroups
from weenvfs.errors import UsageError

from .launcher import CgroupSpec

log = logging.getLogger(__name__)

CGROUP_PARENT = "weenv"
ELASTIC_CHILD = "runc"  # runc's cgroup below an elastic sandbox's own
DEFAULT_PIDS = 4096  # a fork bomb must not take the node down even when no limit is asked
MIN_MEMORY = 6 << 20  # Docker's least memory limit
MIN_PIDS = 2


@dataclass(frozen=True)
class Limits:
    """Limits of one sandbox (None: unlimited). `cpus` and `memory` are fixed, or with
    `elastic` the first limits the node's provisioner starts from (None: from the history of
    the environment on this node); `pids` is always fixed."""

    cpus: float | None = None
    memory: int | None = None
    pids: int | None = DEFAULT_PIDS
    elastic: bool = False

    def __post_init__(self) -> None:
        # Refused here, once for the CLI and the Python API, rather than by the runtime later
        # with its own words (a memory limit under what the runtime itself needs ends in "OOM
        # ... read from sync socket"; one pid cannot hold the init and the command).
        if self.cpus is not None and not self.cpus > 0:
            raise UsageError(f"cpus must be more than 0, not {self.cpus}")
        if self.memory is not None and self.memory < MIN_MEMORY:
            raise UsageError(f"memory must be at least {MIN_MEMORY >> 20}M (as Docker's), "
                             f"not {self.memory} bytes")
        if self.pids is not None and self.pids < MIN_PIDS:
            raise UsageError(f"pids must be at least {MIN_PIDS} (the sandbox's init and its "
                             f"command), not {self.pids}")


def oci_resources(limits: Limits) -> dict[str, Any]:
    """OCI `linux.resources` for `limits` (runc maps them to v1 or v2 files)."""
    resources: dict[str, Any] = {}
    if limits.memory:
        resources["memory"] = {"limit": int(limits.memory)}
    if limits.cpus:
        period = 100_000
        resources["cpu"] = {"quota": max(1000, int(limits.cpus * period)), "period": period}
    if limits.pids:
        resources["pids"] = {"limit": int(limits.pids)}
    return resources


def sandbox_cgroup(sandbox_id: str) -> str:
    """The cgroup of sandbox `sandbox_id` below each hierarchy's root: `/weenv/ID`."""
    return f"/{CGROUP_PARENT}/{sandbox_id}"


def create_cgroup(sandbox_id: str, limits: Limits) -> CgroupSpec:
    """The default cgroup hook: `/weenv/ID`, created and limited by runc; for an elastic
    sandbox runc's `/weenv/ID/runc` below the provisioner's cgroup, with the pids limit only."""
    if limits.elastic:
        return CgroupSpec(f"{sandbox_cgroup(sandbox_id)}/{ELASTIC_CHILD}",
                          oci_resources(Limits(pids=limits.pids)))
    return CgroupSpec(sandbox_cgroup(sandbox_id), oci_resources(limits))


CgroupFactory = Callable[[str, Limits], CgroupSpec]
cgroup_factory: CgroupFactory = create_cgroup


def prime_migrations() -> None:
    """Start, in a thread, what the kernel makes the first cgroup move after a pause wait for.

    Moving a process between cgroups takes a node-wide lock whose first writer after an idle
    moment waits for an RCU grace period (`cgroup_threadgroup_rwsem`'s rcu_sync, in every
    hierarchy and version: 4-15 ms on this node; the writers right after it, ~0.1 ms). Every
    sandbox start and exec moves its process (the OCI runtime joins the sandbox's cgroup),
    so a warm `weenv run` waited for it on its critical path. Writing this process's pid into
    the cgroup it is in already (no move, nothing changes) from a thread as the run begins
    pays that wait beside the run's own work; the runtime's move then finds the lock warm.
    Best effort: nothing happens where no cgroup file is writable."""
    import threading

    threading.Thread(target=_write_own_cgroup, name="cgroup-prime", daemon=True).start()


def _write_own_cgroup() -> None:
    with contextlib.suppress(OSError):
        for _, root, where in own_cgroups()[:1]:  # one hierarchy: the lock is node-wide
            (root / where.lstrip("/") / "cgroup.procs").write_text(f"{os.getpid()}\n")


def set_cgroup_factory(factory: CgroupFactory) -> CgroupFactory:
    """Make `factory` create every new sandbox cgroup; return the previous one."""
    global cgroup_factory
    previous, cgroup_factory = cgroup_factory, factory
    return previous


def cgroup_dirs(path: str) -> list[Path]:
    """The existing directories of cgroup `path` in every mounted hierarchy (v1 and v2)."""
    found = []
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[2] in ("cgroup", "cgroup2"):
                candidate = Path(fields[1]) / path.lstrip("/")
                if candidate.is_dir():
                    found.append(candidate)
    return found


def cgroup_pids(path: str) -> list[int]:
    """Pids in cgroup `path` (from the first hierarchy that has it)."""
    for folder in cgroup_dirs(path):
        try:
            return [int(x) for x in (folder / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            continue
    return []


def remove_cgroup(path: str, timeout: float = 10.0) -> list[Path]:
    """Kill what is left in cgroup `path` and below it, and remove its directories (deepest
    first) in every hierarchy; return those removed."""
    folders = [Path(top) for d in cgroup_dirs(path) for top, _, _ in os.walk(d, topdown=False)]
    deadline = time.monotonic() + timeout
    removed = []
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        while True:
            for pid in _procs(folder):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                folder.rmdir()
                removed.append(folder)
                break
            except FileNotFoundError:
                break
            except OSError as error:  # EBUSY until the killed tasks have exited
                if time.monotonic() > deadline:
                    log.warning("cannot remove cgroup %s: %s", folder, error.strerror)
                    break
                time.sleep(0.01)
    return removed


def _procs(folder: Path) -> list[int]:
    try:
        return [int(x) for x in (folder / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def kill_session(path: str, leader: int, rounds: int = 200) -> int:
    """SIGKILL every process of cgroup `path` in the session of command `leader` (a host
    pid), again until none is left: a fork bomb forks while we kill. Returns how many
    signals were sent. runc makes an exec'd command a session leader; crun makes it the
    child of one (its own short-lived fork), so the session is read from the command, and
    taken as `leader` itself once the command is gone."""
    session = _session(leader) or leader
    killed = 0
    for _ in range(rounds):
        victims = [p for p in cgroup_pids(path) if _session(p) == session]
        if not victims:
            break
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += len(victims)
        time.sleep(0.005)
    return killed


def _session(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None
