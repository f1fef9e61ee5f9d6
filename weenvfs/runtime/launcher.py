"""The one interface between a sandbox and the program that isolates it: an OCI runtime.

Owns: `ProcessSpec` (what runs: argv, env, cwd, uid/gid/groups), `CgroupSpec` (the cgroup path
and the OCI resources the runtime applies), `LaunchSpec` (everything a sandbox's init needs),
the OCI runtime spec we generate (`runtime_spec`, `process_spec`), `Launcher`, and
`OciCliLauncher`, which drives an OCI runtime's command line (`run`, `exec`, `delete`) with its
state under a root folder of ours. Its implementations: `RuncLauncher` here (Debian's `runc`,
state under `RUNC_ROOT`) and `CrunLauncher` (crun.py); runtimes.py says which one a sandbox
uses. docs/runtime.md explains why an OCI runtime and not bubblewrap (measured there).

The container's pid 1 is `catatonit -P` (Debian `catatonit`, statically linked), bind-mounted
from the host at `INIT_PATH` inside the container's private /dev tmpfs: it works whatever the
image contains, reaps zombies, and nothing of it lands in the sandbox's upper layer. Commands
run through `RUNTIME exec --process FILE`, so every exec carries the full process spec (user,
groups, capabilities, rlimits, noNewPrivileges) and nothing is inherited from the runtime's
defaults by accident. The seccomp filter (seccomp.py) goes into `linux.seccomp` of config.json;
the runtime applies it to the init and to every exec.

A one-shot sandbox (`weenv run`: one command, then nothing) skips the exec: its init is
`catatonit -- COMMAND` with the command's process spec, run by `runc run` in the foreground
with the caller's stdio, which also deletes the container when the command ends. One runtime
call instead of three (run, exec, delete): about 50 ms less per `weenv run` (runc).

Must not: mount anything on the host, manage upper layers or state files (sandbox.py), or
decide limits (the cgroup hook in sandbox.py).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import select
import shutil
import signal
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from weenvfs.errors import WeenvError

log = logging.getLogger(__name__)

RUNC_ROOT = Path("/run/weenv/runc")
INIT_PATH = "/dev/.weenv-init"
INIT_BINARY = "catatonit"
COMMAND_TIMEOUT = 60.0  # seconds for one runtime start/kill/delete

# Docker's default capability set: what root in a container needs to install packages
# (chown, setuid for apt's _apt user, ...) and nothing that reaches the host.
DEFAULT_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)
NOFILE = 65536  # at most: raising past our own hard limit needs CAP_SYS_RESOURCE
MASKED_PATHS = (
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/sys/firmware", "/sys/devices/virtual/powercap",
)
READONLY_PATHS = (
    "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
)


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a sandbox: argv, environment (`K=V`), working directory, identity."""

    args: tuple[str, ...]
    env: tuple[str, ...]
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    groups: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (kept in the sandbox state)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessSpec:
        """The inverse of `to_json`."""
        return cls(
            tuple(data["args"]), tuple(data["env"]), data["cwd"], int(data["uid"]),
            int(data["gid"]), tuple(int(g) for g in data["groups"]),
        )


@dataclass(frozen=True)
class CgroupSpec:
    """A sandbox's cgroup: its path below each hierarchy's root (e.g. `/weenv/ID`) and the
    OCI `linux.resources` the runtime writes there (empty when someone else sets limits)."""

    path: str
    resources: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start a sandbox's init."""

    sandbox_id: str
    rootfs: Path
    bundle: Path
    process: ProcessSpec
    cgroup: CgroupSpec
    network: str = "none"  # "none": own network namespace with lo only; "host": the node's
    hostname: str = "weenv"
    seccomp: dict[str, Any] | None = None  # OCI linux.seccomp (seccomp.py); None: no filter
    # True: the init runs `process` itself (a one-shot sandbox, `Launcher.run`); False: the
    # init waits (`catatonit -P`) with the identity of `process`, whose args are unused.
    one_shot: bool = False


def process_spec(process: ProcessSpec) -> dict[str, Any]:
    """The OCI `process` object of `process` (also the `runc exec --process` file)."""
    caps = list(DEFAULT_CAPS)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
    return {
        "terminal": False,
        "user": {"uid": process.uid, "gid": process.gid,
                 "additionalGids": list(process.groups)},
        "args": list(process.args),
        "env": list(process.env),
        "cwd": process.cwd,
        "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
        # Stricter than Docker's default: setuid binaries (sudo, su) cannot raise
        # privileges; root in the sandbox keeps its capability set.
        "noNewPrivileges": True,
    }


