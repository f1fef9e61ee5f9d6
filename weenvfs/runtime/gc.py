"""`weenv sandbox gc`: remove what crashed controllers left behind.

Owns the rules for what is an orphan, and their removal:
- a sandbox whose owner process is gone (pid dead, or reused: the start time differs), or a
  detached one (`weenv sandbox create`) whose init is gone (the node rebooted, or someone
  killed it): `Sandbox.destroy` kills its
  processes, unmounts its overlay and tmpfs, removes its cgroup and upper dir and drops its
  hold on the environment's shared mounts; a sandbox folder with no state file for a minute
  (`sandbox_state.remove_stub`);
- registrations with the node's provisioner of sandboxes that are gone (elastic.py), then
  containers of any installed OCI runtime (crun, runc) and cgroups under `/weenv/` with no
  sandbox folder (a crash between steps of create or destroy);
- upper dirs with no sandbox that were not kept on purpose, and trash left by a reset;
- parked sandboxes (parking.py) past their time or over a mount that no longer answers
  (`drop_parked`, which evictions of shared mounts also call first: a parked root holds them);
- shared mounts (mounts.py): holders whose sandbox is gone are dropped, a mount with no holder
  that is not kept warm, or whose daemon is dead, is unmounted, and idle mounts over the
  node's bounds are evicted.
A sandbox still being created or reset by a live owner is never touched.

Must not: remove a sandbox whose owner runs, or an upper kept with `--keep`.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field

from weenvfs.errors import UsageError, WeenvError

from . import cgroups, elastic, mounts, rootfs, sandbox, sandbox_state
from .cgroups import CGROUP_PARENT
from .launcher import Launcher
from .runtimes import installed_launchers
from .sandbox import KEPT_MARKER, UPPERS_ROOT, Sandbox, drop_parked

log = logging.getLogger(__name__)


@dataclass
class GcReport:
    """What one collection removed."""

    sandboxes: list[str] = field(default_factory=list)
    registrations: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    uppers: list[str] = field(default_factory=list)
    parked: list[str] = field(default_factory=list)
    holders: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, list[str]]:
        """A JSON-able dict (`weenv sandbox gc --json`)."""
        return asdict(self)

    @property
    def removed(self) -> int:
        """How many things were removed (errors not counted)."""
        return sum(len(v) for k, v in asdict(self).items() if k != "errors")


def is_orphan(box: Sandbox) -> bool:
    """Whether `box` has lost its owner; or, for a detached sandbox (no owner), its init."""
    owner = box.state.get("owner")
    if owner is not None:
        return not sandbox_state.owner_alive(owner)
    # A live owner deals with its own dead sandbox; a detached one has nobody else.
    return box.state.get("status") == "running" and box.launcher.status(box.id) != "running"


def collect(*, mounts_only: bool = False, launcher: Launcher | None = None) -> GcReport:
    """Find and remove orphans on this node (see the module docstring). `launcher`: the
    only runtime to look at (default: each sandbox's own, and every installed one's
    containers)."""
    sandbox.require_root()
    report = GcReport()
    report.parked.extend(drop_parked(expired_only=True))
    if not mounts_only:
        _sandboxes(report, launcher)
        report.registrations.extend(elastic.drop_orphans(sandbox_state.exists))
        for each in [launcher] if launcher else installed_launchers():
            _containers(report, each)
        _cgroups(report)
        _uppers(report)
    _env_mounts(report)
    if report.removed:
        log.info("gc removed %s", {k: v for k, v in report.to_json().items() if v})
    return report


def remove_orphans(ids: list[str]) -> GcReport:
    """Remove those of sandboxes `ids` that are orphans (sandbox.ownerless found them: the
    node service's housekeeping) and nothing else."""
    report = GcReport()
    _sandboxes(report, None, ids)
    if report.removed:
        log.info("housekeeping removed orphaned sandboxes %s", report.sandboxes)
    for error in report.errors:
        log.warning("%s", error)
    return report


def _sandboxes(report: GcReport, launcher: Launcher | None,
               ids: list[str] | None = None) -> None:
    for sandbox_id in sandbox_state.list_ids() if ids is None else ids:
        try:
            box = Sandbox.load(sandbox_id, launcher)
        except UsageError:  # removed meanwhile, or a folder without a state file
            if sandbox_state.remove_stub(sandbox_id):
                report.sandboxes.append(sandbox_id)
            continue
        except WeenvError as error:  # a state it cannot load (an error, not a reason to skip)
            report.errors.append(f"sandbox {sandbox_id}: {error}")
            continue
        if not is_orphan(box):
            continue
        try:
            box.destroy(keep_upper=bool(box.state.get("keep_upper")))
            report.sandboxes.append(sandbox_id)
        except (OSError, WeenvError) as error:
            report.errors.append(f"sandbox {sandbox_id}: {error}")


def _containers(report: GcReport, launcher: Launcher) -> None:
    for container in launcher.list_ids():
        if sandbox_state.exists(container):
            continue
        try:
            launcher.destroy(container)
            report.containers.append(container)
        except WeenvError as error:
            report.errors.append(f"container {container}: {error}")


def _cgroups(report: GcReport) -> None:
    for parent in cgroups.cgroup_dirs(f"/{CGROUP_PARENT}"):
        for child in sorted(p for p in parent.iterdir() if p.is_dir()):
            if sandbox_state.exists(child.name):
                continue
            removed = cgroups.remove_cgroup(f"/{CGROUP_PARENT}/{child.name}")
            report.cgroups.extend(str(p) for p in removed if str(p) not in report.cgroups)


def _uppers(report: GcReport) -> None:
    try:
        folders = sorted(UPPERS_ROOT.iterdir())
    except FileNotFoundError:
        return
    for folder in folders:
        name = folder.name
        kept = (folder / KEPT_MARKER).exists()
        if name.startswith(".trash-") or (not kept and not sandbox_state.exists(name)):
            if not name.startswith(".trash-") and rootfs.mounts_at(folder)[1]:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            report.uppers.append(str(folder))


def _env_mounts(report: GcReport) -> None:
    for mount in mounts.list_mounts():
        with mounts.locked(mount.key) as folder:
            stale = mounts.prune_holders(folder, sandbox_state.exists)
        report.holders.extend(f"{mount.key[:12]}/{h}" for h in stale)
        try:
            if mounts.expire(mount.key, sandbox_state.exists):
                report.mounts.append(mount.key)
        except (OSError, WeenvError) as error:
            report.errors.append(f"mount {mount.key[:12]}: {error}")
    try:
        report.mounts.extend(k for k in mounts.evict_idle(is_live=sandbox_state.exists)
                             if k not in report.mounts)
    except (OSError, WeenvError) as error:
        report.errors.append(f"evicting idle mounts: {error}")


def collect_after(seconds: float) -> GcReport:
    """Sleep, then collect expired environment mounts only (the keep-warm timer)."""
    with contextlib.suppress(KeyboardInterrupt):
        time.sleep(seconds)
    return collect(mounts_only=True)
