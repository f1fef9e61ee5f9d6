"""The cgroup v2 driver: one unified hierarchy.

Owns: reading a sandbox's figures from v2 files and writing its limits to them.
Files read: memory.current, memory.high, memory.max, memory.events, memory.stat,
memory.pressure, cpu.max, cpu.stat, cpu.pressure (PSI files are optional: None if absent).
Files written: memory.high (the elastic knob: past it the kernel reclaims and throttles, it
never kills), memory.max (the safety net: past it the OOM killer runs), cpu.max.
Must not: decide values (policy.py). The root may be a real cgroup2 mount or a folder holding
the same files (tests); nothing here assumes which.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from .cgroup_driver import (
    Cgroup,
    CgroupDriver,
    CgroupFileError,
    CgroupGone,
    CgroupLimits,
    ProvisionError,
    Sample,
    Write,
    check_name,
    guarded,
    parse_int,
    parse_keyed,
    parse_psi_total,
    read_text,
    remove_dirs,
    write_text,
)

log = logging.getLogger(__name__)

DEFAULT_PERIOD_US = 100_000
MIN_QUOTA_US = 1000


def parse_max(path: Path, text: str) -> int | None:
    """memory.high / memory.max: bytes, or None for `max`."""
    return None if text.strip() == "max" else parse_int(path, text)


def parse_cpu_max(path: Path, text: str) -> tuple[int | None, int]:
    """cpu.max `QUOTA PERIOD` (QUOTA may be `max`): (quota or None, period)."""
    parts = text.split()
    if len(parts) != 2 or not parts[1].isdigit() or not (parts[0] == "max" or parts[0].isdigit()):
        raise CgroupFileError(path, text, "expected 'QUOTA PERIOD'")
    return (None if parts[0] == "max" else int(parts[0])), int(parts[1])


class CgroupV2Driver(CgroupDriver):
    """Driver for a cgroup2 hierarchy rooted at `root`."""

    version = 2

    def __init__(self, root: Path | str, *, guard: int | None = None) -> None:
        self.root = Path(root)
        if guard is not None:
            self.guard = guard

    def describe(self) -> str:
        """One line naming the root."""
        return f"cgroup v2 ({self.root})"

    def resolve(self, paths: Sequence[str]) -> Cgroup:
        """The cgroup named by its absolute directory or by a name relative to the root."""
        if len(paths) != 1:
            raise ProvisionError(f"cgroup v2 needs one directory, got {list(paths)}")
        candidate = Path(paths[0])
        if candidate.is_absolute():
            if self.root not in candidate.parents:
                raise ProvisionError(f"{candidate} is not inside {self.root}")
            name = str(candidate.relative_to(self.root))
        else:
            name = str(candidate).strip("/")
        if name in ("", "."):
            raise ProvisionError("the root cgroup cannot be a sandbox")
        return Cgroup(name, {"unified": self.root / name})

    def create(self, name: str) -> Cgroup:
        """mkdir the cgroup, enabling memory and cpu in each ancestor's subtree_control."""
        cgroup = self.resolve([check_name(name)])
        path = cgroup.dirs["unified"]
        for ancestor in reversed(path.parents):
            if ancestor == self.root or self.root in ancestor.parents:
                ancestor.mkdir(exist_ok=True)
                self._enable_controllers(ancestor)
        path.mkdir(exist_ok=True)
        return cgroup

    def _enable_controllers(self, path: Path) -> None:
        control = path / "cgroup.subtree_control"
        if not control.exists():
            return  # a folder of files standing in for a hierarchy
        enabled = set(read_text(control).split())
        # Only what this level offers: controllers bound to v1 are absent from cgroup.controllers
        # and cannot be enabled here (the sandbox then lacks their files; `read` says so).
        offered = set(read_text(path / "cgroup.controllers").split())
        missing = [name for name in ("memory", "cpu") if name in offered - enabled]
        if missing:
            try:
                write_text(control, " ".join(f"+{name}" for name in missing))
            except OSError as error:
                raise ProvisionError(f"cannot enable {missing} in {control}: {error}") from None

    def remove(self, cgroup: Cgroup) -> None:
        """rmdir the cgroup."""
        remove_dirs([cgroup.dirs["unified"]])

    def attach(self, cgroup: Cgroup, pid: int) -> None:
        """Move `pid` into the cgroup."""
        write_text(cgroup.dirs["unified"] / "cgroup.procs", str(pid))

    def pids(self, cgroup: Cgroup) -> list[int]:
        """Processes in the cgroup."""
        path = cgroup.dirs["unified"] / "cgroup.procs"
        return [parse_int(path, line) for line in read_text(path).split()]

    def _text(self, cgroup: Cgroup, name: str) -> tuple[Path, str]:
        path = cgroup.dirs["unified"] / name
        try:
            return path, read_text(path)
        except CgroupGone:
            if path.parent.is_dir():  # the cgroup is there, the file is not
                raise CgroupFileError(path, "", "missing (is its controller enabled?)") from None
            raise

    def _optional_psi(self, cgroup: Cgroup, name: str) -> int | None:
        path = cgroup.dirs["unified"] / name
        if not path.exists():
            if not cgroup.dirs["unified"].is_dir():
                raise CgroupGone(f"{cgroup.dirs['unified']} is gone")
            return None  # kernel without PSI
        return parse_psi_total(path, read_text(path))

    def read(self, cgroup: Cgroup) -> Sample:
        """Read every figure the policy uses; CgroupGone / CgroupFileError on trouble."""
        now = time.monotonic()
        events = parse_keyed(*self._text(cgroup, "memory.events"))
        stat = parse_keyed(*self._text(cgroup, "memory.stat"))
        cpu_stat = parse_keyed(*self._text(cgroup, "cpu.stat"))
        quota, period = parse_cpu_max(*self._text(cgroup, "cpu.max"))
        return Sample(
            time=now,
            mem_usage=parse_int(*self._text(cgroup, "memory.current")),
            mem_cache=stat.get("inactive_file", 0),
            mem_limit=parse_max(*self._text(cgroup, "memory.max")),
            mem_high=parse_max(*self._text(cgroup, "memory.high")),
            mem_limit_hits=events.get("max", 0),
            mem_high_hits=events.get("high", 0),
            oom_kills=events.get("oom_kill", 0),
            mem_stall_us=self._optional_psi(cgroup, "memory.pressure"),
            cpu_usage_us=cpu_stat.get("usage_usec", 0),
            cpu_throttled_us=cpu_stat.get("throttled_usec", 0),
            cpu_throttled_periods=cpu_stat.get("nr_throttled", 0),
            cpu_quota_millis=None if quota is None or period <= 0 else quota * 1000 // period,
            cpu_stall_us=self._optional_psi(cgroup, "cpu.pressure"),
        )

    def apply(self, cgroup: Cgroup, limits: CgroupLimits) -> list[Write]:
        """Write what differs: memory.max and memory.high in a safe order, then cpu.max.

        Raising writes max before high and lowering high before max, so high <= max holds
        between the writes. Neither is ever lowered below usage + guard.
        """
        path_max, text = self._text(cgroup, "memory.max")
        current_max = parse_max(path_max, text)
        order = ("memory.max", "memory.high")
        if current_max is not None and limits.mem_max < current_max:
            order = ("memory.high", "memory.max")
        wanted = {"memory.max": limits.mem_max, "memory.high": limits.mem_high}
        writes = [w for name in order if (w := self._write_mem(cgroup, name, wanted[name]))]
        path_cpu, text = self._text(cgroup, "cpu.max")
        quota, period = parse_cpu_max(path_cpu, text)
        period = period or DEFAULT_PERIOD_US
        new_quota = None
        if limits.cpu_millis > 0:
            new_quota = max(MIN_QUOTA_US, limits.cpu_millis * period // 1000)
        if new_quota != quota:
            value = f"{'max' if new_quota is None else new_quota} {period}"
            writes.append(self._write(path_cpu, value, self._usage(cgroup)))
        return writes

    def _usage(self, cgroup: Cgroup) -> int:
        return parse_int(*self._text(cgroup, "memory.current"))

    def _write_mem(self, cgroup: Cgroup, name: str, wanted: int) -> Write | None:
        path, text = self._text(cgroup, name)
        if parse_max(path, text) == wanted:
            return None
        usage = self._usage(cgroup)
        value, clamped = guarded(wanted, usage, self.guard)
        if parse_max(path, text) == value:
            return None
        return self._write(path, str(value), usage, clamped)

    def _write(self, path: Path, value: str, usage: int, clamped: bool = False) -> Write:
        try:
            write_text(path, value)
        except OSError as error:
            raise ProvisionError(f"writing {value} to {path}: {error.strerror}") from None
        return Write(path.name, value, usage, clamped)
