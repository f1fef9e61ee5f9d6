"""The files every sandbox start reads (core/start_files.py): a mount fetches them while it is
made, so a cold start does not wait for them after. Real groups from layer tars, a local
store, a real chunk cache (the mount-level check: tests/fuse/test_kernel_path.py)."""

from __future__ import annotations

from pathlib import Path

import trio
from support import layers
from support.trees import dir, file, symlink  # noqa: A004

from weenvfs.core.cache import ChunkCache
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.loaded_env import open_environment
from weenvfs.core.reader import Reader
from weenvfs.core.start_files import fetch_start_files
from weenvfs.core.stats import Stats
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, build_group, open_source
from weenvfs.tools.publish import compose_env

PASSWD = b"root:x:0:0:root:/root:/bin/sh\nrunner:x:1000:1000::/home/runner:/bin/sh\n"
GROUP = b"root:x:0:\nrunner:x:1000:\n"


def _publish(tmp_path: Path, *members: layers.Spec) -> tuple[Path, str]:
    tar = layers.layer_file(tmp_path / "layer.tar", *members)
    store_dir = tmp_path / "store"
    repo = Repository(open_store(str(store_dir), create=True))
    build_group(open_source(tar), repo, "base", "t", BuildOptions())
    return store_dir, compose_env(repo, "env", "t", ["base:t"])


def _fetch(store_dir: Path, digest: str, cache: Path) -> tuple[int, Stats]:
    stats = Stats()
    with open_store(str(store_dir)) as store:
        env = open_environment(store, digest)
        reader = Reader(env.tree, Fetcher(store, ChunkCache(cache), stats))
        return trio.run(fetch_start_files, env.tree, reader), stats


def test_passwd_and_group_are_fetched_into_the_node_cache(tmp_path: Path) -> None:
    store_dir, digest = _publish(tmp_path, dir("etc"), file("etc/passwd", PASSWD),
                                 file("etc/group", GROUP), file("etc/other", b"x" * 5000))
    done, stats = _fetch(store_dir, digest, tmp_path / "cache")
    assert done == len(PASSWD) + len(GROUP) == stats.bytes_served
    assert stats.cache_misses >= 1 and ChunkCache(tmp_path / "cache").usage().chunks >= 1


def test_missing_or_odd_start_files_are_skipped_without_an_error(tmp_path: Path) -> None:
    """No /etc/group, /etc/passwd a symlink (not followed: the runtime's own read decides):
    nothing read, nothing raised."""
    store_dir, digest = _publish(tmp_path, dir("etc"), file("etc/real", PASSWD),
                                 symlink("etc/passwd", "real"))
    done, stats = _fetch(store_dir, digest, tmp_path / "cache")
    assert done == 0 and stats.bytes_served == 0

