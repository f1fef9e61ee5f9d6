"""Spare sandboxes: the next `weenv run` of an environment finds its sandbox made already.

A warm `weenv run` spent ~20-30 ms of its fixed cost making the sandbox (overlay, bundle, the
OCI runtime's namespaces, cgroup and init); `exec` in a sandbox made ahead skips it (measured
in docs/design-notes.md). So when a `weenv run` handed to the node service has answered its
client, its process makes one spare of the same kind, which the next run of the same kind
claims and runs its command in (`exec`, then the sandbox is destroyed as before: the run
stays one-shot).

Owns:
- the spare's key (`spare_key`): everything that makes one sandbox differ from another of
  the same environment (the resolved source, the options, the OCI runtime, the node's
  WEENV_ settings, the umask), so a claimed spare is exactly the sandbox the run would have
  made;
  none for a run that records a hint, keeps its upper, is elastic or keeps nothing warm;
- `/run/weenv/spares/KEY.ID`, one file per spare ready to be claimed; removing it claims
  the spare (unlink succeeds for one process only), `KEY.lock` is held while one is made
  (a claimer waits for it, briefly, rather than making a second sandbox beside it);
- the bounds: $WEENV_SPARES spares at most on the node (default 4, `off` or 0: none), each
  kept as long as its mounts would be kept warm (the sandbox's keep-warm, else the node's
  $WEENV_KEEP_WARM); `sweep` removes expired ones (the node service's housekeeping runs it
  every minute) and spares whose making or claim was cut short; `discard` those holding
  given shared mounts, after any being made is done (`weenv mounts evict`: a spare never
  keeps a mount from eviction, nor takes it again after one).

A spare is an ordinary detached sandbox (`weenv sandbox ls` shows status `spare`) with
`spare: {key, until}` in its state until claimed; the claim makes the claimer its owner.

Must not: make a spare for anything but the exact options of a finished run, or let two
processes claim one spare.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

from weenvfs.errors import UsageError, WeenvError

from . import mounts, sandbox_state
from .sandbox import EnvSource, Sandbox, SandboxOptions

log = logging.getLogger(__name__)

SPARES_ROOT = Path("/run/weenv/spares")
SPARES_ENV = "WEENV_SPARES"
DEFAULT_MAX = 4
CLAIM_WAIT = 1.0  # seconds a claimer waits for a spare being made before making its own
MAKING_WAIT = 30.0  # seconds `discard` waits for spares being made (a bound, not a timing)
UNCLAIMED_GRACE = 60.0  # seconds after which a spare with no file was cut short (sweep)


def max_spares() -> int:
    """How many spares the node keeps at most: $WEENV_SPARES (`off` or 0: none)."""
    raw = os.environ.get(SPARES_ENV, "").strip().lower()
    if not raw:
        return DEFAULT_MAX
    if raw in ("off", "no", "false"):
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"${SPARES_ENV} must be a count or off, not {raw!r}") from None
    if value < 0:
        raise UsageError(f"${SPARES_ENV} must be a count or off, not {raw!r}")
    return value


def spare_key(source: EnvSource, options: SandboxOptions, launcher: str) -> str | None:
    """The kind of sandbox `options` make of `source` with OCI runtime `launcher`, or None
    if such a sandbox is never kept as a spare."""
    if (source.record_tag is not None or options.keep_upper or options.limits.elastic
            or options.name is not None or not keep_for(options) or not max_spares()):
        return None
    node = {k: v for k, v in os.environ.items() if k.startswith("WEENV_")}
    described = {"source": asdict(source), "options": asdict(options), "launcher": launcher,
                 "node": node, "umask": _umask()}  # the folders a sandbox makes
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode(errors="surrogateescape")).hexdigest()[:32]


def keep_for(options: SandboxOptions) -> float:
    """Seconds a spare made with `options` waits to be claimed: as long as its mounts would
    be kept warm (the sandbox's keep-warm, else the node's)."""
    if options.keep_warm is not None:
        return options.keep_warm
    return mounts.WarmPolicy.from_env().seconds


def _umask() -> str:
    """This process's umask, read without changing it (os.umask would, for a moment)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            return next((line.split()[1] for line in f if line.startswith("Umask:")), "")
    except OSError:
        return ""


def claim(key: str, owner_pid: int) -> Sandbox | None:
    """A spare of kind `key`, now owned by `owner_pid` (waiting up to CLAIM_WAIT for one
    being made), or None. A spare whose init or mounts died is destroyed, not returned."""
    deadline = time.monotonic() + CLAIM_WAIT
    while True:
        making = _being_made(key)  # asked first: a spare made meanwhile is listed below
        for entry in _entries(key):
            box = _take(entry, owner_pid)
            if box is not None:
                return box
        if not making or time.monotonic() >= deadline:
            return None
        time.sleep(0.002)


def _take(entry: Path, owner_pid: int) -> Sandbox | None:
    """Claim the spare of `entry`: remove the file (only one process succeeds), then own the
    sandbox; None if another process was first or the sandbox cannot serve."""
    try:
        entry.unlink()
    except FileNotFoundError:
        return None
    try:
        box = Sandbox.load(_sandbox_id(entry))
    except WeenvError:
        return None
    with sandbox_state.locked(box.dir) as present:
        if not present:
            return None
        box.state.pop("spare", None)
        box.state["owner"] = sandbox_state.owner_record(owner_pid)
        box.save()
    status = box.status()
    if status == "running":
        return box
    log.info("spare sandbox %s cannot serve (%s): destroying it", box.id, status)
    _destroy(box)
    return None


