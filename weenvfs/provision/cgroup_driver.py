"""The cgroup driver interface, the figures it reads and detection of the node's hierarchy.

Owns: `Sample` (one reading of a sandbox cgroup), `CgroupLimits` (what the policy asks for), `Write`
(one limit write, with the usage read just before it), `Cgroup` (a sandbox's directories),
`CgroupDriver` (the interface the v1 and v2 drivers implement), the provisioner's errors,
small parsers for cgroup files, and reading the node's hierarchies (`read_mounts`);
cgroup_detect.py picks the driver.
Must not: decide limits (policy.py) or loop (sidecar.py). Nothing here does I/O at import.

Every driver keeps one promise on its own, whatever the caller asks: it never writes a hard
memory limit below the usage it reads just before the write plus `guard` bytes (v1 refuses
such a write while it cannot reclaim, v2 kills to meet it). Such a value is raised to the
floor and the `Write` says so.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_GUARD = 8 * MIB
# v1 reports "no limit" as PAGE_COUNTER_MAX pages, which is just under 2**63.
V1_UNLIMITED_FROM = 1 << 62


class ProvisionError(Exception):
    """The provisioner failed."""

    exit_code = 1


class CgroupGone(ProvisionError):
    """The sandbox's cgroup no longer exists."""


class CgroupFileError(ProvisionError):
    """A cgroup file could not be parsed."""

    def __init__(self, path: Path | str, content: str, why: str) -> None:
        super().__init__(f"{path}: {why}: {content[:80]!r}")
        self.path = str(path)


class NoCgroups(ProvisionError):
    """This node has no usable cgroup hierarchy with memory and cpu controllers."""


@dataclass(frozen=True)
class CgroupLimits:
    """What the policy sets on one sandbox.

    `mem_high` is the elastic memory limit (v2 `memory.high`; on v1, where the hard limit holds
    tasks instead of killing them, it equals `mem_max`), `mem_max` the hard limit (v2
    `memory.max`, v1 `memory.limit_in_bytes`), `mem_soft` the v1 soft limit (global reclaim
    takes from sandboxes above it first; 0 leaves it alone), `cpu_millis` the CPU quota in
    thousandths of a core, `hold` (v1 only) makes tasks wait at the limit rather than be
    OOM-killed (`memory.oom_control`), so that the sidecar can raise it.
    """

    mem_high: int
    mem_max: int
    cpu_millis: int
    mem_soft: int = 0
    hold: bool = True

    def to_json(self) -> dict[str, object]:
        """A JSON-able dict (for the registry, the status file and the event log)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> CgroupLimits:
        """The inverse of `to_json`; raises ValueError on missing or ill-typed fields."""
        try:
            return cls(
                mem_high=int(data["mem_high"]),  # type: ignore[call-overload]
                mem_max=int(data["mem_max"]),  # type: ignore[call-overload]
                cpu_millis=int(data["cpu_millis"]),  # type: ignore[call-overload]
                mem_soft=int(data.get("mem_soft", 0)),  # type: ignore[call-overload]
                hold=bool(data.get("hold", True)),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"invalid limits {data!r}: {error}") from None


@dataclass(frozen=True)
class Sample:
    """One reading of a sandbox's cgroup; counters are cumulative since the cgroup was made.

    Limits in force read back from the kernel are None when unlimited. PSI stall totals
    (`*_stall_us`) exist on v2 only and are None on v1.
    """

    time: float  # time.monotonic() of the reading
    mem_usage: int  # bytes charged: v1 usage_in_bytes, v2 memory.current
    mem_cache: int = 0  # inactive file pages (reclaimable), for status only
    mem_limit: int | None = None  # hard limit in force: v1 limit_in_bytes, v2 memory.max
    mem_high: int | None = None  # v2 memory.high in force; v1: None
    mem_limit_hits: int = 0  # v1 memory.failcnt, v2 memory.events `max`
    mem_high_hits: int = 0  # v2 memory.events `high`; v1: 0
    oom_kills: int = 0  # v1 oom_control `oom_kill`, v2 memory.events `oom_kill`
    held: bool = False  # v1 oom_control `under_oom`: tasks wait for memory
    mem_stall_us: int | None = None  # v2 memory.pressure `some total`
    cpu_usage_us: int = 0  # v1 cpuacct.usage / 1000, v2 cpu.stat usage_usec
    cpu_throttled_us: int = 0  # v1 cpu.stat throttled_time / 1000, v2 throttled_usec
    cpu_throttled_periods: int = 0  # nr_throttled
    cpu_quota_millis: int | None = None  # quota in force, thousandths of a core
    cpu_stall_us: int | None = None  # v2 cpu.pressure `some total`

    def to_json(self) -> dict[str, object]:
        """A JSON-able dict of every field."""
        return asdict(self)


@dataclass(frozen=True)
class Write:
    """One file written by `CgroupDriver.apply`, with the memory usage read just before."""

    file: str
    value: str
    usage_before: int
    clamped: bool = False  # the asked value was raised to usage_before + guard

    def to_json(self) -> list[object]:
        """[file, value, usage_before, clamped] for the event log."""
        return [self.file, self.value, self.usage_before, self.clamped]


@dataclass(frozen=True)
class Cgroup:
    """A sandbox cgroup: its name relative to the hierarchy roots and its directories.

    v1: one directory per controller (`memory`, `cpu`, `cpuacct`); v2: `unified` only.
    """

    name: str
    dirs: Mapping[str, Path] = field(hash=False)

    def paths(self) -> list[str]:
        """Every directory as a string, deduplicated (for the registry)."""
        return sorted({str(p) for p in self.dirs.values()})


class CgroupDriver(ABC):
    """One cgroup hierarchy version; every method is synchronous and thread-safe.

    Reads are cheap kernel calls made from the watching loop; `apply` may block while the
    kernel reclaims memory, so callers run it in a thread.
    """

    version: int
    guard: int = DEFAULT_GUARD

    @abstractmethod
    def resolve(self, paths: Sequence[str]) -> Cgroup:
        """The cgroup named by absolute directories or by one name relative to the roots."""

    @abstractmethod
    def create(self, name: str) -> Cgroup:
        """Make the cgroup `name` (relative, containing 'weenv') in every hierarchy."""

    @abstractmethod
    def remove(self, cgroup: Cgroup) -> None:
        """Remove the cgroup's directories (it must have no tasks left); gone ones are fine."""

    @abstractmethod
    def attach(self, cgroup: Cgroup, pid: int) -> None:
        """Move process `pid` into the cgroup."""

    @abstractmethod
    def pids(self, cgroup: Cgroup) -> list[int]:
        """The processes in the cgroup (of its memory hierarchy on v1)."""

    @abstractmethod
    def read(self, cgroup: Cgroup) -> Sample:
        """Read the sandbox's figures; CgroupGone if it vanished, CgroupFileError if garbled."""

    @abstractmethod
    def apply(self, cgroup: Cgroup, limits: CgroupLimits) -> list[Write]:
        """Write `limits` (only what differs from the files), in a safe order; may block."""

    def exists(self, cgroup: Cgroup) -> bool:
        """Whether every directory of the cgroup still exists."""
        return all(path.is_dir() for path in cgroup.dirs.values())

    def describe(self) -> str:
        """One line for logs and `provision status`."""
        return f"cgroup v{self.version}"


