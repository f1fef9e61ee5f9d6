"""A sandbox's state on disk: where it lives, what it records, and how it is changed.

Owns the folder `/run/weenv/sandboxes/ID`: made with its `lock` (`make_folder`) and removed
(`remove_folder`, the state first; `remove_stub` for one that never got a state); its
`state.json` (`SandboxState`: owner pid and start time, the environment, limits, upper and
lower choices, cgroup, default process, status) and its `lock`, flock'ed while the sandbox
changes (reset, rm) and never made again by a locker; sandbox ids; the owner record and
whether the owner still runs. Read by every process that finds a sandbox by id (`weenv
sandbox exec|ls|gc`), written atomically (a reader never sees half a state).

Must not: build, start or tear down anything but the folder (sandbox.py tears the rest down
first).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

from weenvfs.errors import UsageError, WeenvError

from .launcher import ProcessSpec

SANDBOXES_ROOT = Path("/run/weenv/sandboxes")
STATE_VERSION = 2  # 2: `mounts` names the keys of the shared mounts (lowers.py)
STUB_AGE = 60.0  # seconds a folder without state may be a sandbox being made
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class SandboxState(TypedDict, total=False):
    """The fields of state.json (a version 1 state lacks `mounts`, see sandbox.py)."""

    version: int
    id: str
    created: float
    owner: dict[str, int] | None  # {"pid", "start"}; None: detached (`sandbox create`)
    # creating, created (weenv run, before its init), running, resetting, parked (parking.py)
    status: str
    env: dict[str, str]  # ref, digest, store, cache
    limits: dict[str, Any]  # cgroups.Limits as a dict
    network: str
    tmpfs_upper: bool
    tmpfs_size: int | None
    disk: int | None
    keep_upper: bool
    keep_warm: float | None
    lower_mode: str
    launcher: str
    process: dict[str, Any]  # ProcessSpec.to_json(): the default process
    resets: int
    seccomp: str
    elastic: dict[str, Any]
    mounts: list[str]  # keys of the shared mounts under the overlay (mounts.py)
    cgroup: dict[str, Any]  # {"path", "resources"} once the init started
    init_pid: int
    parkable: bool  # may park its root at its end and took or may take one (parking.py)
    upper_print: list[int]  # parking.upper_print of its upper as made
    parked: dict[str, Any]  # while parked: since when, and the daemons of its mounts
    standby: dict[str, Any]  # a parked root's next init, waiting for a run (standby.py)


def process_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of `pid`, or None if it does not run."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def owner_alive(owner: dict[str, Any] | None) -> bool:
    """Whether the owner recorded in a state still runs (None: detached, never orphaned)."""
    if owner is None:
        return True
    start = process_start(int(owner["pid"]))
    return start is not None and start == owner.get("start")


def sandbox_dir(sandbox_id: str) -> Path:
    """The state folder of sandbox `sandbox_id`."""
    if not _ID.fullmatch(sandbox_id):
        raise UsageError(f"invalid sandbox id {sandbox_id!r}")
    return SANDBOXES_ROOT / sandbox_id


def exists(sandbox_id: str) -> bool:
    """Whether sandbox `sandbox_id` has a state folder (used as the env-mount liveness test)."""
    return _ID.fullmatch(sandbox_id) is not None and (SANDBOXES_ROOT / sandbox_id).is_dir()


def list_ids() -> list[str]:
    """Ids of every sandbox with a state folder on this node."""
    try:
        return sorted(p.name for p in SANDBOXES_ROOT.iterdir() if _ID.fullmatch(p.name))
    except FileNotFoundError:
        return []


def make_folder(folder: Path) -> None:
    """A new sandbox's folder with its lock file (FileExistsError if the id is taken).
    `locked` never makes the lock file: a folder being removed cannot get one back."""
    folder.mkdir()
    os.close(os.open(folder / "lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     0o600))


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[bool]:
    """Hold the sandbox's lock; yields False if the sandbox is gone, or went while we
    waited (`remove_folder` removes its state first)."""
    try:
        fd = os.open(folder / "lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = _older_lock(folder)
        if fd is None:
            yield False
            return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield (folder / "state.json").exists()
    finally:
        os.close(fd)


def _older_lock(folder: Path) -> int | None:
    """The lock of a sandbox made before `make_folder` made its lock file (by an earlier
    version, still running on the node), or None: no sandbox (or one being removed: its
    state goes before its lock)."""
    if not (folder / "state.json").exists():
        return None
    try:
        return os.open(folder / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return None


def remove_folder(folder: Path) -> None:
    """Remove a sandbox's folder, under its lock: the state first, so a process waiting on
    the lock finds the sandbox gone and none makes its lock file again (which left a folder
    holding only `lock` that `exists` took for a live sandbox)."""
    with contextlib.suppress(FileNotFoundError):
        (folder / "state.json").unlink()
    shutil.rmtree(folder, ignore_errors=True)


def remove_stub(sandbox_id: str, min_age: float = STUB_AGE) -> bool:
    """Remove the folder of `sandbox_id` if it has had no state file for `min_age` seconds
    (a creation that died between its folder and its first state, or a folder left by a
    version whose teardown could race a locker); whether it did. Younger folders may be
    a sandbox being made."""
    folder = sandbox_dir(sandbox_id)
    try:
        if (folder / "state.json").exists() or time.time() - folder.stat().st_mtime < min_age:
            return False
    except FileNotFoundError:
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()


def owner_record(pid: int | None) -> dict[str, Any] | None:
    if pid is None:
        return None
    start = process_start(pid)
    if start is None:
        raise WeenvError(f"owner process {pid} does not run")
    return {"pid": pid, "start": start}


def initial_state(sandbox_id: str, record: dict[str, Any], creator: int,
                  launcher: str) -> SandboxState:
    """The state a sandbox starts with: `record` (what it is made of) plus its identity and
    the OCI runtime (`launcher`) that runs it for its whole life."""
    return SandboxState(  # type: ignore[typeddict-item]
        version=STATE_VERSION, id=sandbox_id, created=time.time(),
        owner=owner_record(creator), status="creating", launcher=launcher,
        process=ProcessSpec((), ()).to_json(), resets=0, **record,
    )


def read_state(folder: Path) -> SandboxState:
    """The state in `folder` (OSError if missing, ValueError if not JSON)."""
    state: SandboxState = json.loads((folder / "state.json").read_text())
    return state


def write_state(folder: Path, state: SandboxState | dict[str, Any]) -> None:
    """Write `state` into `folder` atomically."""
    tmp = folder / ".state.json.tmp"
    tmp.write_text(json.dumps(state))  # no indent: the C encoder (several per run)
    tmp.replace(folder / "state.json")
