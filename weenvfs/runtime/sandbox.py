"""A sandbox: a writable, isolated root over shared environment mounts, and its lifecycle.

Owns, per sandbox `ID` (`weenv-<10 hex>` unless named):

    /run/weenv/sandboxes/ID/state.json   owner pid (+ start time), environment, paths,
                                         cgroup, default process; read by ls/exec/gc
    /run/weenv/sandboxes/ID/lock         flock'ed while the sandbox changes (reset, rm)
    /run/weenv/sandboxes/ID/rootfs/      overlayfs: the shared mounts as lowers (lowers.py)
    /run/weenv/sandboxes/ID/scratch/     with --tmpfs-upper: a tmpfs holding upper/ and work/;
                                         with --disk: the ext4 disk image mounted (disk.py)
    /run/weenv/sandboxes/ID/bundle/      the OCI bundle (config.json) and exec files
    /var/lib/weenv/sandboxes/ID/         on-disk upper/ and work/ (the default), or the
                                         image disk.img of --disk

and the order of things: state first (so gc can undo a half-made sandbox), then the
environment's shared mounts (lowers.py, mounts.py), the upper, the overlay, the rootfs checks
and fixes (safe_paths.py: /dev, /proc, /sys; working directory, /tmp) and the init
(launcher.py, with the seccomp filter kept in the bundle). Teardown runs the same steps backwards,
each one tolerant of the previous ones never having happened, so `destroy` also cleans up
after crashes. A sandbox that changed nothing in its root can instead be parked at its end
(`destroy(park=True)`: `weenv run`, the Python API's close), and a new sandbox over the same
mounts then takes its id, folder, overlay and upper over (parking.py says when and why).

Every start of the init (create and reset) gets its cgroup from `cgroups.cgroup_factory`, at
the highest CPU weight until the init runs (start_weight.py). An elastic sandbox is put under
the node's provisioner (elastic.py) first, before anything else is built, and taken from it
first in a teardown, while its processes still run: the sidecar's last samples are the run's,
and it records them in the environment's history.

Must not: parse arguments (commands.py), capture output or apply timeouts (environment.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from weenvfs import switches
from weenvfs.errors import UsageError, WeenvError
from weenvfs.fuse import daemon
from weenvfs.fuse.mount_copies import remove_mount_folder

from . import cgroups, disk, mounts, parking, rootfs, safe_paths, seccomp, standby, start_weight
from .cgroups import Limits, cgroup_pids, remove_cgroup
from .env_source import EnvSource
from .etc_layer import etc_layer
from .launcher import DEFAULT_CAPS, Launcher, LaunchSpec, OciCliLauncher, ProcessSpec
from .lower_modes import DEFAULT_LOWER, LOWER_MODES
from .lowers import LowerMount, acquire_lowers, plan_lowers, release_lowers
from .runtimes import default_launcher, launcher_named
from .sandbox_state import (
    SANDBOXES_ROOT,
    exists,
    initial_state,
    list_ids,
    locked,
    make_folder,
    owner_alive,
    owner_record,
    read_state,
    remove_folder,
    sandbox_dir,
    write_state,
)

log = logging.getLogger(__name__)

UPPERS_ROOT = Path("/var/lib/weenv/sandboxes")
KEPT_MARKER = "KEPT"
SECCOMP_FILE = "seccomp.json"  # in the bundle: the filter every start of the sandbox applies


class CommandCannotRun(WeenvError):
    """The command is not an executable file in the sandbox."""


class CommandNotFound(CommandCannotRun):
    """No file of the command's name in the sandbox."""

    exit_code = 127  # what a shell (and docker run) returns for a command it cannot find


class CommandNotExecutable(CommandCannotRun):
    """The command names a file that is not executable, or a directory."""

    exit_code = 126  # a shell's (and docker run's) "permission denied"


class SandboxBroken(WeenvError):
    """The sandbox's environment mount is gone (its daemon died): nothing in it can run."""


class _StaleParkedRoot(Exception):
    """A shared mount under a taken-over parked root is not the one it was parked over (it
    died and was mounted again): the root is removed and a new one made."""


@dataclass(frozen=True)
class SandboxOptions:
    """How to make a sandbox, besides the environment."""

    limits: Limits = field(default_factory=Limits)
    tmpfs_upper: bool = False
    tmpfs_size: int | None = None
    network: str = "none"
    keep_upper: bool = False
    keep_warm: float | None = None  # None: the node's policy (mounts.WarmPolicy)
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    cwd: str | None = None
    name: str | None = None
    lower: str = DEFAULT_LOWER  # lowers.py: a mount per group ("layers") or one ("merged")
    seccomp: str | dict[str, Any] | None = None  # seccomp.resolve: None is Docker's default
    disk: int | None = None  # bytes the upper may hold (disk.py; the tmpfs size with tmpfs)


