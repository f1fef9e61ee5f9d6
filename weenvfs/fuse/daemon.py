"""Running a mount in the background and stopping it: start, readiness, pid files, unmount.

Owns:
- `start`: start `python -m weenvfs mount --foreground ... --ready-fd N` as a daemon that is
  not our child (`setsid --fork`: a new session, re-parented to init, so nobody ever has to
  reap it; working directory /, stdin /dev/null, stdout and stderr appended to the log file;
  every path in its arguments must be absolute), and wait, with a timeout, until it writes
  `ok` on the pipe (the mount answers) or an error line (reported as is). The daemon's first
  line is its pid, which `start` returns; whoever unmounts waits for that pid to go
  (spawn.py decides whether the node's mount server starts it instead of setsid);
- `ReadyPipe`: the daemon's end of that pipe;
- pid files, one per mount point, in `RUN_DIR` (`/run/weenv/mounts` for root, else under
  $XDG_RUNTIME_DIR or /tmp): JSON with pid, mount point, reference and log file, written once
  the mount answers and removed when the daemon exits;
- `unmount`: `fusermount3 -u [-z]`, then wait for the daemon of that mount point to exit.

Must not: serve requests (mount.py) or parse arguments (commands.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from weenvfs.errors import UsageError, WeenvError

from . import node_socket
from .mount_copies import describe, holders_elsewhere, remove_mount_folder, unescape_mount_field

log = logging.getLogger(__name__)

READY = "ok"
PID = "pid"  # the daemon's first line: `pid N`
WARNING = "warning:"  # `warning: TEXT` before the answer: logged by the parent as it waits
SPAWN_TIMEOUT = 60.0  # seconds for the daemon to mount and answer
EXIT_TIMEOUT = 30.0  # seconds for a daemon to exit after its unmount
# Seconds after which a daemon not gone yet is checked for copies held elsewhere: of its mount
# point, then also of its device folder (`_wait_unless_held_elsewhere`).
HELD_CHECK = 2.0
HELD_CHECK_IN_USE = 10.0
_POLL = 0.05
# Starts `python -m weenvfs ARGS` with readiness pipe and log file descriptors; True if it did.
Launch = Callable[[list[str], int, int], bool]
# A Ctrl-C reaches the main thread only; a thread that starts daemons for it (runtime's
# lowers.py) is told through this event instead (`cancelled_by`).
_CANCEL = threading.local()


def run_dir() -> Path:
    """Where pid files live: /run/weenv/mounts for root, a per-user folder otherwise."""
    return Path(node_socket.run_base()) / "mounts"


def mount_path(mountpoint: str | Path) -> Path:
    """The absolute, normalized mount point (symlinks not resolved: a dead FUSE mount cannot
    be stat'ed, and pyfuse3 mounts at `os.path.abspath` too)."""
    return Path(os.path.abspath(mountpoint))


def pid_file(mountpoint: Path) -> Path:
    """The pid file of the daemon serving `mountpoint`."""
    name = urllib.parse.quote(str(mount_path(mountpoint)), safe="")
    return run_dir() / f"{name[:240]}.pid"


def kernel_dir(mountpoint: Path) -> Path:
    """The run folder of a kernel-path mount at `mountpoint` (kernel_mount.py): its FUSE
    folder of data devices (`devices/`, which also answers `weenv stats`) and, for several
    groups, the EROFS mount of each (`layers/N`)."""
    return run_dir().parent / "kernel" / pid_file(mountpoint).stem


def is_kernel_mount(mountpoint: Path, mounted: frozenset[bytes] | None = None) -> bool:
    """Whether `mountpoint` is served by the kernel path (its device folder is mounted;
    `mounted` as for `is_mounted`)."""
    return is_mounted(kernel_dir(mount_path(mountpoint)) / "devices", mounted)


def write_pid_file(mountpoint: Path, info: dict[str, Any]) -> Path:
    """Record this process as the daemon of `mountpoint` (atomically)."""
    path = pid_file(mountpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"pid": os.getpid(), "mountpoint": str(mountpoint), **info}))
    tmp.replace(path)
    return path


