"""Shared lazy FUSE mounts on a node, one per key, used by every sandbox that needs them.

A key is 64 hex digits: an environment's manifest digest for its merged mount, or the digest
of a group stack for the mount of one group as an overlayfs layer (lowers.py decides which).
Owns the folder `/run/weenv/envs/<key>/`:

    lock            flock'ed by whoever changes anything below (any process)
    root/           the mount point (`weenv mount <manifest digest> [--layer N]`, daemon
                    started by fuse/daemon.py; it is not our child, so whichever process
                    unmounts only waits for its pid)
    holders/<id>    one empty file per sandbox that uses the mount: the reference count
    mount.json      store URL, cache folder, log file, and `warm_until` / `timer_pid` while
                    the mount is kept warm with no holder
    hint.json       a recording mount's outcome (what its daemon published on unmount)

The count is the set of holder files, not a number, so a crashed process can never leave it
wrong: a holder whose sandbox folder is gone is stale, and `prune_holders` (run by every
acquire and by `weenv sandbox gc`) drops it. When the last holder releases, the mount is
unmounted at once, or kept warm for `keep_warm` seconds: a detached `weenv sandbox gc
--mounts-only --after SECS` timer unmounts it then unless a sandbox took it again. A recording
mount (`record`, runtime/recording.py) is never kept warm: its daemon publishes the recorded
hint when it is unmounted, and `release` returns what it published.

Must not: serve the mount (fuse/), or create sandboxes (sandbox.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError, WeenvError
from weenvfs.fuse import daemon
from weenvfs.fuse.commands import mount_args

log = logging.getLogger(__name__)

ENVS_ROOT = Path("/run/weenv/envs")
KEY_LEN = 64
RESULT_FILE = "hint.json"
RECORD_TAG = "latest"  # the hint tag a recording mount publishes (recording.HINT_TAG)


@dataclass(frozen=True)
class MountInfo:
    """What `weenv sandbox ls` and gc need to know about one shared mount."""

    key: str
    mountpoint: Path
    mounted: bool
    holders: tuple[str, ...]
    warm_until: float | None
    env: str | None = None  # the manifest digest it was mounted from
    layer: int | None = None  # the group it serves as an overlay layer (None: merged)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (`weenv sandbox ls --json`)."""
        return {"key": self.key, "mountpoint": str(self.mountpoint),
                "mounted": self.mounted, "holders": list(self.holders),
                "warm_until": self.warm_until, "env": self.env, "layer": self.layer}


def env_dir(key: str) -> Path:
    """The folder of mount `key`."""
    if len(key) != KEY_LEN or not all(c in "0123456789abcdef" for c in key):
        raise UsageError(f"not a mount key (64 hex digits): {key!r}")
    return ENVS_ROOT / key


def mountpoint(key: str) -> Path:
    """Where mount `key` is mounted on this node."""
    return env_dir(key) / "root"


@contextlib.contextmanager
def locked(key: str) -> Iterator[Path]:
    """Hold the environment's lock (blocking); yields its folder.

    A teardown removes the folder, lock file included, while holding the lock. A waiter that
    then wakes holds a lock on an unlinked file, so it checks that the path still names the
    file it locked and starts over otherwise (as the chunk cache's locks do)."""
    folder = env_dir(key)
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # a teardown removed the folder between our mkdir and open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = -1
            if current != os.fstat(fd).st_ino:
                continue  # finally closes fd
            yield folder
            return
        finally:
            os.close(fd)