def _mounts(network: str) -> list[dict[str, Any]]:
    sys_options = ["nosuid", "noexec", "nodev", "ro"]
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": sys_options},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": [*sys_options, "relatime"]},
        {"destination": INIT_PATH, "type": "bind", "source": init_binary(),
         "options": ["rbind", "ro", "nosuid", "nodev"]},
    ]
    for name in ("resolv.conf", "hosts") if network == "host" else ():
        # The node's resolver and hosts, as Docker does with --network host; read-only.
        # (/etc/hosts exists in every sandbox: etc_layer.py.)
        if os.path.exists(f"/etc/{name}"):
            mounts.append({"destination": f"/etc/{name}", "type": "bind",
                           "source": os.path.realpath(f"/etc/{name}"),
                           "options": ["rbind", "ro", "nosuid", "nodev"]})
    return mounts


def runtime_spec(spec: LaunchSpec) -> dict[str, Any]:
    """The OCI runtime spec (config.json) of a sandbox whose init is `catatonit -P`, or
    `catatonit -- ARGS` for a one-shot sandbox."""
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if spec.network == "none":
        namespaces.append({"type": "network"})  # runc brings up lo, nothing else
    process = spec.process
    if spec.one_shot:
        init = ProcessSpec((INIT_PATH, "--", *process.args), process.env, process.cwd,
                           process.uid, process.gid, process.groups)
    else:
        init = ProcessSpec((INIT_PATH, "-P"), process.env, "/", process.uid, process.gid,
                           process.groups)
    return {
        "ociVersion": "1.0.2",
        "process": process_spec(init),
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": _mounts(spec.network),
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": spec.cgroup.path,
            "resources": {"devices": [{"allow": False, "access": "rwm"}],
                          **spec.cgroup.resources},
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            **({"seccomp": spec.seccomp} if spec.seccomp is not None else {}),
        },
    }


def init_binary() -> str:
    """Path of the static init bound into every sandbox."""
    path = shutil.which(INIT_BINARY) or "/usr/libexec/podman/catatonit"
    if not os.path.exists(path):
        raise WeenvError("catatonit not found (install the Debian package catatonit)")
    return path


class Launcher(ABC):
    """Starts, enters and destroys sandboxes. Sandbox ids are the launcher's container ids."""

    name: str

    @abstractmethod
    def check_installed(self) -> None:
        """Raise WeenvError when the runtime cannot run here (a launcher of a sandbox made
        earlier can still inspect and remove it without its program)."""

    @abstractmethod
    def start(self, spec: LaunchSpec) -> int:
        """Start the sandbox's init detached; return its host pid once it runs."""

    @abstractmethod
    def run(self, spec: LaunchSpec, *, stdin: int | IO[Any] | None,
            stdout: int | IO[Any] | None, stderr: int | IO[Any] | None
            ) -> subprocess.Popen[bytes]:
        """Start the one-shot sandbox `spec` (its init runs `spec.process`) with this stdio.

        The launcher's own process is returned: it exits with the command's status (as
        `exec`) once every process of the sandbox is gone, and the launcher has forgotten
        the sandbox by then."""

    @abstractmethod
    def exec(
        self, sandbox_id: str, bundle: Path, process: ProcessSpec, *, pid_file: Path,
        stdin: int | IO[Any] | None, stdout: int | IO[Any] | None,
        stderr: int | IO[Any] | None,
    ) -> subprocess.Popen[bytes]:
        """Start `process` inside the running sandbox; its host pid is written to `pid_file`.

        The launcher's own process is returned: it exits with the command's status
        (128 + N when killed by signal N, 255 when the command could not start)."""

    @abstractmethod
    def destroy(self, sandbox_id: str) -> None:
        """Kill every process of the sandbox and forget it (idempotent)."""

    @abstractmethod
    def status(self, sandbox_id: str) -> str | None:
        """'running', 'stopped', ... or None when the launcher does not know the sandbox."""

    @abstractmethod
    def list_ids(self) -> list[str]:
        """Ids of every sandbox the launcher knows on this node."""

    @abstractmethod
    def exit_code(self, code: int, stderr: bytes) -> int:
        """The status of an `exec` whose launcher process exited with `code` and wrote
        `stderr`: the launcher's own failure to start the command as the shell's 127/126."""


