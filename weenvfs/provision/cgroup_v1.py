"""The cgroup v1 driver: separate memory, cpu and cpuacct hierarchies.

Owns: reading a sandbox's figures from v1 files and writing its limits to them.
Files read: memory.usage_in_bytes, memory.limit_in_bytes, memory.failcnt, memory.oom_control,
memory.stat, cpuacct.usage, cpu.stat, cpu.cfs_quota_us, cpu.cfs_period_us.
Files written: memory.limit_in_bytes (hard limit), memory.soft_limit_in_bytes, memory.oom_control
(`hold`: with oom_kill_disable=1 a task that hits the limit waits, `under_oom` shows it, and
raising the limit wakes it: v1's stand-in for v2's memory.high), cpu.cfs_quota_us.
Must not: decide values (policy.py). v1 has no per-cgroup PSI, so stall totals are None.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .cgroup_driver import (
    V1_CONTROLLERS,
    V1_UNLIMITED_FROM,
    Cgroup,
    CgroupDriver,
    CgroupLimits,
    ProvisionError,
    Sample,
    Write,
    check_name,
    guarded,
    parse_int,
    parse_keyed,
    read_text,
    remove_dirs,
    write_text,
)

log = logging.getLogger(__name__)

MIN_QUOTA_US = 1000  # the kernel refuses smaller CFS quotas


def quota_us(cpu_millis: int, period_us: int) -> int:
    """The CFS quota for `cpu_millis` thousandths of a core; -1 (unlimited) for 0 or less."""
    return -1 if cpu_millis <= 0 else max(MIN_QUOTA_US, cpu_millis * period_us // 1000)


class CgroupV1Driver(CgroupDriver):
    """Driver for v1 hierarchies given as controller -> mount point."""

    version = 1

    def __init__(self, roots: Mapping[str, Path | str], *, guard: int | None = None) -> None:
        missing = [name for name in V1_CONTROLLERS if name not in roots]
        if missing:
            raise ProvisionError(f"cgroup v1 controllers not mounted: {missing}")
        self.roots = {name: Path(roots[name]) for name in V1_CONTROLLERS}
        if guard is not None:
            self.guard = guard

    def describe(self) -> str:
        """One line naming the mount points."""
        where = ", ".join(f"{name}={root}" for name, root in self.roots.items())
        return f"cgroup v1 ({where})"

    def _name_of(self, path: str) -> str:
        candidate = Path(path)
        if not candidate.is_absolute():
            return str(candidate).strip("/")
        for root in self.roots.values():
            if root in candidate.parents:
                return str(candidate.relative_to(root))
        raise ProvisionError(f"{path} is not inside a cgroup v1 hierarchy ({self.describe()})")

    def resolve(self, paths: Sequence[str]) -> Cgroup:
        """The cgroup named by absolute directories or by one name relative to the roots."""
        names = {self._name_of(path) for path in paths}
        if len(names) != 1 or "" in names or "." in names:
            raise ProvisionError(f"{list(paths)} do not name one non-root cgroup")
        name = names.pop()
        return Cgroup(name, {ctl: root / name for ctl, root in self.roots.items()})

    def create(self, name: str) -> Cgroup:
        """mkdir the cgroup in the memory, cpu and cpuacct hierarchies (parents too)."""
        cgroup = self.resolve([check_name(name)])
        for path in cgroup.dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        return cgroup

    def remove(self, cgroup: Cgroup) -> None:
        """rmdir the cgroup in every hierarchy."""
        remove_dirs(list(cgroup.dirs.values()))

    def attach(self, cgroup: Cgroup, pid: int) -> None:
        """Move `pid` into the cgroup in every hierarchy."""
        for path in cgroup.dirs.values():
            write_text(path / "cgroup.procs", str(pid))

    def pids(self, cgroup: Cgroup) -> list[int]:
        """Processes in the memory hierarchy's cgroup."""
        path = cgroup.dirs["memory"] / "cgroup.procs"
        return [parse_int(path, line) for line in read_text(path).split()]

    def _int(self, cgroup: Cgroup, controller: str, name: str) -> int:
        path = cgroup.dirs[controller] / name
        return parse_int(path, read_text(path))

    def _keyed(self, cgroup: Cgroup, controller: str, name: str) -> dict[str, int]:
        path = cgroup.dirs[controller] / name
        return parse_keyed(path, read_text(path))

    def read(self, cgroup: Cgroup) -> Sample:
        """Read every figure the policy uses; CgroupGone / CgroupFileError on trouble."""
        now = time.monotonic()
        limit = self._int(cgroup, "memory", "memory.limit_in_bytes")
        oom = self._keyed(cgroup, "memory", "memory.oom_control")
        stat = self._keyed(cgroup, "memory", "memory.stat")
        cpu_stat = self._keyed(cgroup, "cpu", "cpu.stat")
        quota = self._int(cgroup, "cpu", "cpu.cfs_quota_us")
        period = self._int(cgroup, "cpu", "cpu.cfs_period_us")
        return Sample(
            time=now,
            mem_usage=self._int(cgroup, "memory", "memory.usage_in_bytes"),
            mem_cache=stat.get("total_inactive_file", stat.get("inactive_file", 0)),
            mem_limit=None if limit >= V1_UNLIMITED_FROM else limit,
            mem_limit_hits=self._int(cgroup, "memory", "memory.failcnt"),
            oom_kills=oom.get("oom_kill", 0),
            held=bool(oom.get("under_oom", 0)),
            cpu_usage_us=self._int(cgroup, "cpuacct", "cpuacct.usage") // 1000,
            cpu_throttled_us=cpu_stat.get("throttled_time", 0) // 1000,
            cpu_throttled_periods=cpu_stat.get("nr_throttled", 0),
            cpu_quota_millis=None if quota < 0 or period <= 0 else quota * 1000 // period,
        )

    def apply(self, cgroup: Cgroup, limits: CgroupLimits) -> list[Write]:
        """Write what differs: oom hold, hard limit (never below usage + guard), soft, quota."""
        writes: list[Write] = []
        memory = cgroup.dirs["memory"]
        hold = "1" if limits.hold else "0"
        if str(self._keyed(cgroup, "memory", "memory.oom_control").get("oom_kill_disable")) != hold:
            writes.append(self._write(memory / "memory.oom_control", hold, cgroup))
        current = self._int(cgroup, "memory", "memory.limit_in_bytes")
        if limits.mem_max != current:
            usage = self._int(cgroup, "memory", "memory.usage_in_bytes")
            value, clamped = guarded(limits.mem_max, usage, self.guard)
            # A clamped value may even exceed the current limit: usage grew since the sample,
            # and raising is then the right thing anyway.
            if value != current:
                path = memory / "memory.limit_in_bytes"
                writes.append(self._write(path, str(value), cgroup, usage=usage, clamped=clamped))
        soft = min(limits.mem_soft, limits.mem_max)
        if soft > 0 and soft != self._int(cgroup, "memory", "memory.soft_limit_in_bytes"):
            writes.append(self._write(memory / "memory.soft_limit_in_bytes", str(soft), cgroup))
        period = self._int(cgroup, "cpu", "cpu.cfs_period_us")
        quota = quota_us(limits.cpu_millis, period)
        if quota != self._int(cgroup, "cpu", "cpu.cfs_quota_us"):
            writes.append(self._write(cgroup.dirs["cpu"] / "cpu.cfs_quota_us", str(quota), cgroup))
        return writes

    def _write(
        self,
        path: Path,
        value: str,
        cgroup: Cgroup,
        *,
        usage: int | None = None,
        clamped: bool = False,
    ) -> Write:
        if usage is None:
            usage = self._int(cgroup, "memory", "memory.usage_in_bytes")
        try:
            write_text(path, value)
        except OSError as error:
            raise ProvisionError(f"writing {value} to {path}: {error.strerror}") from None
        return Write(path.name, value, usage, clamped)
