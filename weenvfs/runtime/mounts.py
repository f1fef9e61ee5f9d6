"""Shared lazy FUSE mounts on a node, one per key, used by every sandbox that needs them.

A key is 64 hex digits: an environment's manifest digest for its merged mount, or the digest
of a group stack for the mount of one group as an overlayfs layer (lowers.py decides which).
Owns the folder `/run/weenv/envs/<key>/`:

    lock            flock'ed by whoever changes anything below (any process)
    root/           the mount point (`weenv mount <manifest digest> [--layer N]`, daemon
                    started by fuse/daemon.py; it is not our child, so whichever process
                    unmounts only waits for its pid)
    holders/<id>    one file per user of the mount (a sandbox, a containerd snapshot): the
                    reference count; empty, or the path of the user's anchor folder
    mount.json      store URL, cache folder, log file, daemon pid, and `idle_since` /
                    `warm_until` (/ `timer_pid`) while the mount is kept warm with no holder
    hint.json       a recording mount's outcome (what its daemon published on unmount)

The count is the set of holder files, not a number, so a crashed process can never leave it
wrong: a holder whose sandbox folder is gone is stale. A release looks at the other holders
only until it meets a live one, dropping the stale ones before it (so a crashed sandbox's
file does not keep a mount held for ever, at one check per release while holders are live);
`prune_holders` drops every stale one (`weenv sandbox gc`, the node service's housekeeping,
the keep-warm timer). An acquire does not look: it adds a file, and reading every other
holder under the mount's lock made K environments started at once over a shared group
O(K^2) (docs/design-notes.md). A holder that is no sandbox (a snapshot of
`weenv snapshotter`) names its anchor folder in its file: it is live while that folder exists,
whatever liveness test the pruning process knows.

Mounts outlive the sandboxes that made them: when the last holder releases, the mount stays
mounted, idle, for `keep_warm` seconds (default `WarmPolicy`: $WEENV_KEEP_WARM, 600; 0
unmounts at once), so the next sandbox of the same environment or group stack finds it
mounted (a warm start is overlay + sandbox only). Idle mounts are bounded: at most
$WEENV_WARM_MAX of them (16) and $WEENV_WARM_MEMORY bytes of their daemons' memory (PSS,
1 GiB); `evict_idle` unmounts the least recently used idle mounts over a bound and those past
their `warm_until`, never one with a holder. It runs after every release that leaves a mount
idle, from the node's mount server every minute (fuse/mountd.py HOUSEKEEPING: `weenv mounts
evict --expired`) and from `weenv sandbox gc`. Only when no mount server answers does a
release start a detached `weenv sandbox gc --mounts-only --after SECS` timer instead. A
recording mount (`record`, runtime/recording.py) is never kept warm: its daemon publishes the
recorded hint when it is unmounted, and `release` returns what it published; or, for a
recording nobody waits for (`publish_later`), it leaves the mount idle and due at once to the
node service's eviction, which unmounts it after the run has its answer. It replays the
environment's seed hint if there is one (RECORD_REPLAY).

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
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError, WeenvError
from weenvfs.fuse import daemon, mountd
from weenvfs.fuse.config import mount_args
from weenvfs.fuse.mount_copies import remove_mount_folder
from weenvfs.fuse.spawn import spawn

log = logging.getLogger(__name__)

ENVS_ROOT = Path("/run/weenv/envs")
KEY_LEN = 64
RESULT_FILE = "hint.json"
# What a recording mount replays: the seed `weenv convert` recorded from the image's command
# (core/node_hints.py SEED_TAG; this package does not import the core at start-up). What the
# replay reads through the mount is recorded too, so the hint it publishes holds the seed's.
RECORD_REPLAY = "seed"

ROOT_ENV = "WEENV_ENVS_ROOT"  # another folder than ENVS_ROOT (tests, several node roots)
KEEP_WARM_ENV, WARM_MAX_ENV, WARM_MEMORY_ENV = (
    "WEENV_KEEP_WARM", "WEENV_WARM_MAX", "WEENV_WARM_MEMORY")


@dataclass(frozen=True)
class WarmPolicy:
    """How long and how many released mounts stay mounted on this node."""

    seconds: float = 600.0  # idle timeout of a released mount (0: unmount at once)
    max_idle: int = 16  # idle mounts kept at most (least recently used evicted first)
    max_memory: int = 1 << 30  # bytes (PSS) of the idle mounts' daemons (0: no bound)

    @classmethod
    def from_env(cls) -> WarmPolicy:
        """The node's policy: $WEENV_KEEP_WARM, $WEENV_WARM_MAX, $WEENV_WARM_MEMORY."""
        default = cls()
        return cls(env_number(KEEP_WARM_ENV, default.seconds, float),
                   int(env_number(WARM_MAX_ENV, default.max_idle, int)),
                   int(env_number(WARM_MEMORY_ENV, default.max_memory, int)))


