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
still reach it (slave propagation), and nothing in it reaches the host. One small program
does all of it where installed (native/weenv-cgroup-view.c, which setup.sh builds: ~1.5 ms
per call); else `unshare`, `sh` and `umount` do (~4 ms). Paid only on such hosts.

crun is also given each sandbox's seccomp filter compiled, from a probe it compiled it into
once per profile and boot (crun_seccomp.py): ~10 ms less per start; and it runs from a sealed
copy of itself in memory (crun_binary.py), which spares it the copy of itself and second exec
it otherwise makes at every call against CVE-2019-5736: ~1.7 ms less per run, exec and delete.

Owns: `CrunLauncher`, `needs_private_cgroup_view`. Must not: choose between runtimes
(runtimes.py) or build the spec (launcher.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weenvfs import native_programs
from weenvfs.errors import WeenvError

from . import crun_binary, crun_seccomp
from .launcher import COMMAND_TIMEOUT, LaunchSpec, OciCliLauncher, init_binary, kill_recorded

log = logging.getLogger(__name__)

CRUN_ROOT = Path("/run/weenv/crun")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNIFIED = CGROUP_ROOT / "unified"  # where a hybrid host mounts cgroup2 (systemd's layout)
VIEW_HELPER = "weenv-cgroup-view"  # native/weenv-cgroup-view.c: the namespace in one program
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
            helper = native_programs.find(VIEW_HELPER, path=TOOL_PATH)
            if helper is not None:
                self._prefix = [helper, str(UNIFIED)]
                return
            tools = [shutil.which(name, path=TOOL_PATH) for name in ("unshare", "sh", "umount")]
            if None in tools:
                raise WeenvError("crun on this hybrid cgroup host needs unshare, sh and umount "
                                 "(Debian util-linux, mount, dash)")
            unshare, sh, umount = (str(tool) for tool in tools)
            self._prefix = [unshare, "--mount", "--propagation", "slave", "--", sh, "-c",
                            _DROP_UNIFIED, str(UNIFIED), umount]

    def _base(self, program: str | None = None) -> list[str]:
        return [*self._prefix, *super()._base(program)]

    def _program(self) -> tuple[str | None, tuple[int, ...]]:
        copy = crun_binary.sealed_copy(self.binary)
        return (None, ()) if copy is None else (f"/proc/self/fd/{copy}", (copy,))

    def _init_record(self, sandbox_id: str) -> tuple[int, int]:
        return _status_record(self.root / sandbox_id)

    def _config(self, spec: LaunchSpec) -> dict[str, Any]:
        config = super()._config(spec)
        if spec.seccomp is None:
            return config
        program = self._compiled(spec.seccomp)
        return config if program is None else crun_seccomp.annotate(config, program)

    def _compiled(self, seccomp: Mapping[str, Any]) -> bytes | None:
        """crun's program of `seccomp`: kept from an earlier sandbox, else compiled now by a
        probe and kept; None when a probe failed (crun then compiles it at the start)."""
        try:
            key = crun_seccomp.cache_key(seccomp, self.binary)
        except OSError:
            return None
        program = crun_seccomp.cached(key)
        if program is not None or crun_seccomp.failed_before(key):
            return program
        program = self._probe(seccomp)
        crun_seccomp.keep(key, program)
        return program

    def _probe(self, seccomp: Mapping[str, Any]) -> bytes | None:
        """Have crun compile `seccomp` into a container that is created, never started, then
        killed and forgotten (crun_seccomp.py); its program, or None (logged) if it failed."""
        try:
            crun_seccomp.CACHE_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(dir=crun_seccomp.CACHE_ROOT, prefix="probe-"))
        except OSError as error:
            log.info("cannot compile the seccomp filter ahead: %s", error)
            return None
        state = folder / "state" / "probe"
        try:
            (folder / "rootfs" / "dev").mkdir(parents=True)
            (folder / "config.json").write_text(
                json.dumps(crun_seccomp.probe_config(seccomp, init_binary())))
            argv = [*self._prefix, self.binary, "--root", str(state.parent),
                    "--cgroup-manager=disabled", "create", "--bundle", str(folder), state.name]
            # The created init keeps crun's stdout and stderr open: a file, not a pipe.
            with open(folder / "probe.log", "wb") as output:
                code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=output,
                                      stderr=output, timeout=COMMAND_TIMEOUT,
                                      check=False).returncode
            if code != 0:
                message = (folder / "probe.log").read_text(errors="replace").strip()
                log.info("crun could not compile the seccomp filter ahead: %s", message)
                return None
            program = (state / "seccomp.bpf").read_bytes()
            return program if crun_seccomp.valid(program) else None
        except (OSError, subprocess.SubprocessError, WeenvError) as error:
            log.info("cannot compile the seccomp filter ahead: %s", error)
            return None
        finally:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # no init
                kill_recorded(*_status_record(state))
            shutil.rmtree(folder, ignore_errors=True)


def _status_record(state: Path) -> tuple[int, int]:
    """The init's pid and start time from crun's state folder of a container."""
    status = json.loads((state / "status").read_text())
    return int(status["pid"]), int(status["process-start-time"])
