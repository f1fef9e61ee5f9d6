"""Running a mount in the background and stopping it: spawn, readiness, pid files, unmount.

Owns:
- `spawn`: start `python -m weenvfs mount --foreground ... --ready-fd N` in a new session
  (working directory /, stdin /dev/null, stdout and stderr appended to the log file; every
  path in its arguments must be absolute) and wait, with a timeout,
  until it writes `ok` on the pipe (the mount answers) or an error line (reported as is);
- `ReadyPipe`: the child's end of that pipe;
- pid files, one per mount point, in `RUN_DIR` (`/run/weenv/mounts` for root, else under
  $XDG_RUNTIME_DIR or /tmp): JSON with pid, mount point, reference and log file, written once
  the mount answers and removed when the daemon exits;
- `unmount`: `fusermount3 -u [-z]`, then wait for the daemon of that mount point to exit.

Must not: serve requests (mount.py) or parse arguments (commands.py).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError, WeenvError

READY = "ok"
SPAWN_TIMEOUT = 60.0  # seconds for the daemon to mount and answer
EXIT_TIMEOUT = 30.0  # seconds for a daemon to exit after its unmount
_POLL = 0.05


def run_dir() -> Path:
    """Where pid files live: /run/weenv/mounts for root, a per-user folder otherwise."""
    if os.geteuid() == 0:
        return Path("/run/weenv/mounts")
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/weenv-{os.geteuid()}"
    return Path(base) / "weenv" / "mounts"


def mount_path(mountpoint: str | Path) -> Path:
    """The absolute, normalized mount point (symlinks not resolved: a dead FUSE mount cannot
    be stat'ed, and pyfuse3 mounts at `os.path.abspath` too)."""
    return Path(os.path.abspath(mountpoint))


def pid_file(mountpoint: Path) -> Path:
    """The pid file of the daemon serving `mountpoint`."""
    name = urllib.parse.quote(str(mount_path(mountpoint)), safe="")
    return run_dir() / f"{name[:240]}.pid"


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


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as exited: its parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


# -- the child's end ------------------------------------------------------------------------


class ReadyPipe:
    """The write end of the readiness pipe a foreground child reports on (or nothing)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def _send(self, line: str) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (" ".join(line.split()) + "\n").encode())
            os.close(self.fd)
        except OSError:
            pass  # the parent gave up waiting; nothing to tell
        self.fd = None

    def ready(self) -> None:
        """Tell the parent that the mount answers."""
        self._send(READY)

    def failed(self, message: str) -> None:
        """Tell the parent why mounting failed (one line)."""
        self._send(f"error: {message}")


# -- the parent's end -----------------------------------------------------------------------


def spawn(args: Sequence[str], log_file: Path, timeout: float = SPAWN_TIMEOUT) -> int:
    """Start `python -m weenvfs <args> --ready-fd N` detached; return its pid once ready.

    Raises WeenvError with the child's own error line, or naming the log file.
    """
    read_end, write_end = os.pipe()
    try:
        with open(log_file, "ab") as log, open(os.devnull, "rb") as devnull:
            child = subprocess.Popen(
                [sys.executable, "-m", "weenvfs", *args, "--ready-fd", str(write_end)],
                stdin=devnull, stdout=log, stderr=log, pass_fds=(write_end,),
                start_new_session=True, cwd="/",
            )
        os.close(write_end)
        write_end = -1
        line = _read_line(read_end, child, timeout)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    if line == READY:
        child.returncode = 0  # detached on purpose: do not warn that it is still running
        return child.pid
    if line is None:
        _stop(child)
        raise WeenvError(f"mount did not answer within {timeout:g} s; see {log_file}")
    if line.startswith("error: "):
        child.wait(EXIT_TIMEOUT)
        raise WeenvError(line[len("error: "):])
    code = child.wait(EXIT_TIMEOUT)
    raise WeenvError(f"mount daemon exited with status {code}; see {log_file}")


def _read_line(fd: int, child: subprocess.Popen[bytes], timeout: float) -> str | None:
    """The first line on `fd` ('' at EOF), or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        part = os.read(fd, 4096)
        if not part:
            break
        data += part
    return data.split(b"\n", 1)[0].decode(errors="replace").strip()


def _stop(child: subprocess.Popen[bytes]) -> None:
    child.terminate()
    try:
        child.wait(EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


# -- unmount --------------------------------------------------------------------------------


def fusermount() -> str:
    """Path of fusermount3 (Debian package fuse3)."""
    path = shutil.which("fusermount3")
    if path is None:
        raise WeenvError("fusermount3 not found (install the Debian package fuse3)")
    return path


def unmount(
    mountpoint: str | Path, lazy: bool = False, timeout: float = EXIT_TIMEOUT
) -> int | None:
    """Unmount `mountpoint` and wait for its daemon to exit; return the daemon's pid if known.

    A stale mount whose daemon died is unmounted too. Raises UsageError when nothing is
    mounted there and WeenvError when fusermount3 fails (e.g. busy without `lazy`) or the
    daemon does not exit in `timeout` seconds.
    """
    mp = mount_path(mountpoint)
    record = read_pid_file(mp)
    pid = record["pid"] if record is not None else None
    if not is_mounted(mp):
        if pid is not None and not process_alive(pid):
            remove_pid_file(mp, pid)
        raise UsageError(f"{mp} is not mounted")
    command = [fusermount(), "-u", *(["-z"] if lazy else []), str(mp)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        message = " ".join(done.stderr.split()) or f"fusermount3 exited with {done.returncode}"
        raise WeenvError(f"cannot unmount {mp}: {message}")
    if pid is not None:
        wait_exit(pid, timeout)
        remove_pid_file(mp, pid)
    return pid


def is_mounted(mountpoint: Path) -> bool:
    """Whether something is mounted at `mountpoint` (from /proc/self/mounts, so a dead FUSE
    mount, which cannot be stat'ed, counts too)."""
    target = os.fsencode(str(mount_path(mountpoint)))
    try:
        with open("/proc/self/mounts", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return os.path.ismount(mountpoint)
    return any(_unescape(line.split(b" ")[1]) == target for line in lines if b" " in line)


def _unescape(field: bytes) -> bytes:
    """Undo the octal escapes (\\040 for a space) of /proc/self/mounts."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field)


def wait_exit(pid: int, timeout: float) -> None:
    """Wait until process `pid` has exited; WeenvError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        if time.monotonic() > deadline:
            raise WeenvError(f"mount daemon {pid} did not exit within {timeout:g} s")
        time.sleep(_POLL)
