"""Parked roots: a finished sandbox's overlay kept mounted for the next sandbox of the same
lower stack, when the sandbox changed nothing in it.

A warm `weenv run` mounts a fresh overlay over the environment's shared mounts and throws it
away at the end; the command in it then looks every path up through an overlay whose
dentries are all new (~10 ms more of a Python import of numpy and pandas than on an overlay
used before, plus the mount, the upper's folders and their removal: docs/design-notes.md).
A sandbox whose upper layer is exactly as it was made (no entry in it, its folder's inode,
mode, owner and times unchanged: nothing was created, deleted, copied up or changed, not
even and then undone) leaves a root that is indistinguishable from a fresh one, so
`Sandbox.destroy(park=True)` (`weenv run`, the Python API's `close`) keeps it: the sandbox
stays, stopped, with the status `parked`, no owner, no process and no cgroup, still holding
its shared mounts, and is named in this module's index under its stack of mount keys. The
next sandbox over the same stack (`Sandbox.create`) takes it over: same id, folder, overlay
and upper, everything else made anew. At most one root per stack is parked and
MAX_PARKED in all; a parked root expires after $WEENV_PARK_SECONDS of the run that parked
it (60; 0 parks nothing, nor does a node whose mounts are not kept warm; its state keeps the
end, so a remover with another setting does not cut it short); the node service's
housekeeping and `weenv sandbox gc` remove expired ones, and every eviction of shared mounts
removes those over the mounts it evicts first (sandbox.py `drop_parked`).

Owns: the index `/run/weenv/parked/<stack>` (a file naming the parked sandbox; taking it is
renaming it away, so two new sandboxes never take the same root), the upper layer's
fingerprint, and the identity of the mount daemons under a root (a shared mount that died
and was mounted again is another mount: a root parked over the old one is not taken).
Must not: tear sandboxes down (sandbox.py, gc.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weenvfs.fuse import daemon

from . import mounts

PARKED_ROOT = Path("/run/weenv/parked")
PARK_SECONDS_ENV = "WEENV_PARK_SECONDS"
DEFAULT_PARK_SECONDS = 60.0
MAX_PARKED = 4


def park_seconds() -> float:
    """How long a root stays parked ($WEENV_PARK_SECONDS, default 60; 0: never parked), and
    0 too when the node keeps no shared mount warm (a parked root holds its mounts)."""
    seconds = mounts.env_number(PARK_SECONDS_ENV, DEFAULT_PARK_SECONDS, float)
    policy = mounts.WarmPolicy.from_env()
    if policy.seconds <= 0 or policy.max_idle <= 0:
        return 0.0
    return max(0.0, seconds)


def stack_name(keys: Sequence[str]) -> str:
    """The index name of a stack of shared mount keys (topmost first, as the overlay)."""
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def upper_print(upper: Path) -> list[int]:
    """What says an upper folder is as it was made: inode, mode, owner, group, modification
    and change times (any entry made or removed in it changes the times; a change of the
    root's own attributes or extended attributes changes its change time: taken after the
    overlay is mounted, which sets one of its own)."""
    st = os.lstat(upper)
    return [st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ctime_ns]


def pristine(upper: Path, made: Sequence[int] | None) -> bool:
    """Whether `upper` is empty and unchanged since its print `made` was taken."""
    if not made:
        return False
    try:
        return upper_print(upper) == list(made) and not os.listdir(upper)
    except OSError:
        return False


def daemon_ids(keys: Sequence[str]) -> dict[str, list[Any]]:
    """Each shared mount's daemon (pid and start time): the identity of the mount."""
    found: dict[str, list[Any]] = {}
    for key in keys:
        pid = mounts.daemon_pid(key)
        found[key] = [pid, daemon.start_time(pid) if pid else None]
    return found


def has_room(keys: Sequence[str]) -> bool:
    """Whether stack `keys` has no parked root yet and fewer than MAX_PARKED are parked."""
    names = parked_names()
    return stack_name(keys) not in names and len(names) < MAX_PARKED


def offer(sandbox_id: str, keys: Sequence[str]) -> bool:
    """Name `sandbox_id` as the parked root of stack `keys` (the index file appears whole,
    by a hard link); False when that stack has one already."""
    PARKED_ROOT.mkdir(parents=True, exist_ok=True)
    index = PARKED_ROOT / stack_name(keys)
    tmp = index.with_name(f".new-{index.name}-{secrets.token_hex(4)}")
    tmp.write_text(sandbox_id)
    try:
        os.link(tmp, index)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def claim(keys: Sequence[str]) -> str | None:
    """Take the parked root of stack `keys` out of the index; its sandbox id, or None when
    none is parked (or another process took it first)."""
    index = PARKED_ROOT / stack_name(keys)
    taken = index.with_name(f".taken-{index.name}-{secrets.token_hex(4)}")
    try:
        os.rename(index, taken)
    except FileNotFoundError:
        return None
    try:
        return taken.read_text().strip() or None
    finally:
        taken.unlink(missing_ok=True)


def withdraw(sandbox_id: str, keys: Sequence[str]) -> None:
    """Remove stack `keys` from the index if it names `sandbox_id`."""
    index = PARKED_ROOT / stack_name(keys)
    with contextlib.suppress(OSError):
        if index.read_text().strip() == sandbox_id:
            index.unlink()


def parked_names() -> list[str]:
    """The stacks that have a parked root."""
    try:
        return [p.name for p in PARKED_ROOT.iterdir() if not p.name.startswith(".")]
    except FileNotFoundError:
        return []


def parked_record(keys: Sequence[str], seconds: float) -> dict[str, Any]:
    """What a parked sandbox's state keeps under `parked`: when it was parked, until when
    (the parker's $WEENV_PARK_SECONDS: whoever removes expired roots may have another, e.g.
    a node service started with parking off), and its mounts' daemons."""
    now = time.time()
    return {"at": now, "until": now + seconds, "daemons": daemon_ids(keys)}


def expired(record: dict[str, Any] | None, now: float) -> bool:
    """Whether a root parked with `record` is past its end (or parked by no valid record,
    one made before ends were recorded among them: a parked root is only a cache)."""
    until = (record or {}).get("until")
    return not isinstance(until, int | float) or until <= now
