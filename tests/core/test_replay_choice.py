"""core/replay_choice.py without a mount: a real environment in a LocalStore (test_prefetch.py's
`varied_env`), a real ChunkCache filled by a real Fetcher. Where a mount's hint replay runs: a
process for a cold node (many chunks or many bytes to fetch, everything with `--all`, many
cold pages, a lower mount whose pages are not resident), the mount daemon for the few chunks
a warm node misses."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from test_prefetch import found, varied_env

from weenvfs.core import replay_choice
from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import chunk_loc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.loaded_env import LoadedEnv
from weenvfs.core.prefetch import hint_locs
from weenvfs.core.replay_choice import FETCH_HERE_CHUNKS, choose, node_new
from weenvfs.format.hints import HintFile, HintRecord


@pytest.fixture
def env(repo, build_group, open_env) -> LoadedEnv:
    return varied_env(repo, build_group, open_env)


def _records(env: LoadedEnv, *names: bytes) -> list[HintRecord]:
    index = env.tree.groups[0]
    return [HintRecord(0, n, 0) for name in names for n in index.file_chunks(index.resolve(name))]


def _cached(env: LoadedEnv, cache: ChunkCache, records: list[HintRecord]) -> None:
    """Fetch the chunks of `records` into `cache`, as an earlier start on the node did."""
    trio.run(Fetcher(env.store, cache).prefetch, hint_locs(records, env.tree.groups))


def test_a_cold_node_replays_in_a_process(env: LoadedEnv, tmp_path: Path) -> None:
    records = _records(env, b"big0", b"big2")
    locs = hint_locs(records, env.tree.groups)
    assert len(locs) > FETCH_HERE_CHUNKS
    chosen = choose(found(env, records), env.tree.groups, ChunkCache(tmp_path / "c"))
    assert chosen.process and chosen.missing_chunks == len(locs)
    assert chosen.missing_bytes == sum(loc.clen for loc in locs)
    assert chosen.as_dict()["chosen"] == "process"


def test_a_warm_node_fetches_its_few_missing_chunks_in_the_daemon(env: LoadedEnv,
                                                                 tmp_path: Path) -> None:
    records = _records(env, b"big0", b"big2", b"big3")
    cache = ChunkCache(tmp_path / "c")
    _cached(env, cache, records[:-2])  # all but big3's last two chunks
    chosen = choose(found(env, records), env.tree.groups, cache)
    assert not chosen.process and chosen.missing_chunks == 2
    assert chosen.as_dict() == {"chosen": "mount daemon", "missing_chunks": 2,
                                "missing_bytes": chosen.missing_bytes, "why": chosen.why}
    everything = choose(found(env, records), env.tree.groups, cache, fetch_all=True)
    assert everything.process  # `--all`: the rest of the environment is no few chunks


def test_few_chunks_of_many_bytes_go_to_a_process(env: LoadedEnv, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    records = _records(env, b"big1")[:2]
    stored = sum(loc.clen for loc in hint_locs(records, env.tree.groups))
    monkeypatch.setattr(replay_choice, "FETCH_HERE_BYTES", stored - 1)
    assert choose(found(env, records), env.tree.groups, ChunkCache(tmp_path / "c")).process
    monkeypatch.setattr(replay_choice, "FETCH_HERE_BYTES", stored)
    assert not choose(found(env, records), env.tree.groups, ChunkCache(tmp_path / "c")).process


def test_on_the_kernel_path_cold_pages_count_too(env: LoadedEnv, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk cached: the pages of the groups the mount serves itself are new, and a
    lower group's are looked at through its mount (here a folder where nothing is mounted:
    not resident)."""
    index = env.tree.groups[0]
    records = _records(env, b"big0", b"big2")
    files = [HintFile(0, index.resolve(name), 0) for name in (b"big0", b"big2")]
    hint = found(env, records)
    hint = type(hint)(hint.digest, hint.source, hint.hint._replace(files=tuple(files)))
    cache = ChunkCache(tmp_path / "c")
    _cached(env, cache, records)
    page_bytes = index.inode(files[0].inode).size + index.inode(files[1].inode).size
    assert not choose(hint, env.tree.groups, cache, own_groups=[0], page_roots={}).process
    monkeypatch.setattr(replay_choice, "PAGES_HERE_BYTES", page_bytes - 1)
    chosen = choose(hint, env.tree.groups, cache, own_groups=[0], page_roots={})
    assert chosen.process and chosen.missing_chunks == 0
    # Not the mount's own group, and its mount is not there: its pages cannot be resident.
    monkeypatch.setattr(replay_choice, "PAGES_HERE_BYTES", page_bytes)
    (tmp_path / "lower").mkdir()
    lower = choose(hint, env.tree.groups, cache, own_groups=[], page_roots={0: tmp_path / "lower"})
    assert lower.process and "not resident" in lower.why
    # The FUSE tree (no page roots): no warm-up, pages are not looked at.
    assert not choose(hint, env.tree.groups, cache, own_groups=[0]).process


def test_a_node_new_to_the_groups_has_none_of_their_identity_files(env: LoadedEnv,
                                                                   tmp_path: Path) -> None:
    index = env.tree.groups[0]
    first = [chunk_loc(index, n) for n in index.file_chunks(index.resolve(b"big0"))]
    cache = ChunkCache(tmp_path / "c")
    assert node_new(first, cache)
    assert not node_new([], cache)  # an environment without identity files: cannot tell
    _cached(env, cache, [HintRecord(0, index.file_chunks(index.resolve(b"big0"))[-1], 0)])
    assert not node_new(first, cache)
