"""A sandbox's root file system on the host: overlay and tmpfs mounts, safe access, users.

Owns:
- `mount_overlay` / `mount_tmpfs` / `unmount`: mount(2) and umount2(2) through libc (a reset
  does four of them; forking /bin/mount would cost more than the mounts);
- `open_in_root`, `read_in_root`, `write_in_root`, `make_dirs`: file access inside a sandbox's
  root from the host with openat2(RESOLVE_IN_ROOT), so a symlink the sandbox planted
  (`/etc/x -> /etc/shadow`) resolves inside the sandbox, never on the host;
- `resolve_user`: Docker's `user` forms (`name`, `uid`, `name:group`, `uid:gid`, ...) against
  the image's /etc/passwd and /etc/group, with supplementary groups and the home directory.

Must not: know sandboxes, state files or the launcher.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from weenvfs.errors import UsageError, WeenvError

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

MNT_DETACH = 2
MS_NOSUID = 0x2
MS_NODEV = 0x4
SYS_OPENAT2 = 437  # the same number on every architecture (added after the syscall unification)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount_overlay(target: Path, lowers: Sequence[Path], upper: Path, work: Path) -> None:
    """Mount overlayfs at `target`: `lowers` (topmost first) read-only below, writes in
    `upper`.

    `volatile` skips every sync to the upper: a sandbox's upper is thrown away (or kept for
    inspection only), so durability across a power loss buys nothing and fsync-heavy
    installers (dpkg, pip) would pay for it. A reset always starts from fresh upper/work dirs,
    which volatile requires.
    """
    lowerdir = ":".join(str(p) for p in lowers)
    options = f"lowerdir={lowerdir},upperdir={upper},workdir={work},volatile"
    _check(_libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, options.encode()),
           f"mount overlay at {target}")


def mount_tmpfs(target: Path, size: int | None) -> None:
    """Mount a private tmpfs at `target` (`size` bytes, or the kernel's default half of RAM)."""
    options = "mode=0700" + (f",size={size}" if size else "")
    _check(_libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", MS_NOSUID | MS_NODEV,
                       options.encode()), f"mount tmpfs at {target}")


def unmount(target: Path) -> bool:
    """Unmount `target`; lazily if it is busy. False when nothing was mounted there."""
    path = os.fsencode(target)
    if _libc.umount2(path, 0) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):
        return False  # not a mount point (any more)
    if code == errno.EBUSY:
        log.info("%s is busy, detaching it lazily", target)
        _check(_libc.umount2(path, MNT_DETACH), f"unmount {target}")
        return True
    raise OSError(code, f"unmount {target}: {os.strerror(code)}")


def is_mount_point(target: Path) -> bool:
    """Whether `target` is listed in /proc/self/mounts."""
    return mounts_at(target)[0]


def mounts_at(target: Path) -> tuple[bool, bool]:
    """Whether `target` is listed in /proc/self/mounts, and whether anything is mounted below
    it (one read of the table)."""
    wanted = os.fsencode(os.path.abspath(target))
    below = wanted + b"/"
    at = under = False
    with open("/proc/self/mounts", "rb") as f:
        for fields in (line.split(b" ") for line in f):
            if len(fields) > 1:
                at = at or fields[1] == wanted
                under = under or fields[1].startswith(below)
    return at, under


# -- safe access inside the root --------------------------------------------------------------