def require_root() -> None:
    """UsageError unless this process is root."""
    if os.geteuid() != 0:
        raise UsageError("sandboxes need root (overlay mounts, namespaces and cgroups)")


class Sandbox:
    """A sandbox on this node, made by `create` or found again by `load`."""

    def __init__(self, state: dict[str, Any], launcher: Launcher | None = None) -> None:
        self.state = state
        # The runtime that made the sandbox runs it to its end, whatever the default now.
        self.launcher = launcher or launcher_named(str(state.get("launcher") or "runc"))
        # What the recording mount published when `destroy` ended it (recording.py), if any.
        self.hint_outcome: dict[str, Any] | None = None
        # The launch of its one command (`run_once`): what a standby after it is made for;
        # and that command, when a standby took it.
        self._one_shot: LaunchSpec | None = None
        self._handed: standby.Handed | None = None

    # -- facts ----------------------------------------------------------------------------

    @property
    def id(self) -> str:
        """The sandbox id (also its hostname and its cgroup's name)."""
        return str(self.state["id"])

    @property
    def dir(self) -> Path:
        """The state folder."""
        return SANDBOXES_ROOT / self.id

    @property
    def rootfs(self) -> Path:
        """The overlay mount point: the sandbox's root as the host sees it."""
        return self.dir / "rootfs"

    @property
    def bundle(self) -> Path:
        """The OCI bundle folder."""
        return self.dir / "bundle"

    @property
    def upper_root(self) -> Path:
        """The folder holding upper/ and work/ (a tmpfs or disk mount point with
        --tmpfs-upper or --disk)."""
        if self.state["tmpfs_upper"] or self.state.get("disk"):
            return self.dir / "scratch"
        return UPPERS_ROOT / self.id

    @property
    def disk_image(self) -> Path | None:
        """The ext4 image holding the upper (--disk without --tmpfs-upper), or None."""
        if self.state.get("disk") and not self.state["tmpfs_upper"]:
            return UPPERS_ROOT / self.id / "disk.img"
        return None

    @property
    def upper_mounted(self) -> bool:
        """Whether upper_root is a mount of its own (tmpfs or disk)."""
        return bool(self.state["tmpfs_upper"] or self.state.get("disk"))

    @property
    def process(self) -> ProcessSpec:
        """The default process: the environment's env, cwd and user, resolved."""
        return ProcessSpec.from_json(self.state["process"])

    @property
    def cgroup_path(self) -> str | None:
        """The path below each hierarchy's root of the cgroup its processes are in, once the
        init has started (`/weenv/ID`, or `/weenv/ID/runc` for an elastic sandbox)."""
        return self.state.get("cgroup", {}).get("path")

    @property
    def is_elastic(self) -> bool:
        """Whether the node's provisioner sizes the sandbox's memory and CPU."""
        return bool(self.state.get("limits", {}).get("elastic"))

    def status(self) -> str:
        """'creating', 'running', 'stopped' (init gone), 'orphaned' (owner gone) or 'broken'
        (an environment mount under it is gone)."""
        if not owner_alive(self.state.get("owner")):
            return "orphaned"
        if self.state.get("status") != "running":
            return str(self.state.get("status"))
        if self.launcher.status(self.id) != "running":
            return "stopped"
        return "broken" if self.mount_problem() else "running"

    def mount_problem(self) -> str | None:
        """Why a shared mount under the sandbox no longer serves it, or None. A FUSE mount
        whose daemon died answers with ENOTCONN (statfs always reaches the daemon, where a
        stat may be answered from the kernel's attribute cache); a kernel-path mount answers
        from the kernel even then, so its data-device folder is asked too
        (`daemon.check_answers`); one unmounted behind our back is an empty folder. The
        node's mount table is read once for all the lowers (a nine-group environment read it
        nine times, ~2 ms of each check)."""
        mounted = daemon.mount_points()
        for path in self.lowers:
            try:
                os.statvfs(path)
                daemon.check_answers(path, mounted)
            except OSError as error:
                return f"{path}: {error.strerror}"
            if not os.path.ismount(path):
                return f"{path}: not mounted"
        return None

    def check_mounts(self) -> None:
        """SandboxBroken naming the mount if the sandbox's environment is gone."""
        problem = self.mount_problem()
        if problem:
            raise SandboxBroken(f"sandbox {self.id} is broken: its environment mount is gone "
                                f"({problem}); remove it with `weenv sandbox rm {self.id}`")

    def _reload(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.state = read_state(self.dir)

    def save(self) -> None:
        """Write the state file atomically."""
        write_state(self.dir, self.state)

    # -- life -----------------------------------------------------------------------------

    @classmethod
    def create(cls, source: EnvSource, options: SandboxOptions, *, owner_pid: int | None,
               launcher: Launcher | None = None, start: bool = True,
               parked: bool = True) -> Sandbox:
        """Make and start a sandbox of `source`; `owner_pid` None makes it outlive this
        process (only `weenv sandbox rm` or gc of a dead init ends it). With `start` False
        everything is made but the init: `run_once` then starts it with one command. The
        root of a parked sandbox over the same mounts is taken over when there is one
        (parking.py; `parked` False: never)."""
        require_root()
        if options.network not in ("none", "host"):
            raise UsageError(f"--network must be none or host, not {options.network!r}")
        if options.lower not in LOWER_MODES:
            raise UsageError(f"--lower must be one of {', '.join(LOWER_MODES)}, "
                             f"not {options.lower!r}")
        if options.keep_upper and options.tmpfs_upper:
            raise UsageError("keeping the upper layer needs it on disk (no --tmpfs-upper)")
        if options.disk is not None:
            disk.check_size(options.disk)
            if options.keep_upper:
                raise UsageError("keeping the upper layer needs it in a folder (no --disk)")
        syscalls = seccomp.resolve(options.seccomp, DEFAULT_CAPS)  # a bad file fails first
        launcher = launcher or default_launcher()  # so does an unknown or missing runtime
        creator = os.getpid()
        planned = plan_lowers(source.digest, source.groups, options.lower, source.store_url,
                              source.cache_dir, record=source.record_tag)
        parkable = _parkable(source, options)
        # The mounts' keys are in the first state a crash may leave (gc releases them).
        record = {**_record(source, options), "seccomp": syscalls.name,
                  "mounts": [m.key for m in planned]}
        sandbox = None
        if parkable and parked:  # saved as this sandbox's already, if one is taken
            sandbox = cls._take_parked(record["mounts"], record, creator, launcher,
                                       standby_usable=not start)
        if sandbox is None:
            sandbox = cls._new(options.name or f"weenv-{secrets.token_hex(5)}", record,
                               creator, launcher)
            sandbox.state["parkable"] = parkable
            sandbox.save()
        sandbox.bundle.mkdir(parents=True, exist_ok=True)
        # Kept with the sandbox: every start (create, reset) applies the same filter, even if
        # the profile's file changed or went away since.
        (sandbox.bundle / SECCOMP_FILE).write_text(json.dumps(syscalls.to_json()))
        try:
            sandbox._build(source, options, start, planned)
        except _StaleParkedRoot:
            log.info("sandbox %s: a shared mount under its parked root was mounted again; "
                     "making a new root", sandbox.id)
            sandbox.destroy(keep_upper=False)
            return cls.create(source, options, owner_pid=owner_pid,
                              launcher=launcher, start=start, parked=False)
        except BaseException:
            sandbox.destroy(keep_upper=False)
            raise
        if owner_pid != creator:
            sandbox.state["owner"] = owner_record(owner_pid)
        if owner_pid != creator or not start:  # (`_start` saved the started one)
            sandbox.save()
        return sandbox

    @classmethod
    def _new(cls, sandbox_id: str, record: dict[str, Any], creator: int,
             launcher: Launcher) -> Sandbox:
        """A new sandbox folder and its first state."""
        folder = sandbox_dir(sandbox_id)
        SANDBOXES_ROOT.mkdir(parents=True, exist_ok=True)
        try:
            make_folder(folder)
        except FileExistsError:
            raise UsageError(f"sandbox {sandbox_id} exists already") from None
        return cls(initial_state(sandbox_id, record, creator, launcher.name), launcher)

    @classmethod
    def _take_parked(cls, keys: list[str], record: dict[str, Any], creator: int,
                     launcher: Launcher, standby_usable: bool = True) -> Sandbox | None:
        """The parked sandbox over mounts `keys` (parking.py), made a new sandbox of
        `record` (its id, folder, overlay and upper kept; `_build` checks its mounts), or
        None: none is parked, the one named is gone or no longer pristine (removed), or it
        holds a standby a sandbox that is not `standby_usable` would have to discard: that
        root is left parked for the next `weenv run` (the discard, a `crun delete`, cost
        such a sandbox more than a fresh overlay: ~41 against ~28 ms for an API's `open` +
        `exec(true)` when `weenv run`s of the same environment came between)."""
        sandbox_id = parking.claim(keys)
        if sandbox_id is None:
            return None
        try:
            box = cls.load(sandbox_id, launcher)  # it runs nothing: any launcher stops it
        except WeenvError:
            return None
        with locked(box.dir) as present:
            if not present:
                return None
            box._reload()
            old = box.state
            if old.get("status") != "parked":
                return None  # taken over or removed meanwhile (it was named in the index)
            if old.get("mounts") != keys or not box._root_as_made():
                box._end(keep=False, park=False)
                box._remove_folder()
                return None
            if old.get("standby") and not standby_usable and parking.offer(sandbox_id, keys):
                return None  # parked again as it was (the state untouched)
            box.state = initial_state(sandbox_id, record, creator, launcher.name)
            box.state.update(parkable=True, upper_print=old["upper_print"],
                             parked=old.get("parked"))
            if old.get("standby"):  # its init and cgroup: used or discarded by the start
                box.state.update(standby=old["standby"], cgroup=old.get("cgroup") or {})
            box.save()
        log.info("sandbox %s: took over its parked root", sandbox_id)
        return box

    @classmethod
    def load(cls, sandbox_id: str, launcher: Launcher | None = None) -> Sandbox:
        """The sandbox `sandbox_id` (UsageError if there is none)."""
        try:
            state = read_state(sandbox_dir(sandbox_id))
        except (OSError, ValueError):
            raise UsageError(f"no sandbox {sandbox_id}") from None
        return cls(state, launcher)

    def _build(self, source: EnvSource, options: SandboxOptions, start: bool,
               planned: list[LowerMount]) -> None:
        started = time.monotonic()
        if options.limits.elastic:  # first: fails fast on a node without usable cgroups
            from . import elastic  # the provisioner's modules: only for elastic sandboxes

            self.state["elastic"] = elastic.attach(self.id, source.digest, options.limits)
            self.save()
        parked = self.state.pop("parked", None)  # taken over from a parked sandbox
        lowers = acquire_lowers(planned, self.id, env=source.digest, store_url=source.store_url,
                                cache_dir=source.cache_dir)
        if parked is not None:
            if parking.daemon_ids([m.key for m in planned]) != parked.get("daemons"):
                raise _StaleParkedRoot(self.id)
        else:
            for path in (self.rootfs, self.bundle / "exec"):
                path.mkdir(parents=True, exist_ok=True)
            self._make_upper()
            rootfs.mount_overlay(self.rootfs, [etc_layer(), *lowers],
                                 self.upper_root / "upper", self.upper_root / "work")
            if self.state.get("parkable"):  # what `destroy(park=True)` compares with
                self.state["upper_print"] = parking.upper_print(self.upper_root / "upper")
        user = rootfs.resolve_user(self.rootfs, options.user or source.user)
        cwd = rootfs.check_inside(options.cwd or source.cwd or "/")
        env = rootfs.env_list(source.env, options.env, user)
        self.state["process"] = ProcessSpec((), env, cwd, user.uid, user.gid,
                                            user.groups).to_json()
        if start:
            self._start()
        else:
            self.state["status"] = "created"  # saved by `create`, with the owner
        log.info("sandbox %s of %s ready in %.0f ms", self.id, source.ref,
                 (time.monotonic() - started) * 1000)

    def _make_upper(self) -> None:
        top = self.upper_root
        top.mkdir(parents=True, exist_ok=True)
        image = self.disk_image
        if self.state["tmpfs_upper"]:
            rootfs.mount_tmpfs(top, self.state.get("disk") or self.state.get("tmpfs_size"))
        elif image is not None:
            image.parent.mkdir(parents=True, exist_ok=True)
            disk.make_disk(image, int(self.state["disk"]))
            disk.mount_disk(image, top)
            (top / "lost+found").rmdir()  # mkfs's; the upper must start empty
        (top / "upper").mkdir(mode=0o755)
        (top / "work").mkdir(mode=0o700)

    def _fix_rootfs(self) -> None:
        """Check the image where runc works (/dev, /proc, /sys: safe_paths.py) and create
        what it lacks for a sandbox to run (lands in the upper, like Docker's WORKDIR): the
        working directory and a world-writable /tmp, through symlinks resolved inside it."""
        process = self.process
        safe_paths.check_system_dirs(self.rootfs)
        safe_paths.ensure_dir(self.rootfs, process.cwd, (process.uid, process.gid))
        safe_paths.ensure_dir(self.rootfs, "/tmp", (0, 0), mode=0o1777)

    def _launch_spec(self, process: ProcessSpec, one_shot: bool) -> LaunchSpec:
        self._fix_rootfs()
        cgroup = cgroups.cgroup_factory(self.id, Limits(**self.state["limits"]))
        self.state["cgroup"] = {"path": cgroup.path, "resources": cgroup.resources}
        return LaunchSpec(self.id, self.rootfs, self.bundle, process, cgroup,
                          self.state["network"], self.id, self.seccomp.profile, one_shot)

    def _start(self) -> None:
        cgroups.prime_migrations()
        self._discard_standby()  # a long-lived init is catatonit's
        spec = self._launch_spec(self.process, one_shot=False)
        boost = start_weight.boost(spec.cgroup)  # the init's start only (start_weight.py)
        self.state["init_pid"] = self.launcher.start(
            spec if boost is None else replace(spec, cgroup=boost.spec))
        if boost is not None:
            start_weight.settle(boost)
        self.state["status"] = "running"
        self.save()

    def run_once(self, spec: ProcessSpec, *, stdin: int | IO[Any] | None = None,
                 stdout: int | IO[Any] | None = None,
                 stderr: int | IO[Any] | None = None) -> subprocess.Popen[bytes]:
        """Start a sandbox made with `start=False` with `spec` (from `command`) as its only
        command: the returned launcher process exits with its status (launcher.Launcher.run),
        and then no process of the sandbox is left; `destroy` it afterwards as any other."""
        require_root()
        if self.state.get("status") != "created":
            raise WeenvError(f"sandbox {self.id} has started already: use exec")
        launch = self._launch_spec(spec, one_shot=True)
        self._one_shot = launch
        own_stdio = stdin is None and stdout is None and stderr is None
        handed = self._hand_to_standby(launch) if own_stdio else None
        if handed is None:
            self._discard_standby()
        self._handed = handed
        self.state["status"] = "running"
        self.save()
        if handed is not None:
            return handed  # type: ignore[return-value]  # waited for and killed as a Popen
        return self.launcher.run(launch, stdin=stdin, stdout=stdout, stderr=stderr)

    def _hand_to_standby(self, launch: LaunchSpec) -> standby.Handed | None:
        """The command of `launch` handed to the standby taken over with the parked root
        (standby.py), if there is one, it fits `launch` and its init still waits; else None."""
        record = self.state.get("standby")
        if not record or not isinstance(self.launcher, OciCliLauncher):
            return None
        program = standby.receiver()
        if program is None or switches.switched_off(standby.SWITCH):
            return None
        expected = standby.digest(standby.config(self.launcher, launch, program))
        handed = standby.hand(record, expected, launch.process)
        if handed is not None:
            self.state.pop("standby", None)
            self.state["init_pid"] = int(record["pid"])
        return handed

    def _discard_standby(self) -> None:
        """Stop and forget the standby taken over with the parked root, if any, or what the
        runtime still keeps of a command a standby ran (`_end`)."""
        self.state.pop("standby", None)
        self._forget_runtime()

    def _forget_runtime(self) -> None:
        """`_stop` if the runtime has a record of the sandbox (a stat; most often none)."""
        if self.launcher.status(self.id) is not None:
            self._stop()

    def make_standby(self) -> None:
        """Start a standby in the parked root of this finished run (standby.py), for the
        next run like its own, if it is still parked and has none; a failure is logged. (The
        node service's fork of the run, after the run's client got its status.)"""
        launch = self._one_shot
        if launch is None or not isinstance(self.launcher, OciCliLauncher):
            return
        with locked(self.dir) as present:
            if not present:
                return
            self._reload()
            if self.state.get("status") != "parked" or self.state.get("standby"):
                return
            self._forget_runtime()  # the run's, left for now (`_end`)
            try:
                record = standby.start(self.launcher, launch)
            except (OSError, WeenvError) as error:
                log.info("sandbox %s: no standby: %s", self.id, error)
                self._stop()
                return
            self.state.update(standby=record, cgroup={"path": launch.cgroup.path,
                                                      "resources": launch.cgroup.resources})
            self.save()
        log.info("sandbox %s: a standby waits for the next run", self.id)

    @property
    def seccomp(self) -> seccomp.Seccomp:
        """The syscall filter its processes run under (Docker's default for a sandbox made
        before filters were kept)."""
        try:
            return seccomp.Seccomp.from_json(json.loads((self.bundle / SECCOMP_FILE).read_text()))
        except (OSError, ValueError, KeyError):
            return seccomp.resolve(None, DEFAULT_CAPS)

    @property
    def lowers(self) -> list[Path]:
        """The shared mounts under the sandbox's overlay, topmost first: in the folder of
        shared mounts it was made in (`envs_root` of its state; a process with another
        $WEENV_ENVS_ROOT looking at it, such as another node root's housekeeping, must not
        look in its own), else in this process's."""
        return [mounts.mountpoint(key, self._envs_root()) for key in self._mount_keys()]

    def _envs_root(self) -> Path | None:
        """The folder of shared mounts recorded in its state (None: older states, made in
        the process's)."""
        root = self.state.get("envs_root")
        return Path(root) if isinstance(root, str) else None

    def in_envs_root(self) -> bool:
        """Whether its shared mounts are in this process's folder of shared mounts (states
        made before it was recorded: taken as yes)."""
        root = self._envs_root()
        return root is None or root == mounts.envs_root().absolute()

    def _mount_keys(self) -> list[str]:
        # A version 1 state had one merged mount, keyed by the environment's digest, and
        # recorded its path as `lower` once taken.
        keys = self.state.get("mounts")
        if keys is None:
            return [self.state["env"]["digest"]] if self.state.get("lower") else []
        return list(keys)

    def reset(self) -> float:
        """Discard every change since the sandbox was made: kill its processes, throw the
        upper layer away and start again from the pristine environment. Returns seconds."""
        require_root()
        started = time.monotonic()
        with locked(self.dir) as present:
            if not present:
                raise UsageError(f"no sandbox {self.id}")
            self._reload()  # another process may have reset it since we loaded it
            self.state["status"] = "resetting"
            self.save()
            self._stop()
            rootfs.unmount(self.rootfs)
            trash = self._discard_upper()
            self._make_upper()
            rootfs.mount_overlay(self.rootfs, [etc_layer(), *self.lowers],
                                 self.upper_root / "upper", self.upper_root / "work")
            self.state["resets"] = int(self.state.get("resets", 0)) + 1
            self._start()
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)  # after the sandbox runs again
        return time.monotonic() - started

    def _discard_upper(self) -> Path | None:
        """Make the upper go away fast: unmount the tmpfs, or rename the folder on disk for
        deletion once the sandbox runs again. Returns the folder to delete."""
        top = self.upper_root
        if self.upper_mounted:
            rootfs.unmount(top)  # a disk's loop device goes with it (autoclear)
            if self.disk_image is not None:
                self.disk_image.unlink(missing_ok=True)
            return None
        trash = UPPERS_ROOT / f".trash-{self.id}-{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):
            top.rename(trash)
            return trash
        return None

    def _stop(self) -> None:
        """Kill every process of the sandbox and remove the cgroup runc made for them."""
        try:
            self.launcher.destroy(self.id)
        except WeenvError as error:
            log.info("%s; killing its cgroup directly", error)
        # A sandbox that died before its first start has no cgroup in its state, but runc
        # may have made one: the default path is where it would be.
        remove_cgroup(self.cgroup_path or cgroups.sandbox_cgroup(self.id))

    def destroy(self, keep_upper: bool | None = None, park: bool = False) -> None:
        """Tear everything down (tolerates any half-made state); keep the on-disk upper if
        `keep_upper` (default: as the sandbox was created). With `park`, a sandbox whose
        upper is as it was made is stopped and parked instead (parking.py): its root waits
        for the next sandbox of the same mounts."""
        require_root()
        keep = self.state.get("keep_upper", False) if keep_upper is None else keep_upper
        with locked(self.dir) as present:
            if not present:
                return
            if self._end(keep, park):
                return
            self._remove_folder()
        log.info("sandbox %s removed%s", self.id,
                 f" (upper kept in {self.upper_root})" if keep else "")

    def drop_parked(self) -> bool:
        """Tear the sandbox down if it is still parked (under its lock: never one taken
        over meanwhile); whether it was."""
        require_root()
        with locked(self.dir) as present:
            if not present:
                return False
            self._reload()
            if self.state.get("status") != "parked":
                return False
            self._end(keep=False, park=False)
            self._remove_folder()
        log.info("parked sandbox %s removed", self.id)
        return True

    def _remove_folder(self) -> None:
        """The last step of a teardown, under the sandbox's lock: the sandbox's folder
        (never through a live overlay)."""
        if rootfs.is_mount_point(self.rootfs):
            raise WeenvError(f"{self.rootfs} is still mounted; run `weenv sandbox gc` later")
        remove_folder(self.dir)

    def _end(self, keep: bool, park: bool) -> bool:
        """Under the sandbox's lock: stop it, then park it (`park`, when it may: True) or
        tear down all but its folder (False)."""
        if self.is_elastic:
            from . import elastic

            elastic.release(self.id)
        if park and self._handed is not None:
            # Its init is gone (it reported the status), every process of its pid namespace
            # with it: the runtime's record and the empty cgroup wait for whoever starts or
            # ends the parked root next (`_forget_runtime`), after the run's answer.
            self._handed.kill()
            if self._park():
                return True
        self._stop()
        if self.is_elastic:  # the provisioner's cgroup, kept across resets
            remove_cgroup(cgroups.sandbox_cgroup(self.id))
        if park and self._park():
            return True
        if self.state.get("status") == "parked":
            parking.withdraw(self.id, self._mount_keys())
        rootfs.unmount(self.rootfs)
        remove_mount_folder(self.rootfs)  # before the lowers go: copies elsewhere hold them
        if self.upper_mounted:
            rootfs.unmount(self.upper_root)
        if self.disk_image is not None:
            shutil.rmtree(self.disk_image.parent, ignore_errors=True)
        if keep and not self.upper_mounted:
            with contextlib.suppress(FileNotFoundError):
                (self.upper_root / KEPT_MARKER).write_text(json.dumps(self.state))
        else:
            shutil.rmtree(self.upper_root, ignore_errors=True)
        warm = self.state.get("keep_warm")
        outcomes = release_lowers(self._mount_keys(), self.id,
                                  None if warm is None else float(warm),
                                  publish_later=bool(self.state.get("publish_later")),
                                  root=self._envs_root(), is_live=exists)
        self.hint_outcome = outcomes[0] if outcomes else None
        (self.dir / "state.json").unlink(missing_ok=True)
        return False

    def _park(self) -> bool:
        """Park the stopped sandbox (parking.py) if it may be: made parkable, its upper as
        it was made, its overlay the only mount there, and room in the index; whether it
        was parked. Its mounts are not asked here (a round trip to each one's daemon at the
        end of every run): whoever takes the root checks them (`_build`: a mount that died
        is mounted again, and a root over the old one is not taken), and `drop_parked`
        removes a parked root over a mount that no longer answers (gc, the node service's
        housekeeping after every release)."""
        if not self.state.get("parkable"):  # (parking.park_seconds was checked when made)
            return False
        keys = self._mount_keys()
        seconds = parking.park_seconds()
        if seconds <= 0 or not self._root_as_made():
            return False
        if not parking.has_room(keys):
            return False
        for name in ("cgroup", "init_pid"):
            self.state.pop(name, None)  # type: ignore[misc]
        # Parked in the state before the index names it: whoever takes it from the index
        # then waits for this lock and finds it parked (else the teardown goes on).
        self.state.update(status="parked", owner=None, parked=parking.parked_record(keys, seconds))
        self.save()
        if not parking.offer(self.id, keys):
            return False
        log.info("sandbox %s parked (its root is as it was made)", self.id)
        return True

    def _root_as_made(self) -> bool:
        """Whether the root is its overlay alone (nothing mounted in it) over an upper as it
        was made (parking.py `pristine`): what parking and taking over require."""
        return (rootfs.mounts_at(self.rootfs) == (True, False)
                and parking.pristine(self.upper_root / "upper", self.state.get("upper_print")))

    # -- running commands -------------------------------------------------------------------

    def command(self, argv: tuple[str, ...], *, env: dict[str, str] | None = None,
                cwd: str | None = None, user: str | None = None,
                mounts_checked: bool = False) -> ProcessSpec:
        """The process spec of `argv` with per-command overrides of the defaults
        (SandboxBroken if the environment's mount is gone; `mounts_checked`: the caller made
        the sandbox an instant ago, and `create` found every shared mount answering, so the
        check, a round trip to each mount's daemon, is not made again)."""
        if self.state.get("status") == "parked":
            raise UsageError(f"sandbox {self.id} is parked: its run ended and its root waits "
                             "for the next run of its environment (nothing runs in it)")
        if not mounts_checked:
            self.check_mounts()
        base = self.process
        spec = replace(base, args=argv)
        if user is not None:
            resolved = rootfs.resolve_user(self.rootfs, user)
            spec = replace(spec, uid=resolved.uid, gid=resolved.gid, groups=resolved.groups)
        if env:
            spec = replace(spec, env=rootfs.env_list(base.env, env, rootfs.User(0, 0, (), "/")))
        if cwd is not None:
            if not rootfs.is_dir_in_root(self.rootfs, rootfs.check_inside(cwd)):
                raise UsageError(f"working directory {cwd} does not exist in the sandbox")
            spec = replace(spec, cwd=cwd)
        # runc reports a missing command as its own failure (255, a log line on the
        # command's stderr); find it first so that callers get the shell's 127.
        found = rootfs.find_executable(self.rootfs, argv[0], spec.env, spec.cwd)
        if found == rootfs.MISSING:
            raise CommandNotFound(f"{argv[0]}: command not found in sandbox {self.id}")
        if found != rootfs.FOUND:
            raise CommandNotExecutable(f"{argv[0]}: permission denied in sandbox {self.id} "
                                       f"({found})")
        return spec

    def exec(self, spec: ProcessSpec, *, stdin: int | IO[Any] | None = None,
             stdout: int | IO[Any] | None = None,
             stderr: int | IO[Any] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
        """Start `spec` in the sandbox; returns the launcher process and the pid file of the
        command (gone by the time `forget_exec` ran)."""
        require_root()
        cgroups.prime_migrations()
        pid_file = self.bundle / "exec" / f"{secrets.token_hex(6)}.pid"
        proc = self.launcher.exec(self.id, self.bundle, spec, pid_file=pid_file, stdin=stdin,
                                  stdout=stdout, stderr=stderr)
        return proc, pid_file

    def forget_exec(self, pid_file: Path) -> None:
        """Remove the files of a finished exec."""
        pid_file.unlink(missing_ok=True)
        pid_file.with_suffix(".json").unlink(missing_ok=True)

    def processes(self) -> list[int]:
        """Host pids of every process in the sandbox's cgroup."""
        return cgroup_pids(self.cgroup_path) if self.cgroup_path else []

    def kill_session(self, pid_file: Path) -> int:
        """SIGKILL the command started with `pid_file` and everything in its session (what
        it started, unless it made itself a new session); returns how many were killed."""
        try:
            leader = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return 0  # it never started, or runc has not written the file yet
        return cgroups.kill_session(self.cgroup_path, leader) if self.cgroup_path else 0


def drop_parked(keys: set[str] | None = None, *, expired_only: bool = False,
                now: float | None = None, own_root: bool = False) -> list[str]:
    """Remove parked sandboxes: every one, those over one of the shared mounts `keys`, or
    (`expired_only`) those past their time (parking.py) or over a mount that no longer
    answers; with `own_root`, only those over this process's folder of shared mounts
    ($WEENV_ENVS_ROOT: the node service's housekeeping keeps its own). Their ids. (Here,
    not in gc.py: the node service's housekeeping runs it after every release, and gc's
    imports cost that process ~14 ms.)"""
    now = time.time() if now is None else now
    dropped = []
    for sandbox_id in list_ids():
        try:
            state = read_state(sandbox_dir(sandbox_id))
        except (OSError, ValueError, WeenvError):
            continue
        if state.get("status") != "parked":
            continue
        if keys is not None and not keys & set(state.get("mounts") or ()):
            continue
        box = Sandbox(state)
        if own_root and not box.in_envs_root():
            continue
        if expired_only and not (parking.expired(state.get("parked"), now)
                                 or box.mount_problem()):
            continue
        try:
            if box.drop_parked():
                dropped.append(sandbox_id)
        except (OSError, WeenvError) as error:
            log.warning("parked sandbox %s: %s", sandbox_id, error)
    return dropped


def ownerless(*, own_root: bool = False) -> list[str]:
    """The ids of the sandboxes whose owner process is gone (a `weenv run` killed with
    SIGKILL in its own process): gc.py's first rule, checked cheaply (state files and
    /proc) so that the node service's housekeeping can look after every release; with
    `own_root`, only those over this process's folder of shared mounts."""
    found = []
    for sandbox_id in list_ids():
        try:
            state = read_state(sandbox_dir(sandbox_id))
            if owner_alive(state.get("owner")):
                continue
        except (OSError, ValueError, KeyError, TypeError, WeenvError):
            continue  # gc reports a state it cannot read
        if own_root and not Sandbox(state).in_envs_root():
            continue
        found.append(sandbox_id)
    return found


def _parkable(source: EnvSource, options: SandboxOptions) -> bool:
    """Whether a sandbox of `source` made with `options` may park its root and take a parked
    one (parking.py): an upper in a folder of its own and thrown away (no --tmpfs-upper,
    --disk or --keep), no name of the user's (a parked sandbox keeps its id), not elastic (the
    provisioner's registration ends with the sandbox), not recording a hint (its mount is
    the run's own), mounts kept warm (a parked root holds them), and parking on."""
    return not (options.name or options.tmpfs_upper or options.disk is not None
                or options.keep_upper or options.limits.elastic
                or source.record_tag is not None
                or (options.keep_warm is not None and options.keep_warm <= 0)
                ) and parking.park_seconds() > 0


def _record(source: EnvSource, options: SandboxOptions) -> dict[str, Any]:
    """What the state of a new sandbox keeps of `source` and `options`."""
    return {
        "env": {"ref": source.ref, "digest": source.digest, "store": source.store_url,
                "cache": str(source.cache_dir)},
        "envs_root": str(mounts.envs_root().absolute()),
        "limits": asdict(options.limits),
        "network": options.network,
        "tmpfs_upper": options.tmpfs_upper,
        "tmpfs_size": options.tmpfs_size,
        "disk": options.disk,
        "keep_upper": options.keep_upper,
        "keep_warm": options.keep_warm,
        "lower_mode": options.lower,
        "publish_later": source.publish_later,
    }