# --- file helpers shared by both drivers ----------------------------------------------------


def read_text(path: Path) -> str:
    """A cgroup file's text; CgroupGone when the file or its cgroup disappeared."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except (FileNotFoundError, ProcessLookupError) as error:
        raise CgroupGone(f"{path.parent} is gone ({error.strerror})") from None
    except OSError as error:
        # ENODEV: the cgroup was removed while the file was open.
        if error.errno == errno.ENODEV:
            raise CgroupGone(f"{path.parent} is gone ({error.strerror})") from None
        raise


def parse_int(path: Path, text: str) -> int:
    """A file holding one integer."""
    try:
        return int(text.strip())
    except ValueError:
        raise CgroupFileError(path, text, "expected an integer") from None


def parse_keyed(path: Path, text: str) -> dict[str, int]:
    """`key value` lines (memory.stat, cpu.stat, memory.events, oom_control)."""
    result: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise CgroupFileError(path, line, "expected 'key value' lines")
        try:
            result[parts[0]] = int(parts[1])
        except ValueError:
            raise CgroupFileError(path, line, "expected an integer value") from None
    return result


def parse_psi_total(path: Path, text: str) -> int:
    """The `some ... total=N` stall time (microseconds) of a PSI file."""
    for line in text.splitlines():
        if line.startswith("some "):
            for item in line.split()[1:]:
                key, _, value = item.partition("=")
                if key == "total" and value.isdigit():
                    return int(value)
    raise CgroupFileError(path, text, "expected a 'some ... total=N' line")


def write_text(path: Path, value: str) -> None:
    """Write one value to a cgroup file; CgroupGone if the cgroup disappeared."""
    try:
        with open(path, "w", encoding="ascii") as handle:
            handle.write(value)
    except FileNotFoundError:
        raise CgroupGone(f"{path.parent} is gone") from None


def guarded(value: int, usage: int, guard: int) -> tuple[int, bool]:
    """`value`, raised to `usage + guard` if it is below; and whether it was raised."""
    floor = usage + guard
    return (value, False) if value >= floor else (floor, True)


def check_name(name: str) -> str:
    """A relative cgroup name the drivers may create (containing 'weenv', so leftovers show)."""
    clean = name.strip("/")
    if "weenv" not in clean.lower() or ".." in clean.split("/") or not clean:
        raise ProvisionError(f"cgroup name {name!r} must be relative and contain 'weenv'")
    return clean


def remove_dirs(dirs: Sequence[Path]) -> None:
    """rmdir each directory, deepest first; a missing one is fine, a busy one is retried."""
    for path in dirs:
        for attempt in range(50):
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError as error:
                # EBUSY right after the last task exits: the kernel is still tearing it down.
                if error.errno != errno.EBUSY or attempt == 49:
                    raise ProvisionError(f"cannot remove {path}: {error.strerror}") from None
                time.sleep(0.02)


# --- detection --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mounts:
    """Cgroup mount points: v1 controller -> directory, and cgroup2 mounts."""

    v1: Mapping[str, Path]
    v2: tuple[Path, ...]


V1_CONTROLLERS = ("memory", "cpu", "cpuacct")


def read_mounts(mounts_file: str = "/proc/self/mounts") -> Mounts:
    """Parse the mount table for cgroup v1 controllers and cgroup2 mounts."""
    v1: dict[str, Path] = {}
    v2: list[Path] = []
    with open(mounts_file, encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            if len(fields) < 4:
                continue
            point = Path(fields[1].replace("\\040", " "))
            if fields[2] == "cgroup2":
                v2.append(point)
            elif fields[2] == "cgroup":
                for option in fields[3].split(","):
                    if option in V1_CONTROLLERS:
                        v1.setdefault(option, point)
    return Mounts(v1, tuple(v2))


def v2_controllers(root: Path) -> set[str]:
    """Controllers a cgroup2 root offers (empty when all are bound to v1 hierarchies)."""
    try:
        return set((root / "cgroup.controllers").read_text(encoding="ascii").split())
    except OSError:
        return set()
