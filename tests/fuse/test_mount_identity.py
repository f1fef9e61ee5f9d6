"""A mount asks for the files a sandbox's build reads first (core/identity_files.py) as it
starts: with nothing read through it, the chunks of /etc/passwd and /etc/group come into the
node cache; an environment without them gets nothing fetched ahead. The real `weenv` CLI and
daemon, on both data paths."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from mounts import Mounter, publish
from support import trees
from support.polling import wait_for
from support.trees import file

pytestmark = [pytest.mark.requires_fuse, pytest.mark.usefixtures("both_paths")]

KIB = 1 << 10
CHUNK = 64 * KIB


def _publish(tmp_path: Path, *names: str) -> Path:
    """env:t of `names` (small files, batched) beside bulky files in other chunks."""
    rng = random.Random(3)
    entries = [file(name, b"root:x:0:0::/root:/bin/sh\n" * 4) for name in names]
    entries += [file(f"usr/lib/big{n}", rng.randbytes(3 * CHUNK)) for n in range(3)]
    src = trees.make_tree(tmp_path / "src", *entries)
    publish(tmp_path / "store", [src], env="env:t", chunk_size=CHUNK,
            batch_threshold=16 * KIB)
    return tmp_path / "store"


def _prefetched(mount: Any) -> dict[str, Any]:
    """`weenv stats` of `mount` once its hint lookup is over (there is no hint)."""
    def settled() -> dict[str, Any] | None:
        stats = mount.stats()
        return stats if stats["hints"]["state"] not in ("looking up", "replaying") else None

    return wait_for(settled, "the replay's end", 30, interval=0.05)


def test_a_mount_fetches_the_identity_files_before_they_are_read(
        tmp_path: Path, mounter: Mounter) -> None:
    mount = mounter.mount("env:t", _publish(tmp_path, "etc/passwd", "etc/group",
                                            "etc/hostname"))

    def fetched() -> dict[str, Any] | None:
        stats = mount.stats()
        return stats if stats["fetch"]["prefetch"]["chunks"] >= 1 else None

    stats = wait_for(fetched, "the identity files' chunk fetched ahead", 30, interval=0.05)
    assert stats["fetch"]["prefetch"]["chunks"] == 1  # both files share a batch chunk
    assert (mount.mountpoint / "etc/passwd").read_bytes().startswith(b"root:x:0:0:")


def test_an_environment_without_them_gets_nothing_fetched_ahead(
        tmp_path: Path, mounter: Mounter) -> None:
    mount = mounter.mount("env:t", _publish(tmp_path, "etc/hostname"))
    stats = _prefetched(mount)
    assert stats["fetch"]["prefetch"]["chunks"] == 0
