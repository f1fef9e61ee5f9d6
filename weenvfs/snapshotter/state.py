"""The snapshotter's snapshots on disk, so that they survive a restart.

Layout under the snapshotter's root (default /var/lib/weenv/snapshotter):

    lock                    flock'ed by the one snapshotter serving this root
    snapshots/<id>/
        info.json           the record (`Record`): key, parent, kind, labels, times, and for a
                            WeEnv layer the group it mounts (written last, atomically)
        fs/                 the snapshot's files (an active snapshot's overlay upper); empty
                            for a WeEnv layer, whose files are its shared group mount
        work/               overlayfs' work folder of an active snapshot

A folder without info.json is what a crash left while creating or removing: `leftovers()`
lists it and Cleanup removes it. Keys are containerd's (`ns/N/name`): any string, so they
live inside info.json, never in a path.

Owns: records (create, commit, update, remove, load all at start) and the folder of each.
Must not: mount anything or know about WeEnv groups beyond storing their reference.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError

VIEW, ACTIVE, COMMITTED = 1, 2, 3  # api.KINDS
INFO = "info.json"


@dataclass(frozen=True)
class Record:
    """One snapshot as containerd sees it, plus the WeEnv group it stands for."""

    id: int
    key: str
    parent: str
    kind: int
    labels: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0
    weenv: dict[str, Any] | None = None  # remote.WeenvLayer.to_json() of a WeEnv layer

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        return cls(int(data["id"]), str(data["key"]), str(data["parent"]), int(data["kind"]),
                   {str(k): str(v) for k, v in data.get("labels", {}).items()},
                   float(data["created"]), float(data["updated"]), data.get("weenv"))


class SnapshotState:
    """Every record under `root`, indexed by key; one process owns a root at a time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / "snapshots"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(root / "lock", "a+b")  # noqa: SIM115 - held while serving
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise UsageError(f"another snapshotter serves {root}") from None
        self.by_key: dict[str, Record] = {}
        for path in sorted(self.folder.iterdir()):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                record = Record.from_json(json.loads((path / INFO).read_text()))
                if path.name == str(record.id):
                    self.by_key[record.key] = record
        self._next = 1 + max((r.id for r in self.by_key.values()), default=0)
        self._next = max(self._next, 1 + max(
            (int(p.name) for p in self.folder.iterdir() if p.name.isdigit()), default=0))

    def close(self) -> None:
        self._lock.close()

    def dir(self, record: Record) -> Path:
        """The folder of `record`."""
        return self.folder / str(record.id)

    def get(self, key: str) -> Record | None:
        return self.by_key.get(key)

    def create(self, key: str, parent: str, kind: int, labels: dict[str, str],
               weenv: dict[str, Any] | None = None) -> Record:
        """A new record with its empty fs/ and work/ folders."""
        now = time.time()
        record = Record(self._next, key, parent, kind, dict(labels), now, now, weenv)
        self._next += 1
        folder = self.dir(record)
        for sub in ("fs", "work"):
            (folder / sub).mkdir(parents=True)
        self._write(record)
        return record

    def save(self, record: Record, old_key: str | None = None) -> Record:
        """Store `record` (replacing the one under `old_key`, for a commit)."""
        record = replace(record, updated=time.time())
        self._write(record)
        if old_key is not None and old_key != record.key:
            self.by_key.pop(old_key, None)
        return record

    def _write(self, record: Record) -> None:
        folder = self.dir(record)
        tmp = folder / f".{INFO}.tmp"
        tmp.write_text(json.dumps(asdict(record), sort_keys=True))
        os.replace(tmp, folder / INFO)
        self.by_key[record.key] = record

    def remove(self, record: Record) -> None:
        """Forget `record` (info.json first: a crash then leaves only a leftover folder)."""
        folder = self.dir(record)
        (folder / INFO).unlink(missing_ok=True)
        self.by_key.pop(record.key, None)
        remove_tree(folder)

    def leftovers(self) -> list[Path]:
        """Folders under snapshots/ that belong to no record."""
        known = {str(r.id) for r in self.by_key.values()}
        return [p for p in self.folder.iterdir() if p.name not in known]

    def children(self, key: str) -> list[Record]:
        return [r for r in self.by_key.values() if r.parent == key]


def remove_tree(folder: Path) -> None:
    """Remove `folder`, never crossing into a mount (a folder still mounted stays)."""
    if not folder.exists():
        return
    device = folder.stat().st_dev
    for dirpath, dirnames, _files in os.walk(folder):
        for name in list(dirnames):
            if os.lstat(os.path.join(dirpath, name)).st_dev != device:
                raise OSError(f"{os.path.join(dirpath, name)} is a mount point; not removed")
    shutil.rmtree(folder)