def env_number(name: str, default: float, kind: type[float] | type[int]) -> float:
    """$NAME as a non-negative number of `kind` (`default` when unset or empty); a
    UsageError naming the variable otherwise (a typo must not switch a node's policy
    silently)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise UsageError(f"${name} must be a non-negative number, not {raw!r}") from None
    if value < 0:
        raise UsageError(f"${name} must be a non-negative number, not {raw!r}")
    return value


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
    idle_since: float | None = None  # when its last holder released it (None: held)
    pid: int | None = None  # its daemon
    record: bool = False  # a recording mount (publishes a hint when unmounted)

    @property
    def idle(self) -> bool:
        """Mounted and held by no sandbox (what eviction may unmount)."""
        return self.mounted and not self.holders

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (`weenv sandbox ls --json`, `weenv mounts --json`)."""
        return {"key": self.key, "mountpoint": str(self.mountpoint),
                "mounted": self.mounted, "holders": list(self.holders),
                "warm_until": self.warm_until, "env": self.env, "layer": self.layer,
                "idle_since": self.idle_since, "pid": self.pid, "record": self.record}


def envs_root() -> Path:
    """The folder of the node's shared mounts: $WEENV_ENVS_ROOT, else ENVS_ROOT."""
    return Path(os.environ.get(ROOT_ENV) or ENVS_ROOT)


def env_dir(key: str, root: Path | None = None) -> Path:
    """The folder of mount `key`, in folder of shared mounts `root` (default: `envs_root()`)."""
    if len(key) != KEY_LEN or not all(c in "0123456789abcdef" for c in key):
        raise UsageError(f"not a mount key (64 hex digits): {key!r}")
    return (envs_root() if root is None else root) / key


def mountpoint(key: str, root: Path | None = None) -> Path:
    """Where mount `key` is mounted on this node (in `root`, as `env_dir`)."""
    return env_dir(key, root) / "root"


@contextlib.contextmanager
def locked(key: str, root: Path | None = None) -> Iterator[Path]:
    """Hold the environment's lock (blocking); yields its folder (in folder of shared mounts
    `root`, as `env_dir`).

    A teardown removes the folder, lock file included, while holding the lock. A waiter that
    then wakes holds a lock on an unlinked file, so it checks that the path still names the
    file it locked and starts over otherwise (as the chunk cache's locks do)."""
    folder = env_dir(key, root)
    while True:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a teardown removed it between mkdir's EEXIST and its check
            # One stat: `exists()` then `is_dir()` raced a teardown too (the folder there for
            # the first, gone for the second: a bogus FileExistsError, once in a CI run).
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISDIR(folder.stat().st_mode):
                    raise
            continue
        path = folder / "lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # a teardown removed the folder between our mkdir and open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not _still_names(path, fd):
                continue  # finally closes fd
            yield folder
            return
        finally:
            os.close(fd)