class OciCliLauncher(Launcher):
    """An OCI runtime's command line (runc's, which crun follows) with its state under
    `root`. A subclass names the program and reads the init's pid from its state."""

    name: str
    default_root: Path
    # Lower-case words of the runtime's message (on the command's stderr, with status 255)
    # when it could not start the command.
    cannot_start: str

    def __init__(self, root: Path | None = None) -> None:
        # Looked up now, required only by what runs the program: a sandbox whose runtime was
        # uninstalled since can still be listed and removed (its state files say which
        # processes are its init; `Sandbox._stop` then kills its cgroup).
        self._binary = shutil.which(self.name)
        self.root = root or self.default_root

    @property
    def installed(self) -> bool:
        """Whether the runtime's program is on PATH."""
        return self._binary is not None

    def check_installed(self) -> None:
        if self._binary is None:
            raise WeenvError(f"{self.name} not found (install the Debian package {self.name})")

    @property
    def binary(self) -> str:
        """The runtime's program (WeenvError, naming its Debian package, when missing)."""
        self.check_installed()
        assert self._binary is not None
        return self._binary

    @abstractmethod
    def _init_record(self, sandbox_id: str) -> tuple[int, int]:
        """The sandbox init's host pid and start time (clock ticks) from the runtime's state
        (OSError, ValueError, KeyError or TypeError when there is none)."""

    def _base(self, program: str | None = None) -> list[str]:
        """The runtime's command line before its arguments; `program` runs instead of the
        binary's path (crun's sealed copy, `_program`)."""
        return [program or self.binary, "--root", str(self.root)]

    def _program(self) -> tuple[str | None, tuple[int, ...]]:
        """What the child runs instead of the binary's path (None: the path), and the
        descriptors it needs passed for that."""
        return None, ()

    def _popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `RUNTIME ARGS` (`kwargs` as for Popen: the stdio)."""
        program, fds = self._program()
        return subprocess.Popen([*self._base(program), *args], pass_fds=fds, **kwargs)

    def _config(self, spec: LaunchSpec) -> dict[str, Any]:
        """config.json of `spec` for this runtime (crun adds its compiled filter)."""
        return runtime_spec(spec)

    def config(self, spec: LaunchSpec) -> dict[str, Any]:
        """config.json of `spec` for this runtime (what `start` writes)."""
        return self._config(spec)

    def _run(self, *args: str, output: IO[Any] | None = None,
             stdin: int | IO[Any] = subprocess.DEVNULL) -> tuple[int, str]:
        """Run `RUNTIME ARGS`; (status, stderr). With `output`, stdout and stderr go there."""
        proc = self._popen(args, stdin=stdin, stdout=output or subprocess.DEVNULL,
                           stderr=output or subprocess.PIPE, text=True)
        wait_exit(proc, COMMAND_TIMEOUT, f"{self.name} {args[0]}")
        _, err = proc.communicate()
        return proc.returncode, err or ""

    def start(self, spec: LaunchSpec) -> int:
        return self.start_detached(spec.sandbox_id, spec.bundle, self._config(spec))

    def start_detached(self, sandbox_id: str, bundle: Path, config: Mapping[str, Any], *,
                       stdin: int | IO[Any] = subprocess.DEVNULL) -> int:
        """Start the init of `config` (a config.json, written into `bundle`) detached, with
        `stdin` as its standard input; its host pid once it runs."""
        bundle.mkdir(parents=True, exist_ok=True)
        _write_json(bundle / "config.json", config)
        pid_file = bundle / "init.pid"
        # The detached init inherits runc's stdout and stderr: a pipe would never reach EOF,
        # so both go to a file, which also keeps what the init may say later.
        log_path = bundle / "init.log"
        with open(log_path, "wb") as log_file:
            code, _ = self._run("run", "--detach", "--bundle", str(bundle),
                                "--pid-file", str(pid_file), sandbox_id, output=log_file,
                                stdin=stdin)
        if code != 0:
            self.destroy(sandbox_id)  # the runtime may leave a created container behind
            message = runtime_message(log_path.read_text(errors="replace"))
            raise WeenvError(f"{self.name} could not start sandbox {sandbox_id}: {message}")
        return int(pid_file.read_text().strip())

    def run(self, spec: LaunchSpec, *, stdin: int | IO[Any] | None,
            stdout: int | IO[Any] | None, stderr: int | IO[Any] | None
            ) -> subprocess.Popen[bytes]:
        spec.bundle.mkdir(parents=True, exist_ok=True)
        _write_json(spec.bundle / "config.json", self._config(spec))
        # In the foreground without a terminal, the runtime hands its own stdio to the init,
        # which the command inherits, and forwards the signals it gets to the init.
        return self._popen(["run", "--bundle", str(spec.bundle), "--pid-file",
                            str(spec.bundle / "init.pid"), spec.sandbox_id],
                           stdin=stdin, stdout=stdout, stderr=stderr)

    def exec(
        self, sandbox_id: str, bundle: Path, process: ProcessSpec, *, pid_file: Path,
        stdin: int | IO[Any] | None, stdout: int | IO[Any] | None,
        stderr: int | IO[Any] | None,
    ) -> subprocess.Popen[bytes]:
        spec_file = pid_file.with_suffix(".json")
        _write_json(spec_file, process_spec(process))
        return self._popen(["exec", "--process", str(spec_file), "--pid-file", str(pid_file),
                            sandbox_id], stdin=stdin, stdout=stdout, stderr=stderr)

    def destroy(self, sandbox_id: str) -> None:
        # `runc delete --force` sleeps 100 ms before it first checks that the init died;
        # killing the init ourselves (the kernel then kills the whole pid namespace) and
        # deleting the stopped container costs a few ms.
        self._kill_init(sandbox_id)
        if not (self.root / sandbox_id).exists():
            return  # never made, or deleted by its own foreground run (a one-shot sandbox)
        if not self.installed:
            # Nothing else will delete the record of a sandbox whose runtime was uninstalled
            # (its init is dead; the caller kills whatever is left through its cgroup).
            shutil.rmtree(self.root / sandbox_id, ignore_errors=True)
            return
        code, err = self._run("delete", "--force", sandbox_id)
        if code != 0 and "does not exist" not in err:
            raise WeenvError(f"{self.name} could not delete sandbox {sandbox_id}: "
                             f"{runtime_message(err)}")

    def _kill_init(self, sandbox_id: str, timeout: float = 10.0) -> None:
        try:
            pid, start = self._init_record(sandbox_id)
        except (OSError, ValueError, KeyError, TypeError):
            return
        kill_recorded(pid, start, timeout)

    def status(self, sandbox_id: str) -> str | None:
        try:
            pid, _ = self._init_record(sandbox_id)
        except (KeyError, TypeError):
            return "stopped"  # a state without a pid: created, never started
        except (OSError, ValueError):
            return None
        # The runtime's state file says nothing about liveness; the init's /proc entry does.
        return "running" if _alive(pid) else "stopped"

    def list_ids(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir())
        except FileNotFoundError:
            return []

    def exit_code(self, code: int, stderr: bytes) -> int:
        if code != 255:
            return code
        tail = stderr[-600:].decode(errors="replace").lower()
        if self.cannot_start not in tail:
            return code  # the command's own 255
        if "not found" in tail or "no such file" in tail:
            return 127
        if "permission denied" in tail:
            return 126
        return code


class RuncLauncher(OciCliLauncher):
    """`runc` with its state under `root` (default RUNC_ROOT)."""

    name = "runc"
    default_root = RUNC_ROOT
    cannot_start = "exec failed"  # `exec failed: ...: no such file or directory`

    def _init_record(self, sandbox_id: str) -> tuple[int, int]:
        state = json.loads((self.root / sandbox_id / "state.json").read_text())
        return int(state["init_process_pid"]), int(state["init_process_start"])


def wait_exit(proc: subprocess.Popen[Any], timeout: float | None, what: str) -> int | None:
    """Wait until `proc` exits, at most `timeout` seconds (None: no limit); its status, or
    None on timeout (WeenvError then, after killing it, if `what` names the command).

    `Popen.wait(timeout)` polls with sleeps growing to 50 ms, which adds up to half again to
    a 30 ms runc call; a pidfd wakes us the moment the process exits."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # reaped already
        return proc.wait()
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if ready:
        return proc.wait()
    if what:
        proc.kill()
        proc.wait()
        raise WeenvError(f"{what} did not finish within {timeout:g} s")
    return None