def read_pid_file(mountpoint: Path) -> dict[str, Any] | None:
    """The record of the daemon of `mountpoint`, or None if there is none or it is garbage."""
    try:
        data = json.loads(pid_file(mountpoint).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def remove_pid_file(mountpoint: Path, pid: int | None = None) -> None:
    """Remove the pid file of `mountpoint` (only if it names `pid`, when given)."""
    if pid is not None:
        record = read_pid_file(mountpoint)
        if record is not None and record["pid"] != pid:
            return
    pid_file(mountpoint).unlink(missing_ok=True)


def _running_stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the name (field 3, the state, first), or None
    when `pid` does not run (a zombie counts as exited: its parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if fields and fields[0] not in (b"Z", b"X") else None


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as exited)."""
    return _running_stat(pid) is not None


def start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (tells a reused pid apart); '' when it is gone. One read
    (a warm sandbox asks it of each shared mount's daemon, twice)."""
    fields = _running_stat(pid)
    return fields[19].decode() if fields is not None and len(fields) > 19 else ""


# -- the child's end ------------------------------------------------------------------------


class ReadyPipe:
    """The write end of the readiness pipe a foreground daemon reports on (or nothing).

    Making one tells the parent this process's pid: `start` starts the daemon through a fork
    it does not see, and needs the pid to return it or to stop a daemon that hangs."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        self._write(f"{PID} {os.getpid()}")

    def _write(self, line: str) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (" ".join(line.split()) + "\n").encode())
        except OSError:  # the parent gave up waiting; nothing to tell
            self._close()

    def _close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def _send(self, line: str) -> None:
        self._write(line)
        self._close()

    def ready(self) -> None:
        """Tell the parent that the mount answers."""
        self._send(READY)

    def failed(self, message: str) -> None:
        """Tell the parent why mounting failed (one line)."""
        self._send(f"error: {message}")

    def warn(self, message: str) -> None:
        """Tell the parent something its user should see; the mount goes on."""
        self._write(f"{WARNING} {message}")


# -- the parent's end -----------------------------------------------------------------------


@contextlib.contextmanager
def cancelled_by(event: threading.Event) -> Iterator[None]:
    """While inside, `event` interrupts a `start` of this thread as Ctrl-C interrupts one of
    the main thread (the daemon stopped, KeyboardInterrupt raised): for worker threads, which
    never see SIGINT."""
    _CANCEL.event = event
    try:
        yield
    finally:
        _CANCEL.event = None


def start(args: Sequence[str], log_file: Path, timeout: float = SPAWN_TIMEOUT,
          launch: Launch | None = None) -> int:
    """Start `python -m weenvfs <args> --ready-fd N` as a daemon; return its pid once ready.

    `launch(args, ready_fd, log_fd)` may start it (True: it did; spawn.py passes the mount
    server's `mountd.launch`); otherwise, or without `launch` (how the server itself starts),
    `setsid --fork` starts a new interpreter. Either way the daemon is not a
    child of this process (see the module docstring): nothing to reap, ever. Raises
    WeenvError with the daemon's own error line, or naming the log file (a daemon that does
    not answer within `timeout` seconds is stopped first).
    """
    read_end, write_end = os.pipe()
    seen: list[int] = []  # the daemon's pid once read, also when Ctrl-C cuts the wait short
    try:
        try:
            with open(log_file, "ab") as log:
                if not (launch is not None and launch(list(args), write_end, log.fileno())):
                    _exec_detached(args, write_end, log)
            os.close(write_end)
            write_end = -1
            pid, line = _await_ready(read_end, timeout, seen)
        except KeyboardInterrupt:
            # Ctrl-C while the daemon starts: it runs in its own session and would finish
            # mounting unseen. Stop it (and whatever it mounted) before reporting.
            if write_end >= 0:
                os.close(write_end)
                write_end = -1
            _abandon(read_end, args, timeout, seen[0] if seen else None)
            raise
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    if line == READY and pid is not None:
        return pid
    if line is None:
        if pid is not None:
            _stop(pid)
        raise WeenvError(f"mount did not answer within {timeout:g} s; see {log_file}")
    if line.startswith("error: "):
        if pid is not None:
            with contextlib.suppress(WeenvError):
                wait_exit(pid, EXIT_TIMEOUT)
        raise WeenvError(line[len("error: "):])
    raise WeenvError(f"mount daemon exited before it answered; see {log_file}")


def _exec_detached(args: Sequence[str], ready_fd: int, log: IO[bytes]) -> None:
    """`setsid --fork python -m weenvfs ARGS --ready-fd N`: setsid forks, exits at once
    (reaped here) and its child execs the daemon in a new session."""
    with open(os.devnull, "rb") as devnull:
        launcher = subprocess.Popen(
            [_setsid(), "--fork", sys.executable, "-m", "weenvfs", *args,
             "--ready-fd", str(ready_fd)],
            stdin=devnull, stdout=log, stderr=log, pass_fds=(ready_fd,), cwd="/",
        )
    launcher.wait()


def _setsid() -> str:
    path = shutil.which("setsid")
    if path is None:
        raise WeenvError("setsid not found (install the Debian package util-linux)")
    return path


def _await_ready(
    fd: int, timeout: float, seen: list[int] | None = None
) -> tuple[int | None, str | None]:
    """The daemon's pid (from its `pid N` line, also appended to `seen` as soon as read) and
    its next line: `ok`, `error: ...`, '' at EOF (it exited), or None after `timeout`
    (`warning: ...` lines are logged on the way)."""
    deadline = time.monotonic() + timeout
    data, pid = b"", None
    while True:
        while b"\n" in data:
            raw, data = data.split(b"\n", 1)
            line = raw.decode(errors="replace").strip()
            word, _, rest = line.partition(" ")
            if word == PID and rest.isdigit() and pid is None:
                pid = int(rest)
                if seen is not None:
                    seen.append(pid)
                continue
            if word == WARNING:
                log.warning("%s", rest)
                continue
            return pid, line
        left = deadline - time.monotonic()
        if left <= 0:
            return pid, None
        cancel = getattr(_CANCEL, "event", None)
        if cancel is not None:
            if cancel.is_set():
                raise KeyboardInterrupt  # the spawn's own handler stops the daemon
            left = min(left, _POLL)
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        part = os.read(fd, 4096)
        if not part:
            return pid, ""
        data += part


def _abandon(fd: int, args: Sequence[str], timeout: float, pid: int | None) -> None:
    """Undo a spawn interrupted by Ctrl-C: wait (further Ctrl-Cs ignored) for the daemon's
    pid, or for the pipe to close (no daemon), stop the daemon, and unmount its mount point
    if it died mounted (a SIGTERM before its signal handler was installed)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        if pid is None:
            pid = _await_pid(fd, timeout)
        if pid is not None:
            _stop(pid)
        mountpoint = _mountpoint_of(args)
        if mountpoint is not None and is_mounted(mountpoint):
            with contextlib.suppress(OSError, WeenvError):
                force_unmount(mountpoint)
            remove_pid_file(mountpoint, pid)
        if mountpoint is not None:
            with contextlib.suppress(OSError, WeenvError):
                release_kernel_leftovers(mountpoint)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def _await_pid(fd: int, timeout: float) -> int | None:
    """The pid from the daemon's first line, or None once the pipe closes without one (or
    after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        part = os.read(fd, 4096)
        if not part:
            return None
        data += part
    word, _, rest = data.split(b"\n", 1)[0].decode(errors="replace").partition(" ")
    return int(rest) if word == PID and rest.strip().isdigit() else None


def _mountpoint_of(args: Sequence[str]) -> Path | None:
    """MOUNTPOINT of `mount REF MOUNTPOINT ...` (what `mount_args` builds), else None."""
    words = list(args)
    if "mount" not in words:
        return None
    at = words.index("mount") + 2
    return mount_path(words[at]) if at < len(words) else None


def _stop(pid: int) -> None:
    """SIGTERM a daemon that hangs, SIGKILL it if it does not exit in time."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return
        try:
            wait_exit(pid, EXIT_TIMEOUT)
            return
        except WeenvError:
            continue


# -- unmount --------------------------------------------------------------------------------


def fusermount() -> str:
    """Path of fusermount3 (Debian package fuse3)."""
    path = shutil.which("fusermount3")
    if path is None:
        raise WeenvError("fusermount3 not found (install the Debian package fuse3)")
    return path


def unmount(
    mountpoint: str | Path, lazy: bool = False, timeout: float = EXIT_TIMEOUT,
    remove: bool = False,
) -> int | None:
    """Unmount `mountpoint` and wait for its daemon to exit; return the daemon's pid if known.

    A stale mount whose daemon died is unmounted too. With `remove` (a mount point of our
    own) the folder is removed before the wait: copies of the mount in other mount
    namespaces go with it (mount_copies.py), else they keep the daemon serving them. Raises
    UsageError when nothing is mounted there, WeenvError when fusermount3 fails (e.g. busy
    without `lazy`) or the daemon does not exit in `timeout` seconds, and HeldElsewhere
    (unmounted here all the same) when it serves copies of the mount held elsewhere.
    """
    mp = mount_path(mountpoint)
    record = read_pid_file(mp)
    pid = record["pid"] if record is not None else None
    if not is_mounted(mp):
        release_kernel_leftovers(mp)
        if pid is not None and not process_alive(pid):
            remove_pid_file(mp, pid)
        raise UsageError(f"{mp} is not mounted")
    if is_kernel_mount(mp):
        _unmount_kernel(mp, pid, lazy)
    else:
        command = [fusermount(), "-u", *(["-z"] if lazy else []), str(mp)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            message = " ".join(done.stderr.split()) or f"fusermount3 exited with {done.returncode}"
            busy = os.strerror(errno.EBUSY)
            raise _refused(mp, busy if busy in message else message)
    if remove:
        remove_mount_folder(mp)
    if pid is not None:
        _wait_unless_held_elsewhere(pid, mp, timeout)
        remove_pid_file(mp, pid)
    return pid


class HeldElsewhere(WeenvError):
    """Unmounted here, but its daemon serves copies other mount namespaces hold."""


def _wait_unless_held_elsewhere(pid: int, mp: Path, timeout: float) -> None:
    """Wait for daemon `pid` of the mount just unmounted at `mp` to exit; WeenvError after
    `timeout` seconds, or HeldElsewhere, naming their processes, as soon as the daemon turns
    out to serve copies of the mount that other mount namespaces hold (it serves them until
    they unmount them or end: waiting longer cannot help). A copy of the mount point itself
    says so after HELD_CHECK seconds. A namespace that shows only a copy of the daemon's
    device folder may hold a copy in use (its removal detached it, lazily) or nothing that
    matters to a daemon still ending, so it is named only after HELD_CHECK_IN_USE."""
    devices = kernel_dir(mp) / "devices"
    waited = 0.0
    for until, watched in ((HELD_CHECK, (mp,)), (HELD_CHECK_IN_USE, (mp, devices))):
        step = max(0.0, min(until, timeout) - waited)
        try:
            wait_exit(pid, step)
            return
        except WeenvError as error:
            waited += step
            holders = holders_elsewhere(watched)
            if holders:
                raise HeldElsewhere(
                    f"mount daemon {pid} still runs: other mount namespaces hold a copy of "
                    f"{mp} ({describe(holders)}); it is served until they unmount it or "
                    "end") from None
            if waited >= timeout:
                raise error from None
    wait_exit(pid, timeout - waited)


def check_answers(mountpoint: Path, mounted: frozenset[bytes] | None = None) -> None:
    """Raise OSError (ENOTCONN for a dead daemon) unless the mount at `mountpoint` answers:
    its root, and on the kernel path its device folder too (EROFS answers stat from the
    kernel even when the daemon serving its data is gone). `mounted` as for `is_mounted`."""
    mp = mount_path(mountpoint)
    os.stat(mp)
    devices = kernel_dir(mp) / "devices"
    if is_mounted(devices, mounted):  # the kernel path (`is_kernel_mount`)
        # statfs always reaches the folder's server (a stat may be answered from the
        # attribute cache): pyfuse3 in the daemon, or the native server, which serves only
        # while the daemon lives (fuse/native_devices.py) and answers without asking it.
        os.statvfs(devices)


def force_unmount(mountpoint: Path) -> None:
    """Detach whatever is mounted at `mountpoint` and, for a kernel-path mount whose daemon
    died, its private layers and device folder; never fails."""
    mp = mount_path(mountpoint)
    record = read_pid_file(mp)
    pid = record["pid"] if record is not None else None
    if is_kernel_mount(mp):
        with contextlib.suppress(WeenvError):
            _unmount_kernel(mp, pid if pid is not None and process_alive(pid) else None,
                            lazy=True)
        return
    subprocess.run([fusermount(), "-u", "-z", str(mp)], capture_output=True, check=False)


def release_kernel_leftovers(mountpoint: Path) -> None:
    """Detach the private layers and device folder of a kernel-path mount at `mountpoint`
    whose daemon is gone (killed before it could clean up); a live daemon cleans up itself."""
    mp = mount_path(mountpoint)
    if not is_kernel_mount(mp):
        return
    record = read_pid_file(mp)
    if record is not None and process_alive(record["pid"]):
        return
    _detach_private(kernel_dir(mp))
    remove_pid_file(mp)


def _detach_private(folder: Path) -> None:
    from . import syscalls

    for layer in sorted((folder / "layers").glob("*")):
        with contextlib.suppress(OSError):
            syscalls.umount(layer, detach=True)
    subprocess.run([fusermount(), "-u", "-z", str(folder / "devices")], capture_output=True,
                   check=False)
    for path in (*(folder / "layers").glob("*"), folder / "layers", folder / "devices",
                 folder):
        with contextlib.suppress(OSError):
            path.rmdir()


def _refused(mp: Path, why: str) -> WeenvError:
    """The one-line error of an unmount the kernel refused, with the way out when busy."""
    if why == os.strerror(errno.EBUSY):
        why += (" (a process has a file or its working folder in it; `weenv umount --lazy`"
                " detaches it now and releases it when they are done)")
    return WeenvError(f"cannot unmount {mp}: {why}")


def _unmount_kernel(mp: Path, pid: int | None, lazy: bool) -> None:
    """Unmount a kernel-path mount: the mount point here (EBUSY is an error unless `lazy`),
    then the daemon unmounts its private layers and exits once the kernel released its
    devices (SIGTERM; a daemon that is gone leaves a dead device folder, detached here)."""
    from . import syscalls

    try:
        syscalls.umount(mp, detach=lazy)
    except OSError as error:
        raise _refused(mp, os.strerror(error.errno) if error.errno else str(error)) from None
    if pid is not None and process_alive(pid):
        # One layer: the kernel released the device with the mount point and the daemon
        # stops by itself (a SIGTERM racing its teardown would cut it short). Several: its
        # private layer mounts still hold the devices, so it is told to unmount them.
        if (kernel_dir(mp) / "layers").exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return
    _detach_private(kernel_dir(mp))


def is_mounted(mountpoint: Path, mounted: frozenset[bytes] | None = None) -> bool:
    """Whether something is mounted at `mountpoint` (from /proc/self/mounts, so a dead FUSE
    mount, which cannot be stat'ed, counts too; or from `mounted`, what `mount_points`
    returned, when the caller asks about many)."""
    if mounted is None:
        mounted = mount_points()
        if mounted is None:
            return os.path.ismount(mountpoint)
    return os.fsencode(str(mount_path(mountpoint))) in mounted


def mount_points() -> frozenset[bytes] | None:
    """Every mount point of this mount namespace, from one read of /proc/self/mounts (each
    read makes the kernel print every mount: a node with 30 sandboxes has hundreds); None
    if it cannot be read."""
    try:
        with open("/proc/self/mounts", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    return frozenset(unescape_mount_field(line.split(b" ")[1]) for line in lines if b" " in line)


def wait_exit(pid: int, timeout: float) -> None:
    """Wait until process `pid` has exited; WeenvError after `timeout` seconds. Woken by the
    exit itself (a pidfd: the daemon is not our child), not by polling: an unmount waited
    25 ms on average for the poll after its daemon was gone (a first run's end, once)."""
    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds (an old kernel, a seccomp filter): poll instead
        pidfd = -1
    try:
        while process_alive(pid):
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeenvError(f"mount daemon {pid} did not exit within {timeout:g} s")
            if pidfd < 0:
                time.sleep(min(left, _POLL))
            else:
                select.select([pidfd], [], [], left)  # readable once the process exited
    finally:
        if pidfd >= 0:
            os.close(pidfd)
