"""A starting sandbox's CPU weight: the highest while the runtime starts its init, then the
default.

Every sandbox's cgroup is a child of one `weenv` cgroup, so the sandboxes share their CPU
among themselves by weight, and the runtime's part of a start that runs inside the new
cgroup (the init's namespaces, mounts, root and exec: a few ms of CPU) got 1/N of it next to
N busy sandboxes. On a node where others run their workloads, a start then took several
times as long as on an idle one (32 environments opened at once on two CPUs, with the first
ones' workloads running: 0.7-0.8 s from the overlay to the started init, against 0.3-0.5 s
when they did not run yet), and that is the environment's time in an RL iteration, not the
task's. So the start asks the runtime for the highest weight (`boost`: OCI `cpu.shares`,
which runc and crun write as v1's `cpu.shares` or v2's `cpu.weight`), and once the init runs,
before any command of the sandbox does, `settle` writes the default back into the one file
`boost` named (one look at the mount table per start): the sandbox's own processes always
run at the weight every other sandbox has. No user code runs at the high
weight: the init is the runtime's (`catatonit -P`), and a `weenv run`'s one-shot start, whose
init starts the command at once (`catatonit -- COMMAND`), is not boosted (sandbox.py uses
this in `_start` only).

Only where the runtime can write the weight: a v1 `cpu` hierarchy, or a v2 one whose
`weenv` cgroup hands the `cpu` controller to its children already (the first sandbox of a
v2 node starts at the default). Elsewhere the spec is left as it is. A `cpu.shares` the
cgroup hook asked for itself is kept. An elastic sandbox's weight among the others is its
provisioner cgroup's (elastic.py), which this leaves alone: only runc's child below it, its
one child, is boosted.

Must not: choose limits (cgroups.py `Limits`) or start anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from weenvfs.errors import WeenvError

from .cgroups import CGROUP_PARENT
from .launcher import CgroupSpec

START_SHARES = 262144  # v1's highest cpu.shares; runc and crun map it to v2's 10000
DEFAULT_SHARES = 1024  # v1's default cpu.shares
DEFAULT_WEIGHT = 100  # v2's default cpu.weight
UNIFIED_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Boost:
    """A start at the highest weight: the cgroup spec the runtime starts the init with, and
    the file (and value) `settle` writes the default back into once the init runs."""

    spec: CgroupSpec
    weight_file: Path
    default: int


def boost(spec: CgroupSpec, mounts_file: str = "/proc/self/mounts",
          unified_root: Path = UNIFIED_ROOT) -> Boost | None:
    """`spec` asking for the highest CPU weight, where the runtime can write one; None where
    it cannot, or when the hook set `cpu.shares` itself."""
    cpu = spec.resources.get("cpu", {})
    if "shares" in cpu:
        return None
    place = _weight_file(spec.path, mounts_file, unified_root)
    if place is None:
        return None
    boosted = replace(spec, resources={**spec.resources, "cpu": {**cpu, "shares": START_SHARES}})
    return Boost(boosted, *place)


def _weight_file(path: str, mounts_file: str, unified_root: Path) -> tuple[Path, int] | None:
    """Where cgroup `path`'s weight lives and its default: a v1 hierarchy with the `cpu`
    controller (`cpu.shares`), or a v2 mount at /sys/fs/cgroup whose `weenv` cgroup hands
    `cpu` on (`cpu.weight`); None elsewhere."""
    with open(mounts_file, encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 4:
                continue
            if fields[2] == "cgroup" and "cpu" in fields[3].split(","):
                return Path(fields[1]) / path.lstrip("/") / "cpu.shares", DEFAULT_SHARES
            if fields[2] == "cgroup2" and fields[1] == str(unified_root):
                if not _hands_on_cpu(unified_root / CGROUP_PARENT):
                    return None
                return unified_root / path.lstrip("/") / "cpu.weight", DEFAULT_WEIGHT
    return None


def _hands_on_cpu(folder: Path) -> bool:
    try:
        return "cpu" in (folder / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


def settle(done: Boost) -> None:
    """After the init of a `boost`ed start runs: the default weight back in its cgroup. A
    cgroup gone meanwhile (the init died) is left to the teardown; a weight that cannot be
    written back fails the start (WeenvError) rather than leave the sandbox above the others."""
    try:
        done.weight_file.write_text(f"{done.default}\n")
    except FileNotFoundError:
        pass  # the cgroup is gone
    except OSError as error:
        raise WeenvError(f"could not set the CPU weight of cgroup {done.spec.path} back to "
                         f"the default: {error}") from None
