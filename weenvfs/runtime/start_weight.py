"""A starting sandbox's CPU weight: the highest while the runtime starts its init, then the
default.

Every sandbox's cgroup is a child of one `weenv` cgroup, so the sandboxes share their CPU
among themselves by weight, and the runtime's part of a start that runs inside the new
cgroup (the init's namespaces, mounts, root and exec: a few ms of CPU) got 1/N of it next to
N busy sandboxes. On a node where others run their workloads, a start then took several
times as long as on an idle one (32 environments opened at once on two CPUs, with the first
ones' workloads running: 0.7-0.8 s from the overlay to the started init, against 0.3-0.5 s
when they did not run yet), and that is the environment's time in an RL iteration, not the
task's. So the start asks the runtime for the highest weight (`boosted`: OCI `cpu.shares`,
which runc and crun write as v1's `cpu.shares` or v2's `cpu.weight`), and once the init runs,
before any command of the sandbox does, `settle` writes the default back: the sandbox's own
processes always run at the weight every other sandbox has. No user code runs at the high
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

from dataclasses import replace
from pathlib import Path

from weenvfs.errors import WeenvError

from .cgroups import CGROUP_PARENT, cgroup_dirs
from .launcher import CgroupSpec

START_SHARES = 262144  # v1's highest cpu.shares; runc and crun map it to v2's 10000
DEFAULT_SHARES = 1024  # v1's default cpu.shares
DEFAULT_WEIGHT = 100  # v2's default cpu.weight
UNIFIED_ROOT = Path("/sys/fs/cgroup")


def boosted(spec: CgroupSpec, mounts_file: str = "/proc/self/mounts") -> CgroupSpec:
    """`spec` asking for the highest CPU weight, where the runtime can write one (else, or
    when the hook set `cpu.shares` itself, `spec` as it is)."""
    cpu = spec.resources.get("cpu", {})
    if "shares" in cpu or not can_weigh(mounts_file):
        return spec
    return replace(spec, resources={**spec.resources, "cpu": {**cpu, "shares": START_SHARES}})


def can_weigh(mounts_file: str = "/proc/self/mounts", unified_root: Path = UNIFIED_ROOT) -> bool:
    """Whether a sandbox's cgroup gets a CPU weight the runtime writes: a v1 hierarchy with
    the `cpu` controller, or a v2 mount at /sys/fs/cgroup whose `weenv` cgroup hands `cpu` on."""
    with open(mounts_file, encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 4:
                continue
            if fields[2] == "cgroup" and "cpu" in fields[3].split(","):
                return True
            if fields[2] == "cgroup2" and fields[1] == str(unified_root):
                return _hands_on_cpu(unified_root / CGROUP_PARENT)
    return False


def _hands_on_cpu(folder: Path) -> bool:
    try:
        return "cpu" in (folder / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


def settle(path: str) -> None:
    """After the init of a `boosted` start runs: the default weight in cgroup `path`. A
    cgroup gone meanwhile (the init died) is left to the teardown; a weight that cannot be
    written back fails the start (WeenvError) rather than leave the sandbox above the others."""
    for folder in cgroup_dirs(path):
        for name, value in (("cpu.shares", DEFAULT_SHARES), ("cpu.weight", DEFAULT_WEIGHT)):
            target = folder / name
            if not target.exists():  # not this hierarchy's file (cgroupfs refuses to make one)
                continue
            try:
                target.write_text(f"{value}\n")
            except FileNotFoundError:
                continue  # the cgroup is gone
            except OSError as error:
                raise WeenvError(f"could not set the CPU weight of cgroup {path} back to "
                                 f"the default: {error}") from None
