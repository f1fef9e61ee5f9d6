"""Helpers of the hint tests of real mounts: an environment of varied files, a hint of given
files (and the hint published, read back), a wait for a mount's replay to reach a state (a
hang guard, not a timing check).

Must not: mount anything (mounts.py `Mounter` does)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from mounts import Mount, publish
from support import trees
from support.polling import wait_for
from support.trees import file

from weenvfs.core.node_hints import publish_run
from weenvfs.format.hints import Hint, HintFile, HintRecord
from weenvfs.format.index import GroupIndex
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

KIB = 1 << 10
CHUNK = 64 * KIB
WAIT = 60.0  # seconds a condition may take before the test fails (a hang guard only)


def wait_for_state(mount: Mount, *states: str) -> dict[str, Any]:
    """Poll `weenv stats` until the replay is in one of `states`; return the stats."""

    def reached() -> dict[str, Any] | None:
        stats = mount.stats()
        return stats if stats["hints"]["state"] in states else None

    return wait_for(reached, f"a replay state in {states}", WAIT, interval=0.05)


def publish_hint(store: Path, ref: str, paths: list[str], tag: str = "latest",
                 files: bool = False) -> int:
    """Publish a hint of the chunks of `paths` (in order) for `ref`, with `files` also of
    the files themselves (a version 2 hint); return its chunk count."""
    with open_store(str(store)) as s:
        repo = Repository(s)
        digest, manifest = repo.resolve_env(ref)
        indexes = [repo.get_index(g.index) for g in manifest.groups]
        index = indexes[-1]
        inodes = [index.resolve(p.encode()) for p in paths]
        chunks = dict.fromkeys(c for ino in inodes for c in index.file_chunks(ino))
        top = len(indexes) - 1
        run = [HintRecord(top, c, t) for t, c in enumerate(chunks)]
        read = [HintFile(top, ino, t) for t, ino in enumerate(inodes)] if files else []
        publish_run(repo, digest, manifest, indexes, run, tag, files=read)
    return len(chunks)


def published_hint(store: Path, ref: str = "env:t") -> tuple[Hint, list[GroupIndex]]:
    """The `latest` hint of `ref` in `store`, and the environment's group indexes."""
    with open_store(str(store)) as opened:
        repo = Repository(opened)
        digest, manifest = repo.resolve_env(ref)
        indexes = [repo.get_index(g.index) for g in manifest.groups]
        return repo.get_hint(repo.get_tag("hints", digest, "latest")), indexes


def publish_varied_env(tmp_path: Path, identity: bool = False) -> tuple[Path, dict[str, bytes]]:
    """A store with environment env:t of varied files (64 KiB chunks: `CHUNK`) under
    `tmp_path`, with `identity` also /etc/passwd and /etc/group (the files every sandbox's
    build reads: core/identity_files.py); the store and the files' contents."""
    rng = random.Random(9)
    contents = {f"lib/big{n}": rng.randbytes(5 * CHUNK + n * 999) for n in range(6)}
    contents.update({f"etc/s{n:03d}": rng.randbytes(rng.randrange(1, 9000)) for n in range(80)})
    if identity:
        contents.update({"etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n",
                         "etc/group": b"root:x:0:\n"})
    src = trees.make_tree(tmp_path / "src", *[file(p, d) for p, d in contents.items()])
    store = tmp_path / "store"
    publish(store, [src], env="env:t", chunk_size=CHUNK, batch_threshold=16 * KIB)
    return store, contents