def _still_names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (a teardown unlinks a lock file
    while holding it; whoever locks it afterwards holds a lock on nothing)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _locked_if_free(key: str) -> Iterator[Path | None]:
    """Mount `key`'s folder with its lock held, or None: when the folder is gone (never
    made again here) or another process or thread holds the lock (the mount is being made,
    used or torn down). For eviction, which must neither wait behind a teardown it would
    only repeat (32 sandboxes closing at once each walked every victim, waiting for its
    lock) nor bring back the folder of a mount already gone."""
    path = env_dir(key) / "lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield path.parent if _still_names(path, fd) else None  # else: torn down meanwhile
    finally:
        os.close(fd)


def _read_info(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "mount.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def daemon_pid(key: str) -> int | None:
    """The pid of mount `key`'s daemon as its mount.json records it, or None."""
    pid = _read_info(env_dir(key)).get("pid")
    return pid if isinstance(pid, int) else None


def _write_info(folder: Path, info: dict[str, Any]) -> None:
    tmp = folder / ".mount.json.tmp"
    tmp.write_text(json.dumps(info))
    tmp.replace(folder / "mount.json")


def _holders(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in (folder / "holders").iterdir())
    except FileNotFoundError:
        return []


def _alive_mount(mp: Path, mounted: frozenset[bytes] | None = None) -> bool:
    """Mounted and answering (a dead daemon leaves a mount that fails with ENOTCONN).
    `mounted`: the node's mount points as read before the caller took this mount's lock
    (`daemon.mount_points`), so possibly out of date: a mount it lists must still be one
    (an eviction since then left a plain folder on the folder's own file system)."""
    if not daemon.is_mounted(mp, mounted):
        return False
    try:
        if mounted is not None and not _still_a_mount(mp):
            return False
        daemon.check_answers(mp, mounted)
    except OSError as error:
        log.warning("environment mount %s is dead (%s); remounting", mp, error.strerror)
        _force_unmount(mp)
        return False
    return True


def _still_a_mount(mp: Path) -> bool:
    """Whether `mp` is on another file system than its folder; False when it is gone (an
    eviction removes it); OSError (ENOTCONN: a dead mount) for the caller to handle."""
    try:
        return os.stat(mp).st_dev != os.stat(mp.parent).st_dev
    except FileNotFoundError:
        return False


def acquire(
    key: str, holder: str, *, store_url: str, cache_dir: Path,
    env: str | None = None, layer: int | None = None,
    record: str | None = None, anchor: Path | None = None,
    page_roots: Mapping[int, Path] | None = None,
) -> Path:
    """Register `holder` as a user of mount `key`, mounting it if needed; return the mount
    point. A holder with an `anchor` folder is live while that folder exists (else while a
    `release`'s or `prune_holders`' `is_live` says so). The mount is of environment `env`
    (default: `key`, a manifest digest), or of its group `layer`; with `record` (a hint tag)
    it records what is read and publishes it as that hint when unmounted. `page_roots` (group -> the
    mount point of that group's layer) lets a top layer's hint replay read the other
    layers' hinted files into the page cache."""
    with locked(key) as folder:
        mp = folder / "root"
        info, mounted = _read_info(folder), False
        if not _alive_mount(mp):
            mp.mkdir(exist_ok=True)
            try:
                info = _mount(env or key, mp, store_url, cache_dir, layer,
                              folder / RESULT_FILE if record else None, page_roots, record)
            except BaseException:
                if not _holders(folder):  # nobody else uses the folder: leave nothing
                    _teardown(folder)
                raise
            mounted = True
        _hold(folder, info, holder, anchor, mounted)
        return mp


def acquire_mounted(key: str, holder: str, *,
                    mounted: frozenset[bytes] | None = None) -> Path | None:
    """`acquire` of a mount that is up: register `holder` and return the mount point; None,
    having taken nothing, when mount `key` is not up (`acquire` then mounts it). A warm
    sandbox's lowers are all up: taken one after another here, without the threads that
    mount missing ones side by side (with mount.json left alone when nothing in it changes:
    ~0.5 ms of a warm sandbox's ~4 ms create, in-process cProfile). `mounted`: the node's
    mount points, read once for all of a sandbox's lowers (`_alive_mount`; it was read
    twice per lower, ~0.3 ms a read with nine lowers mounted). A mount it does not list is
    None at once, without waiting for its lock: another sandbox may hold that lock for as
    long as it takes to mount it, and the mounts this sandbox has to make must not wait for
    that (`acquire` waits for it beside them, lowers.py)."""
    if mounted is not None and not daemon.is_mounted(mountpoint(key), mounted):
        return None
    with locked(key) as folder:
        mp = folder / "root"
        if not _alive_mount(mp, mounted):
            return None
        _hold(folder, _read_info(folder), holder, None)
        return mp


def _hold(folder: Path, info: dict[str, Any], holder: str, anchor: Path | None,
          mounted: bool = False) -> None:
    """Register `holder` on the mount of `folder` (whose lock the caller holds): its idle
    timer stopped, its idle marks cleared. `info` is written to mount.json when the caller
    just `mounted` it or it had such marks (a mount held already, by a parked root say, has
    none)."""
    idle = any(key in info for key in ("timer_pid", "warm_until", "idle_since"))
    _stop_timer(info)
    info.pop("warm_until", None)
    info.pop("idle_since", None)
    if idle or mounted:
        _write_info(folder, info)
    (folder / "holders").mkdir(exist_ok=True)
    if anchor is None:
        (folder / "holders" / holder).touch()
    else:
        (folder / "holders" / holder).write_text(str(anchor.absolute()))


def _mount(
    env: str, mp: Path, store_url: str, cache_dir: Path, layer: int | None,
    record_result: Path | None = None, page_roots: Mapping[int, Path] | None = None,
    record_tag: str | None = None,
) -> dict[str, Any]:
    cache_dir = cache_dir.absolute()
    cache_dir.mkdir(parents=True, exist_ok=True)
    what = f"env-{env[:12]}" + ("" if layer is None else f"-layer{layer}") + (
        "-record" if record_result is not None else "")
    log_file = cache_dir / "logs" / f"{what}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    # A recording mount has no hint of its own to replay (that is why it records): at most
    # the seed.
    recording = {} if record_result is None else {
        "hint": RECORD_REPLAY, "record_tag": record_tag, "record_result": record_result}
    args = mount_args(env, mp, store_url, cache_dir, log_file=log_file, allow_other=True,
                      layer=layer, page_roots=page_roots, **recording)
    started = time.monotonic()
    pid = spawn(args, log_file)
    log.info("mounted %s at %s in %.0f ms (daemon %d)", what, mp,
             (time.monotonic() - started) * 1000, pid)
    return {"store": store_url, "cache": str(cache_dir), "log_file": str(log_file), "pid": pid,
            "env": env, "layer": layer, "record": record_result is not None,
            **({"record_tag": record_tag} if record_result is not None else {})}


def release(key: str, holder: str, keep_warm: float | None = None, *,
            is_live: Callable[[str], bool] | None = None, evict: bool = True,
            publish_later: bool = False, root: Path | None = None) -> dict[str, Any] | None:
    """Drop `holder` from mount `key` (in folder of shared mounts `root`, default this
    process's: a sandbox's own, whoever ends it); when no holder is left, keep the mount
    warm for `keep_warm` seconds (None: the node's `WarmPolicy`; 0: unmount now), then
    evict what is over the node's bounds (`evict_over_bounds`; with `evict` False the
    caller does, once for several releases). `is_live(holder_id)` tells the other holders'
    stale files (crashed sandboxes) apart (`_live_holder`); without it every file holds.
    A release by a process that does not hold the mount changes nothing (a sandbox whose
    build stopped before taking it must not unmount what others keep warm). Returns what a
    recording mount published when this release unmounted it (its hint.json; a recording
    mount is never kept warm), else None. With `publish_later`, a recording mount is left
    to the node service when one answers (`_publish_later`), and what is returned says so
    (`pending`)."""
    if not (env_dir(key, root) / "holders" / holder).exists():
        return None  # not a holder (and `locked` would make the folder of a mount never made)
    policy = WarmPolicy.from_env()
    seconds = policy.seconds if keep_warm is None else keep_warm
    with locked(key, root) as folder:
        try:
            (folder / "holders" / holder).unlink()
        except FileNotFoundError:
            return None
        if _live_holder(folder, is_live):
            return None
        info = _read_info(folder)
        recording = bool(info.get("record"))
        alive = daemon.is_mounted(folder / "root")
        outcome = None
        if recording and alive and publish_later and _evicts_by_service(policy):
            outcome = _publish_later(folder, info)
        elif seconds <= 0 or policy.max_idle <= 0 or recording or not alive:
            return _teardown(folder)
        else:
            _stop_timer(info)
            now = time.time()
            info["idle_since"], info["warm_until"] = now, now + seconds
            if not _node_service_answers():
                info["timer_pid"] = _start_timer(seconds)
            _write_info(folder, info)
    if evict:
        evict_over_bounds(policy)
    return outcome


def _evicts_by_service(policy: WarmPolicy) -> bool:
    """Whether `evict_over_bounds` hands the eviction to the node service (a policy that
    keeps mounts warm, and a service that answers)."""
    return policy.seconds > 0 and policy.max_idle > 0 and _node_service_answers()


def _publish_later(folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Leave the idle recording mount in `folder` to the node service: idle and due now,
    so the eviction its release asks for (after the answer, in a command the service runs)
    unmounts it and its daemon publishes then, off the run's path (~65-100 ms of a first run
    from S3: the daemon's notice, the publish, the packer's launch, its exit). A sandbox
    of the same environment that starts before that joins it, as it would join a mount
    still recording. Returns the `pending` outcome (runtime/recording.py `outcome_line`)."""
    info["idle_since"] = info["warm_until"] = time.time()
    _write_info(folder, info)
    return {"pending": True, "manifest": info.get("env"), "tag": info.get("record_tag")}


def evict_over_bounds(policy: WarmPolicy | None = None) -> None:
    """`evict_idle`, run by the node service when it answers (a process it forks with this
    one's environment: a closing sandbox does not wait for the evicted mounts' daemons to
    exit, ~0.6 s per close when 32 sandboxes closed at once), else here. A policy that keeps
    nothing warm evicts here: it rarely finds anything, and a fork per close would cost more.
    In a command the node service runs for a client (`weenv run`), the request goes out once
    the client has its answer: an eviction is the node's housekeeping, not the command's
    (~2-4 ms of a warm run's end)."""
    from weenvfs.fuse.service_forks import when_answered

    policy = policy or WarmPolicy.from_env()
    if policy.seconds <= 0 or policy.max_idle <= 0:
        evict_idle(policy)
    elif not when_answered(lambda: _request_or_evict(policy)):
        _request_or_evict(policy)


def _request_or_evict(policy: WarmPolicy) -> None:
    if not mountd.request_eviction():
        evict_idle(policy)


def _node_service_answers() -> bool:
    """Whether the node's mount server runs (its housekeeping then expires warm mounts)."""
    if not mountd.enabled():
        return False
    try:
        mountd.check_running()
    except WeenvError:
        return False
    return True


def evict_idle(policy: WarmPolicy | None = None, now: float | None = None,
               is_live: Callable[[str], bool] | None = None) -> list[str]:
    """Unmount the idle mounts past their `warm_until`, then the least recently used idle
    ones while more than `policy.max_idle` are idle or their daemons use more than
    `policy.max_memory`; never one with a holder (stale holders are dropped first when
    `is_live` is given). Returns the keys unmounted."""
    policy = policy or WarmPolicy.from_env()
    now = time.time() if now is None else now
    if is_live is not None:
        for mount in list_mounts():
            if mount.holders:
                with locked(mount.key) as folder:
                    prune_holders(folder, is_live)
    idle = [m for m in list_mounts() if m.idle]
    # Only those the listing shows expired are locked and checked again (a lock each).
    evicted = [m.key for m in idle if (m.warm_until is None or m.warm_until <= now)
               and _evict(m.key, lambda info: _expired(info, now))]
    left = sorted((m for m in idle if m.key not in evicted),
                  key=lambda m: m.idle_since or 0.0)  # least recently used first
    memory = {m.key: _daemon_memory(m.pid) for m in left} if policy.max_memory else {}
    while left and (len(left) > policy.max_idle
                    or (policy.max_memory and sum(memory.values()) > policy.max_memory)):
        victim = left.pop(0)
        memory.pop(victim.key, None)
        if _evict(victim.key, lambda info: True):
            evicted.append(victim.key)
            log.info("evicted idle mount %s (least recently used over the node's bounds)",
                     victim.key[:12])
    return evicted


def evict(key: str, force: bool = False) -> bool:
    """Unmount mount `key` if it has no holder (with `force`, even if it has: their
    sandboxes lose their lower); whether it was unmounted. Raises UsageError with holders."""
    with locked(key) as folder:
        holders = _holders(folder)
        if holders and not force:
            raise UsageError(f"mount {key[:12]} has {len(holders)} holder(s) "
                             f"({', '.join(holders)}); --force unmounts it anyway")
        mounted = daemon.is_mounted(folder / "root")
        _teardown(folder)
        return mounted


def _expired(info: dict[str, Any], now: float) -> bool:
    warm_until = info.get("warm_until")
    return not isinstance(warm_until, int | float) or warm_until <= now


def _evict(key: str, due: Callable[[dict[str, Any]], bool]) -> bool:
    """Tear mount `key` down if, under its lock, it has no holder and `due(mount.json)`;
    a mount whose lock is busy or that is gone is left to whoever has it (`_locked_if_free`)."""
    with _locked_if_free(key) as folder:
        if folder is None or _holders(folder) or not due(_read_info(folder)):
            return False
        outcome = _teardown(folder)
    if outcome is not None:  # a recording mount a run left to the node (`_publish_later`)
        _log_outcome(key, outcome)
    return True


def _log_outcome(key: str, outcome: dict[str, Any]) -> None:
    """Say in this process's log what a recording mount no run waited for published."""
    if outcome.get("error"):
        log.warning("the recording mount %s published no hint: %s", key[:12], outcome["error"])
    elif outcome.get("hint"):
        log.info("the recording mount %s published hint %s of environment %s (%s chunks)",
                 key[:12], str(outcome["hint"])[:12], str(outcome.get("manifest"))[:12],
                 outcome.get("recorded", 0))


# How long a daemon's measured memory is used again by this process. Reading it walks the
# daemon's page tables (~1 ms of kernel time each), and every release measured every idle
# daemon: a harness closing 32 environments at once (4 layer mounts each) read 16 daemons
# 128 times, ~2 s of CPU on a 2-core node. An idle daemon's memory only shrinks (nothing
# reads through it), so a figure a moment old errs towards evicting a little early.
MEMORY_TTL = 2.0
_memory_seen: dict[int, tuple[float, int]] = {}  # pid -> (monotonic time measured, bytes)


def _daemon_memory(pid: int | None) -> int:
    """Bytes of memory (PSS: shared pages split among their users) of daemon `pid`,
    measured at most `MEMORY_TTL` seconds ago."""
    if pid is None:
        return 0
    now = time.monotonic()
    seen = _memory_seen.get(pid)
    if seen is not None and now - seen[0] < MEMORY_TTL:
        return seen[1]
    size = _measure_memory(pid)
    if len(_memory_seen) > 256:  # daemons come and go: forget what is too old to be used
        for old in [p for p, (at, _) in list(_memory_seen.items()) if now - at >= MEMORY_TTL]:
            _memory_seen.pop(old, None)
    _memory_seen[pid] = (now, size)
    return size


def _measure_memory(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def prune_holders(folder: Path, is_live: Callable[[str], bool]) -> list[str]:
    """Remove holder files of sandboxes that no longer exist (and of anchored holders whose
    anchor is gone); return their ids."""
    stale = [h for h in _holders(folder) if not _anchored(folder / "holders" / h, is_live)]
    for holder in stale:
        _drop_stale(folder, holder)
    return stale


def _live_holder(folder: Path, is_live: Callable[[str], bool] | None) -> bool:
    """Whether the mount of `folder` (whose lock the caller holds) has a live holder: any
    holder file without `is_live`; with it, the first live one, the stale ones met before
    it dropped."""
    for holder in _holders(folder):
        if is_live is None or _anchored(folder / "holders" / holder, is_live):
            return True
        _drop_stale(folder, holder)
    return False


def _drop_stale(folder: Path, holder: str) -> None:
    (folder / "holders" / holder).unlink(missing_ok=True)
    log.info("dropped stale holder %s of environment %s", holder, folder.name[:12])


def _anchored(path: Path, is_live: Callable[[str], bool]) -> bool:
    """Whether holder file `path` is live: its anchor folder exists, or (none named)
    `is_live` says so."""
    try:
        anchor = path.read_text().strip()
    except OSError:
        return False
    return Path(anchor).is_dir() if anchor else is_live(path.name)


def expire(key: str, is_live: Callable[[str], bool], now: float | None = None) -> bool:
    """Unmount mount `key` if it has no live holder and is not kept warm past `now`, or is
    dead (its daemon gone: nothing can be served from it, so its warm time keeps nothing);
    return whether it was torn down."""
    with locked(key) as folder:
        prune_holders(folder, is_live)
        if _holders(folder):
            return False
        warm_until = _read_info(folder).get("warm_until")
        if (isinstance(warm_until, int | float) and warm_until > (now or time.time())
                and not _dead_mount(folder / "root")):
            return False
        _teardown(folder)
        return True


def _dead_mount(mp: Path) -> bool:
    """Mounted but not answering (its daemon was killed): what `_alive_mount` remounts."""
    if not daemon.is_mounted(mp):
        return False
    try:
        daemon.check_answers(mp)
    except OSError:
        return True
    return False


def _teardown(folder: Path) -> dict[str, Any] | None:
    """Unmount (lazily if an overlay still pins it) and remove the folder but its lock;
    return a recording mount's outcome (written by its daemon once unmounted)."""
    mp = folder / "root"
    info = _read_info(folder)
    _stop_timer(info)
    if daemon.is_mounted(mp):
        try:
            daemon.unmount(mp, remove=True)
        except daemon.HeldElsewhere as error:
            log.warning("%s", error)  # unmounted here: it ends once they let go
        except WeenvError as error:
            log.info("unmounting %s lazily: %s", mp, error)
            _force_unmount(mp)
            remove_mount_folder(mp)
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
                remove_mount_folder(mp)  # never rmtree a mount point, even one detached lazily
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
        folders = sorted(p for p in envs_root().iterdir() if len(p.name) == KEY_LEN)
    except FileNotFoundError:
        return []
    out = []
    mounted = daemon.mount_points()
    for folder in folders:
        info = _read_info(folder)
        env, layer, pid = info.get("env"), info.get("layer"), info.get("pid")
        out.append(MountInfo(folder.name, folder / "root",
                             daemon.is_mounted(folder / "root", mounted),
                             tuple(_holders(folder)), _number(info.get("warm_until")),
                             env if isinstance(env, str) else None,
                             layer if isinstance(layer, int) else None,
                             _number(info.get("idle_since")),
                             pid if isinstance(pid, int) else None, info.get("record") is True))
    return out


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None