def kill_recorded(pid: int, start: int, timeout: float = 10.0) -> None:
    """SIGKILL process `pid` if it is still the one that started at `start` (clock ticks, as
    a runtime records its init) and wait up to `timeout` seconds for its end."""
    if _start_time(pid) != start:
        return  # gone already, or the pid was reused: not ours to kill
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        select.select([pidfd], [], [], timeout)  # readable once the process has exited
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def _start_time(pid: int) -> int | None:
    """The start time of `pid` in clock ticks (as the runtimes record it in their state)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _write_json(path: Path, document: Mapping[str, Any]) -> None:
    # Compact: `indent` makes json use its pure-Python encoder, ~13 ms of CPU per sandbox for
    # config.json (its seccomp profile) on the critical path of every open; `jq .` shows it.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, separators=(",", ":")))
    tmp.replace(path)


def runtime_message(stderr: str) -> str:
    """The `msg="..."` of runc's last error line, else the last line (crun's form)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if not lines:
        return "no message"
    last = lines[-1]
    if 'msg="' in last:
        return last.split('msg="', 1)[1].rsplit('"', 1)[0].replace('\\"', '"')
    return last


def check_args(argv: Sequence[str]) -> tuple[str, ...]:
    """A non-empty argv of strings."""
    args = tuple(argv)
    if not args or not all(isinstance(a, str) for a in args):
        raise WeenvError("a command needs at least one argument, all strings")
    return args