def open_in_root(root: Path, path: str, flags: int, mode: int = 0o644) -> int:
    """openat2(`root`, `path`, RESOLVE_IN_ROOT): `..` and symlinks cannot leave `root`."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                       RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(SYS_OPENAT2, root_fd, os.fsencode(path.lstrip("/") or "."),
                           ctypes.byref(how), ctypes.sizeof(how))
    finally:
        os.close(root_fd)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return int(fd)


def read_in_root(root: Path, path: str) -> bytes:
    """The whole content of file `path` inside `root`."""
    fd = open_in_root(root, path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_in_root(root: Path, path: str, data: bytes, mode: int, owner: tuple[int, int]) -> None:
    """Write file `path` inside `root` (truncating it); a new file gets `mode` and `owner`."""
    try:
        fd = open_in_root(root, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        os.fchown(fd, *owner)
        os.fchmod(fd, mode)  # the umask must not narrow what the caller asked for
    except FileExistsError:  # an existing file, or a symlink (O_EXCL does not follow it)
        fd = open_in_root(root, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_dirs(root: Path, path: str, owner: tuple[int, int], mode: int = 0o755) -> None:
    """`mkdir -p path` inside `root`; directories it creates get `owner` and `mode`."""
    parts = [p for p in path.split("/") if p and p != "."]
    for depth in range(1, len(parts) + 1):
        here = "/".join(parts[:depth])
        try:
            os.close(open_in_root(root, here, os.O_PATH | os.O_DIRECTORY))
            continue
        except FileNotFoundError:
            pass
        parent = open_in_root(root, "/".join(parts[: depth - 1]), os.O_PATH | os.O_DIRECTORY)
        try:
            os.mkdir(parts[depth - 1], mode, dir_fd=parent)
            os.chown(parts[depth - 1], *owner, dir_fd=parent, follow_symlinks=False)
            os.chmod(parts[depth - 1], mode, dir_fd=parent)
        except FileExistsError:
            pass  # created concurrently
        finally:
            os.close(parent)


def is_dir_in_root(root: Path, path: str) -> bool:
    """Whether `path` names a directory inside `root` (symlinks resolved inside it)."""
    try:
        os.close(open_in_root(root, path, os.O_PATH | os.O_DIRECTORY))
    except OSError:
        return False
    return True


FOUND, NOT_EXECUTABLE, IS_DIRECTORY, MISSING = "found", "not executable", "a directory", "missing"


def find_executable(root: Path, name: str, env: tuple[str, ...], cwd: str) -> str:
    """How `name` resolves inside `root`, as execvp would look for it (through PATH from
    `env` unless it contains a slash): FOUND (an executable file), else what the first
    candidate that exists is (NOT_EXECUTABLE, IS_DIRECTORY: execvp's EACCES, a shell's 126),
    else MISSING (ENOENT, 127)."""
    if "/" in name:
        candidates = [name if name.startswith("/") else f"{cwd.rstrip('/')}/{name}"]
    else:
        path = next((e[5:] for e in env if e.startswith("PATH=")), "/usr/bin:/bin")
        candidates = [f"{d.rstrip('/') or ''}/{name}" for d in path.split(":") if d]
    seen = MISSING
    for candidate in candidates:
        try:
            fd = open_in_root(root, candidate, os.O_PATH)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
            return FOUND
        if seen == MISSING:
            seen = IS_DIRECTORY if stat.S_ISDIR(st.st_mode) else NOT_EXECUTABLE
    return seen


# -- users ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class User:
    """Who a sandbox's processes run as."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def _table(root: Path, path: str) -> list[list[str]]:
    try:
        text = read_in_root(root, path).decode(errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines()
            if line and not line.startswith("#") and line.count(":") >= 2]


def _passwd_entry(passwd: list[list[str]], name: str) -> list[str] | None:
    by_name = [row for row in passwd if row[0] == name and len(row) >= 6]
    if by_name:
        return by_name[0]
    if name.isdigit():
        by_uid = [row for row in passwd if len(row) >= 6 and row[2] == name]
        return by_uid[0] if by_uid else None
    return None


def _group_id(groups: list[list[str]], name: str) -> int:
    if name.isdigit():
        return int(name)
    for row in groups:
        if row[0] == name and row[2].isdigit():
            return int(row[2])
    raise UsageError(f"no group {name!r} in the environment's /etc/group")


def resolve_user(root: Path, spec: str) -> User:
    """Resolve a user spec as Docker does: `""` is root; `user` or `uid`, optionally
    `:group` or `:gid`. Names come from the image's /etc/passwd and /etc/group; a numeric uid
    absent from /etc/passwd runs with gid 0 (or the given one) and home `/`."""
    user_part, _, group_part = spec.strip().partition(":")
    user_part = user_part or "0"
    passwd = _table(root, "/etc/passwd")
    entry = _passwd_entry(passwd, user_part)
    if entry is None and not user_part.isdigit():
        raise UsageError(f"no user {user_part!r} in the environment's /etc/passwd")
    uid = int(entry[2]) if entry else int(user_part)
    home = entry[5] if entry and entry[5] else "/"
    groups_table = _table(root, "/etc/group")
    if group_part:
        gid = _group_id(groups_table, group_part)
    else:
        gid = int(entry[3]) if entry and entry[3].isdigit() else 0
    name = entry[0] if entry else None
    extra: list[int] = []
    if name is not None and not group_part:
        for row in groups_table:
            members = row[3].split(",") if len(row) > 3 else []
            if name in members and row[2].isdigit() and int(row[2]) != gid:
                extra.append(int(row[2]))
    return User(uid, gid, tuple(sorted(set(extra))), home)


def env_list(base: tuple[str, ...], extra: dict[str, str], user: User) -> tuple[str, ...]:
    """The process environment: the image's, then `extra`, plus PATH and HOME if missing."""
    merged: dict[str, str] = {}
    for item in base:
        key, sep, value = item.partition("=")
        if sep:
            merged[key] = value
    merged.update(extra)
    merged.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    merged.setdefault("HOME", user.home)
    return tuple(f"{k}={v}" for k, v in merged.items())


def check_inside(path: str) -> str:
    """An absolute path inside a sandbox (raises UsageError otherwise)."""
    if not path.startswith("/"):
        raise UsageError(f"path {path!r} must be absolute (inside the sandbox)")
    if "\0" in path:
        raise WeenvError("path contains a NUL byte")
    return path
