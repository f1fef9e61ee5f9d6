"""Helpers of the hint tests of real mounts: publish a hint of given files, wait for a
mount's replay to reach a state (a hang guard, not a timing check).

Must not: mount anything (mounts.py `Mounter` does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mounts import Mount
from support.polling import wait_for

from weenvfs.core.node_hints import publish_run
from weenvfs.format.hints import HintRecord
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

WAIT = 60.0  # seconds a condition may take before the test fails (a hang guard only)


def wait_for_state(mount: Mount, *states: str) -> dict[str, Any]:
    """Poll `weenv stats` until the replay is in one of `states`; return the stats."""

    def reached() -> dict[str, Any] | None:
        stats = mount.stats()
        return stats if stats["hints"]["state"] in states else None

    return wait_for(reached, f"a replay state in {states}", WAIT, interval=0.05)


def publish_hint(store: Path, ref: str, paths: list[str], tag: str = "latest") -> int:
    """Publish a hint of the chunks of `paths` (in order) for `ref`; return its chunk count."""
    with open_store(str(store)) as s:
        repo = Repository(s)
        digest, manifest = repo.resolve_env(ref)
        indexes = [repo.get_index(g.index) for g in manifest.groups]
        index = indexes[-1]
        inodes = [index.resolve(p.encode()) for p in paths]
        chunks = dict.fromkeys(c for ino in inodes for c in index.file_chunks(ino))
        run = [HintRecord(len(indexes) - 1, c, t) for t, c in enumerate(chunks)]
        publish_run(repo, digest, manifest, indexes, run, tag)
    return len(chunks)
