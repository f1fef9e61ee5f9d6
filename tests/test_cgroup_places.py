"""Where this process's cgroups are (weenvfs/cgroup_places.py), and the runtime's priming
of the kernel's cgroup lock, which writes this process's pid into its own cgroup
(runtime/cgroups.py `prime_migrations`): it must find the cgroup each hierarchy really
holds it in, and moving "into" it must change nothing.

Real cgroup hierarchies of this node (v1 and the unified one, as mounted)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from weenvfs.cgroup_places import own_cgroups
from weenvfs.runtime import cgroups


def test_each_hierarchy_is_found_where_it_holds_this_process() -> None:
    found = own_cgroups()
    assert found, "no cgroup hierarchy of this process is mounted here"
    listed = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    assert {h for h, _, _ in found} <= {c or "cgroup2" for _, c, _ in listed}
    for hierarchy, root, where in found:
        procs = (root / where.lstrip("/") / "cgroup.procs").read_text().split()
        assert str(os.getpid()) in procs, hierarchy


def test_priming_moves_this_process_nowhere() -> None:
    before = Path("/proc/self/cgroup").read_text()
    primer = threading.Thread(target=cgroups._write_own_cgroup)  # what the thread runs
    primer.start()
    primer.join()
    assert Path("/proc/self/cgroup").read_text() == before
    cgroups.prime_migrations()  # and started in its own thread, as the runtime does
    assert Path("/proc/self/cgroup").read_text() == before


def test_the_node_service_leaves_the_cgroup_that_started_it(tmp_path: Path) -> None:
    """fuse/mountd.py `leave_caller_cgroups`, in a process started inside a cgroup of its
    own: it ends at the root of that hierarchy (the cgroup is removed after)."""
    hierarchy, root, _ = next(c for c in own_cgroups() if c[0] != "cgroup2")
    caller = root / f"weenv-test-{os.getpid()}"
    caller.mkdir()
    try:
        script = (f"import os; open({str(caller / 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
                  "from weenvfs.fuse.mountd import leave_caller_cgroups; leave_caller_cgroups();"
                  "print(open('/proc/self/cgroup').read())")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, timeout=60)
        lines = {c: where for _, c, where in (line.split(":", 2)
                                               for line in done.stdout.splitlines() if line)}
        assert lines[hierarchy] == "/"
    finally:
        caller.rmdir()
