"""crun, the OCI runtime a sandbox uses where it is installed (runtimes.py chooses).

crun takes the same bundle, the same command line and the same seccomp profile as runc, and
is written in C: `exec` of `true` in a running sandbox takes ~12 ms against runc's ~38 ms on
this 2-core node, and a one-shot `run` ~27 ms against ~37 ms (docs/benchmarks.md). Most of
the difference is that crun compiles the seccomp filter once per sandbox (into its state
folder) where runc compiles it at every start and exec. An agent's rollout is a sandbox and
many execs, so this is per step, not per environment.

The one thing crun 1.8 (Debian 12) will not do is run on a hybrid cgroup host whose cgroup2
mount has controllers of its own ("cgroups in hybrid mode not supported"): v1 controllers
under /sys/fs/cgroup and a cgroup2 mount at /sys/fs/cgroup/unified that holds, say, hugetlb.
Such a host (this one) is still a v1 host for everything a sandbox uses, so crun runs there
in a mount namespace of its own without that mount (`unshare --mount --propagation slave`,
then `umount /sys/fs/cgroup/unified`): crun then sees a v1 host and manages the sandbox's
v1 cgroups as runc does, with the same paths. The namespace is crun's only (the container
gets a namespace of its own from crun's, with its own /sys); mounts made on the host later
still reach it (slave propagation), and nothing in it reaches the host. ~4 ms per call (an
`unshare` and a `sh`), paid only on such hosts.

Owns: `CrunLauncher`, `needs_private_cgroup_view`. Must not: choose between runtimes
(runtimes.py) or build the spec (launcher.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from weenvfs.errors import WeenvError

from .launcher import OciCliLauncher

CRUN_ROOT = Path("/run/weenv/crun")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNIFIED = CGROUP_ROOT / "unified"  # where a hybrid host mounts cgroup2 (systemd's layout)
TOOL_PATH = os.pathsep.join((os.environ.get("PATH", ""), "/usr/sbin:/usr/bin:/sbin:/bin"))
# `sh -c SCRIPT UNIFIED UMOUNT ARGV...`: SCRIPT drops the cgroup2 mount in this private
# namespace, then becomes ARGV (crun), so crun is the process its caller waits for and
# signals. Every program by its absolute path: the caller's PATH may lack them.
_DROP_UNIFIED = 'umount=$1; shift; "$umount" -l "$0" && exec "$@"'


def needs_private_cgroup_view(cgroup_root: Path = CGROUP_ROOT) -> bool:
    """Whether this host is hybrid with controllers on its cgroup2 mount (crun 1.8 refuses
    those): v1 hierarchies under `cgroup_root` and a cgroup2 mount at `unified` whose
    cgroup.controllers names any."""
    unified = cgroup_root / "unified"
    if not os.path.ismount(cgroup_root / "memory") or not os.path.ismount(unified):
        return False
    try:
        return bool((unified / "cgroup.controllers").read_text().split())
    except OSError:
        return False


class CrunLauncher(OciCliLauncher):
    """`crun` with its state under `root` (default CRUN_ROOT)."""

    name = "crun"
    default_root = CRUN_ROOT
    # `executable file `X` not found in $PATH: ...`, `open executable: Permission denied`
    cannot_start = "executable"

    def __init__(self, root: Path | None = None) -> None:
        super().__init__(root)
        self._prefix: list[str] = []
        if needs_private_cgroup_view():
            tools = [shutil.which(name, path=TOOL_PATH) for name in ("unshare", "sh", "umount")]
            if None in tools:
                raise WeenvError("crun on this hybrid cgroup host needs unshare, sh and umount "
                                 "(Debian util-linux, mount, dash)")
            unshare, sh, umount = (str(tool) for tool in tools)
            self._prefix = [unshare, "--mount", "--propagation", "slave", "--", sh, "-c",
                            _DROP_UNIFIED, str(UNIFIED), umount]

    def _base(self) -> list[str]:
        return [*self._prefix, self.binary, "--root", str(self.root)]

    def _init_record(self, sandbox_id: str) -> tuple[int, int]:
        state = json.loads((self.root / sandbox_id / "status").read_text())
        return int(state["pid"]), int(state["process-start-time"])