def make(source: EnvSource, options: SandboxOptions, key: str) -> Sandbox | None:
    """Make a spare of kind `key` unless one is there or being made, or the node has its
    `max_spares` already; the spare, or None."""
    limit = max_spares()
    if not limit or _entries(key) or len(list(_entries())) >= limit:
        return None
    SPARES_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _making(key) as mine:
        if not mine or _entries(key):
            return None
        started = time.monotonic()
        # Owned by this process while made: if it dies half way, gc finds an orphan.
        box = Sandbox.create(source, options, owner_pid=os.getpid())
        with sandbox_state.locked(box.dir):
            box.state["spare"] = {"key": key, "until": time.time() + keep_for(options)}
            box.state["owner"] = None
            box.save()
        _publish(key, box.id)
    log.info("spare sandbox %s of %s made in %.0f ms", box.id, source.ref,
             (time.monotonic() - started) * 1000)
    return box


def _publish(key: str, sandbox_id: str) -> None:
    """Make the spare claimable: its file appears whole or not at all."""
    tmp = SPARES_ROOT / f".{key}.{sandbox_id}.tmp"
    tmp.write_text(sandbox_id + "\n")
    tmp.rename(SPARES_ROOT / f"{key}.{sandbox_id}")


def sweep(now: float | None = None) -> list[str]:
    """Destroy the spares past their `until` (not claimed in time), and those whose making
    or claim was cut short (a spare in its state, no file, older than UNCLAIMED_GRACE);
    the ids destroyed."""
    now = time.time() if now is None else now
    listed = {_sandbox_id(entry): entry for entry in _entries()}
    removed = []
    for sandbox_id in sandbox_state.list_ids():
        try:
            box = Sandbox.load(sandbox_id)
        except WeenvError:
            continue
        spare = box.state.get("spare")
        if not isinstance(spare, dict):
            continue
        entry = listed.get(sandbox_id)
        if entry is not None:
            if float(spare.get("until", 0)) > now:
                continue
            try:
                entry.unlink()  # claimed by the sweep, so no run takes it meanwhile
            except FileNotFoundError:
                continue
        elif now - float(box.state.get("created", now)) < UNCLAIMED_GRACE:
            continue
        if _destroy(box):
            removed.append(sandbox_id)
    for entry in _entries():  # a file whose sandbox is gone (removed by hand, a reboot)
        if not sandbox_state.exists(_sandbox_id(entry)):
            entry.unlink(missing_ok=True)
    return removed


def discard(mount_keys: Iterable[str] | None = None) -> list[str]:
    """Destroy the spares holding any of the shared mounts `mount_keys` (None: every
    spare), so that those mounts can be evicted; the ids destroyed."""
    wanted = None if mount_keys is None else set(mount_keys)
    _wait_for_makings()  # one being made now would take the mounts again after the eviction
    removed = []
    for entry in _entries():
        try:
            box = Sandbox.load(_sandbox_id(entry))
        except WeenvError:
            entry.unlink(missing_ok=True)
            continue
        if wanted is not None and not wanted & set(box.state.get("mounts") or ()):
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            continue  # claimed meanwhile: a run holds it now
        if _destroy(box):
            removed.append(box.id)
    return removed


def ids() -> set[str]:
    """The ids of the spares waiting to be claimed."""
    return {_sandbox_id(entry) for entry in _entries()}


def _destroy(box: Sandbox) -> bool:
    try:
        box.destroy(keep_upper=False)
        return True
    except (OSError, WeenvError) as error:
        log.warning("spare sandbox %s not removed: %s (weenv sandbox gc retries)", box.id,
                    error)
        return False


def _entries(key: str | None = None) -> list[Path]:
    """The claimable spares (of kind `key`, or all), oldest first."""
    pattern = f"{key}.*" if key else "*.*"
    try:
        found = [p for p in SPARES_ROOT.glob(pattern)
                 if not p.name.startswith(".") and not p.name.endswith(".lock")]
    except OSError:
        return []
    return sorted(found, key=_mtime)


def _sandbox_id(entry: Path) -> str:
    return entry.name.split(".", 1)[1]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _wait_for_makings(timeout: float = MAKING_WAIT) -> None:
    """Return once no spare is being made (or after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    try:
        locks = list(SPARES_ROOT.glob("*.lock"))
    except OSError:
        return
    for lock in locks:
        key = lock.name[:-len(".lock")]
        while _being_made(key) and time.monotonic() < deadline:
            time.sleep(0.005)


def _being_made(key: str) -> bool:
    """Whether a process holds `key`'s lock (it is making a spare of that kind)."""
    try:
        fd = os.open(SPARES_ROOT / f"{key}.lock", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as error:
        return error.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _making(key: str) -> Iterator[bool]:
    """Hold `key`'s lock while making a spare; yields False if another process holds it."""
    path = SPARES_ROOT / f"{key}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            path.unlink(missing_ok=True)  # before unlocking: no lock file is left behind
    finally:
        os.close(fd)