def _read_info(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "mount.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_info(folder: Path, info: dict[str, Any]) -> None:
    tmp = folder / ".mount.json.tmp"
    tmp.write_text(json.dumps(info))
    tmp.replace(folder / "mount.json")


def _holders(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in (folder / "holders").iterdir())
    except FileNotFoundError:
        return []


def _alive_mount(mp: Path) -> bool:
    """Mounted and answering (a dead daemon leaves a mount that fails with ENOTCONN)."""
    if not daemon.is_mounted(mp):
        return False
    try:
        daemon.check_answers(mp)
    except OSError as error:
        log.warning("environment mount %s is dead (%s); remounting", mp, error.strerror)
        _force_unmount(mp)
        return False
    return True


def acquire(
    key: str, holder: str, *, store_url: str, cache_dir: Path,
    is_live: Callable[[str], bool], env: str | None = None, layer: int | None = None,
    record: bool = False,
) -> Path:
    """Register `holder` as a user of mount `key`, mounting it if needed; return the mount
    point. `is_live(holder_id)` tells stale holders (crashed sandboxes) apart. The mount is
    of environment `env` (default: `key`, a manifest digest), or of its group `layer`; with
    `record` it records what is read and publishes it as the hint when unmounted."""
    with locked(key) as folder:
        prune_holders(folder, is_live)
        mp = folder / "root"
        info = _read_info(folder)
        if not _alive_mount(mp):
            mp.mkdir(exist_ok=True)
            info = _mount(env or key, mp, store_url, cache_dir, layer,
                          folder / RESULT_FILE if record else None)
        _stop_timer(info)
        info.pop("warm_until", None)
        _write_info(folder, info)
        (folder / "holders").mkdir(exist_ok=True)
        (folder / "holders" / holder).touch()
        return mp


def _mount(
    env: str, mp: Path, store_url: str, cache_dir: Path, layer: int | None,
    record_result: Path | None = None,
) -> dict[str, Any]:
    cache_dir = cache_dir.absolute()
    cache_dir.mkdir(parents=True, exist_ok=True)
    what = f"env-{env[:12]}" + ("" if layer is None else f"-layer{layer}") + (
        "-record" if record_result is not None else "")
    log_file = cache_dir / "logs" / f"{what}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    # A recording mount has no hint to replay (that is why it records).
    recording = {} if record_result is None else {
        "hint": "none", "record_tag": RECORD_TAG, "record_result": record_result}
    args = mount_args(env, mp, store_url, cache_dir, log_file=log_file, allow_other=True,
                      layer=layer, **recording)
    started = time.monotonic()
    pid = daemon.spawn(args, log_file)
    log.info("mounted %s at %s in %.0f ms (daemon %d)", what, mp,
             (time.monotonic() - started) * 1000, pid)
    return {"store": store_url, "cache": str(cache_dir), "log_file": str(log_file), "pid": pid,
            "env": env, "layer": layer, "record": record_result is not None}


def release(key: str, holder: str, keep_warm: float = 0.0) -> dict[str, Any] | None:
    """Drop `holder`; unmount when no holder is left, now or after `keep_warm` seconds. A
    release by a process that does not hold the mount changes nothing (a sandbox whose build
    stopped before taking it must not unmount what others keep warm). Returns what a
    recording mount published when this release unmounted it (its hint.json), else None."""
    with locked(key) as folder:
        try:
            (folder / "holders" / holder).unlink()
        except FileNotFoundError:
            return None
        if _holders(folder):
            return None
        recording = bool(_read_info(folder).get("record"))
        if keep_warm > 0 and not recording and daemon.is_mounted(folder / "root"):
            info = _read_info(folder)
            _stop_timer(info)
            info["warm_until"] = time.time() + keep_warm
            info["timer_pid"] = _start_timer(keep_warm)
            _write_info(folder, info)
            return None
        return _teardown(folder)


def prune_holders(folder: Path, is_live: Callable[[str], bool]) -> list[str]:
    """Remove holder files of sandboxes that no longer exist; return their ids."""
    stale = [h for h in _holders(folder) if not is_live(h)]
    for holder in stale:
        (folder / "holders" / holder).unlink(missing_ok=True)
        log.info("dropped stale holder %s of environment %s", holder, folder.name[:12])
    return stale


def expire(key: str, is_live: Callable[[str], bool], now: float | None = None) -> bool:
    """Unmount mount `key` if it has no live holder and is not kept warm past `now`;
    return whether it was torn down."""
    with locked(key) as folder:
        prune_holders(folder, is_live)
        if _holders(folder):
            return False
        warm_until = _read_info(folder).get("warm_until")
        if isinstance(warm_until, int | float) and warm_until > (now or time.time()):
            return False
        _teardown(folder)
        return True


def _teardown(folder: Path) -> dict[str, Any] | None:
    """Unmount (lazily if an overlay still pins it) and remove the folder but its lock;
    return a recording mount's outcome (written by its daemon once unmounted)."""
    mp = folder / "root"
    info = _read_info(folder)
    _stop_timer(info)
    if daemon.is_mounted(mp):
        try:
            daemon.unmount(mp)
        except WeenvError as error:
            log.info("unmounting %s lazily: %s", mp, error)
            _force_unmount(mp)
            _wait_daemon(info)
        log.info("unmounted environment %s", folder.name[:12])
    daemon.release_kernel_leftovers(mp)
    outcome = _read_outcome(folder) if info.get("record") else None
    # Everything goes, the lock file last while still held (see `locked`).
    for child in folder.iterdir():
        if child.name == "lock":
            continue
        if child.is_dir() and not child.is_symlink():
            if child == mp:
                with contextlib.suppress(OSError):
                    mp.rmdir()  # never rmtree a mount point, even one detached lazily
            else:
                shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    (folder / "lock").unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
    return outcome


def _read_outcome(folder: Path) -> dict[str, Any] | None:
    try:
        outcome = json.loads((folder / RESULT_FILE).read_text())
    except (OSError, ValueError):
        log.warning("the recording mount %s reported no hint; see its log", folder.name[:12])
        return None
    return outcome if isinstance(outcome, dict) else None


def _force_unmount(mp: Path) -> None:
    daemon.force_unmount(mp)


def _wait_daemon(info: dict[str, Any]) -> None:
    pid = info.get("pid")
    if isinstance(pid, int):
        with contextlib.suppress(WeenvError):
            daemon.wait_exit(pid, daemon.EXIT_TIMEOUT)


def _start_timer(seconds: float) -> int:
    """A detached `weenv sandbox gc --mounts-only --after SECS`; returns its pid.

    Started through a shell that exits at once, so the timer is not our child: a process
    that opens environments for hours must not collect zombies."""
    command = [sys.executable, "-m", "weenvfs", "sandbox", "gc", "--mounts-only",
               "--after", repr(seconds)]
    done = subprocess.run(
        ["/bin/sh", "-c", '"$@" > /dev/null 2>&1 < /dev/null & echo $!', "sh", *command],
        capture_output=True, text=True, check=True, start_new_session=True, cwd="/",
    )
    return int(done.stdout.strip())


def _stop_timer(info: dict[str, Any]) -> None:
    """Stop the keep-warm timer recorded in `info` (only if it still is our timer)."""
    pid = info.pop("timer_pid", None)
    if not isinstance(pid, int) or pid == os.getpid():
        return  # none, or we are the timer (expiring the mount it was started for)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"--mounts-only" in cmdline and b"weenvfs" in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def list_mounts() -> list[MountInfo]:
    """Every shared mount folder on this node."""
    try:
        folders = sorted(p for p in ENVS_ROOT.iterdir() if len(p.name) == KEY_LEN)
    except FileNotFoundError:
        return []
    out = []
    for folder in folders:
        info = _read_info(folder)
        warm, env, layer = info.get("warm_until"), info.get("env"), info.get("layer")
        out.append(MountInfo(folder.name, folder / "root", daemon.is_mounted(folder / "root"),
                           tuple(_holders(folder)),
                           float(warm) if isinstance(warm, int | float) else None,
                           env if isinstance(env, str) else None,
                           layer if isinstance(layer, int) else None))
    return out
