"""Where builds and conversions stage their files, and finding the stagings of ones that died.

Owns: `Staging`, a folder `weenv-<kind>-<pid>-<random>` in the staging folder (`tmp_dir`,
default the system's temp folder), locked (an exclusive flock) while its owner runs and
removed by `close()` however the owner ends (short of SIGKILL); `staging_dir` is the context
manager, and `check_tmp_dir` refuses a `--tmp-dir` that cannot hold one before any work. The
kinds: `build` and `convert` (blob files), `pull` (layers downloaded from a registry) and
`archive` (a compressed docker archive, decompressed). And `stale_stagings` /
`remove_stale`, which find and remove the folders of owners that can no longer clean up after
themselves. A staging folder is stale when its owner pid is not alive *and* its lock is free
(the lock also covers owners in another pid namespace that share the folder), or, for the
older folders without a pid, when it is older than the grace period. Every build and
conversion sweeps its staging folder, and `weenv gc` lists and removes them in the system's
temp folder.

Must not: touch anything in the folder whose name does not match, or follow symlinks.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from weenvfs.errors import UsageError, WeenvError

log = logging.getLogger(__name__)

PREFIX = "weenv-"
KINDS = ("build", "convert", "pull", "archive")
_KIND = "(?:" + "|".join(KINDS) + ")"
_CURRENT = re.compile(rf"weenv-{_KIND}-(\d+)-[A-Za-z0-9_]+")
# The names tempfile.mkdtemp gave stagings before: no pid, no lock.
_LEGACY = re.compile(rf"weenv-{_KIND}-[A-Za-z0-9_]{{8}}")
LEGACY_GRACE = 3600.0


@dataclass(frozen=True)
class StaleStaging:
    """A stale staging folder and the bytes it holds."""

    path: Path
    size: int


def staging_parent(tmp_dir: Path | str | None) -> Path:
    return Path(tmp_dir) if tmp_dir is not None else Path(tempfile.gettempdir())


def check_tmp_dir(tmp_dir: Path | str | None, option: str = "--tmp-dir") -> None:
    """Refuse, as bad input (UsageError, one line naming `option`), a staging folder given by
    the user that cannot hold stagings: absent, not a directory, or not writable. Checked
    before a command does any work, so it fails at once rather than after a download."""
    if tmp_dir is None:
        return
    try:
        st = os.stat(tmp_dir)
    except FileNotFoundError:
        raise UsageError(f"{option} {tmp_dir}: no such directory") from None
    except OSError as error:
        raise UsageError(f"{option} {tmp_dir}: {error.strerror or error}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{option} {tmp_dir}: not a directory")
    if not os.access(tmp_dir, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {tmp_dir}: not writable")


class Staging:
    """A fresh staging folder of a `kind` (one of KINDS), locked until `close()` removes it.

    For owners that outlive one `with` block (an image source holds its downloads until it is
    closed); `staging_dir` is the context manager."""

    def __init__(self, tmp_dir: Path | str | None, kind: str) -> None:
        assert kind in KINDS, kind
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f"weenv-{kind}-{os.getpid()}-", dir=tmp_dir))
        except OSError as error:  # gone or full since check_tmp_dir, or the system's
            raise WeenvError(
                f"cannot create a staging folder in {staging_parent(tmp_dir)}: "
                f"{error.strerror or error}"
            ) from None
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # Until the lock is taken, our pid (alive) in the name keeps sweepers away.
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        """Remove the folder and release its lock (once; later calls do nothing)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


@contextmanager
def staging_dir(tmp_dir: Path | str | None, kind: str = "build") -> Iterator[Path]:
    """A fresh, locked staging folder of a `kind` (one of KINDS), removed on exit."""
    staging = Staging(tmp_dir, kind)
    try:
        yield staging.path
    finally:
        staging.close()


def stale_stagings(
    tmp_dir: Path | str | None, grace: float = LEGACY_GRACE, now: float | None = None
) -> list[StaleStaging]:
    """The stale staging folders in `tmp_dir` (default: the system's temp folder)."""
    parent = staging_parent(tmp_dir)
    now = time.time() if now is None else now
    out = []
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(PREFIX))
    except OSError:
        return []
    for name in names:
        path = parent / name
        if _is_stale(path, name, grace, now):
            out.append(StaleStaging(path, _tree_size(path)))
    return out


def remove_stale(
    tmp_dir: Path | str | None, grace: float = LEGACY_GRACE, now: float | None = None
) -> list[StaleStaging]:
    """Remove the stale staging folders in `tmp_dir`; returns what was removed."""
    removed = []
    for staging in stale_stagings(tmp_dir, grace, now):
        fd = _lock(staging.path)
        if fd is None:
            continue  # taken meanwhile (cannot happen for a dead owner, but be sure)
        try:
            shutil.rmtree(staging.path, ignore_errors=True)
        finally:
            os.close(fd)
        if not staging.path.exists():
            log.info("removed the stale staging %s (%d bytes)", staging.path, staging.size)
            removed.append(staging)
    return removed


def _is_stale(path: Path, name: str, grace: float, now: float) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    current = _CURRENT.fullmatch(name)
    if current is None:
        return _LEGACY.fullmatch(name) is not None and now - st.st_mtime >= grace
    if _alive(int(current.group(1))):
        return False
    fd = _lock(path)
    if fd is None:
        return False
    os.close(fd)
    return True


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def _lock(path: Path) -> int | None:
    """An fd of `path` holding its exclusive lock, or None if someone else holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
