"""core/hint_pack.py and a packed hint's replay (core/prefetch.py `replay_locs`): a real
environment in a LocalStore (conftest's `build_group`, `open_env`), the real ChunkCache and
Fetcher; FaultyStore in front of the store only to count requests.

What a pack must never do: deliver a chunk that does not match its digest, or leave a chunk
unfetched when the pack blob is missing or damaged (the replay falls back to the groups'
blobs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_prefetch import CONTENTS, found, run, varied_env
from test_reader import inode_of

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import chunk_loc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.hint_pack import pack_hint, pack_tag
from weenvfs.core.loaded_env import LoadedEnv
from weenvfs.core.node_hints import check_hint, publish_hint
from weenvfs.core.prefetch import Prefetcher, hint_locs, replay_locs
from weenvfs.core.reader import Reader
from weenvfs.errors import WeenvError
from weenvfs.format.chunk import decode_chunk
from weenvfs.format.hints import Hint, HintRecord
from weenvfs.format.refs import object_key
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.repository import Repository


@pytest.fixture
def env(repo: Repository, build_group, open_env) -> LoadedEnv:
    return varied_env(repo, build_group, open_env)


def _records(env: LoadedEnv) -> list[HintRecord]:
    """Every other chunk, last first (an order the blob does not follow), one repeated."""
    count = env.tree.groups[0].header.chunk_count
    order = list(range(count - 1, -1, -2))
    order.insert(2, order[0])
    return [HintRecord(0, n, t) for t, n in enumerate(order)]


def _hint(env: LoadedEnv) -> Hint:
    return Hint(env.digest, tuple(_records(env)))


def test_a_pack_holds_each_hinted_chunk_once_in_record_order(env: LoadedEnv,
                                                             repo: Repository) -> None:
    hint = _hint(env)
    packed, from_cache = pack_hint(repo, hint, env.tree.groups, None)
    assert from_cache == 0 and packed.pack is not None
    assert packed.records == hint.records
    assert check_hint(packed, env.digest, env.tree.groups) is None
    assert packed.pack.lengths[2] == 0  # the repeated record
    blob = repo.store.get(object_key("blobs", packed.pack.blob))
    assert len(blob) == packed.pack.size
    locs = replay_locs(packed, env.tree.groups)
    assert [loc.digest for loc in locs] == [loc.digest for loc in hint_locs(hint.records,
                                                                             env.tree.groups)]
    offsets = [loc.offset for loc in locs]
    assert offsets == sorted(offsets) and offsets[0] == 0  # record order, from the start
    for loc in locs:
        assert loc.blob == packed.pack.blob
        decode_chunk(blob[loc.offset:loc.offset + loc.clen], loc.digest, loc.ulen)


def test_a_pack_takes_verified_chunks_from_the_cache(env: LoadedEnv, repo: Repository,
                                                     tmp_path: Path, assert_logs) -> None:
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    locs = hint_locs(_records(env), env.tree.groups)
    for loc in locs:
        cache.insert(loc.digest, decode_chunk(repo.store.get_range(
            object_key("blobs", loc.blob), loc.offset, loc.clen), loc.digest, loc.ulen))
    # A cached file damaged in place keeps its trust mark: the pack hashes it again and
    # packs the stored frame instead.
    damaged = cache.path(locs[1].digest)
    data = bytearray(damaged.read_bytes())
    data[0] ^= 0xFF
    with open(damaged, "r+b") as f:
        f.write(bytes(data))
    with assert_logs("does not match its digest; packing the stored frame", count=1):
        packed, from_cache = pack_hint(repo, _hint(env), env.tree.groups, cache)
    assert from_cache == len(locs) - 1
    blob = repo.store.get(object_key("blobs", packed.pack.blob))
    for loc in replay_locs(packed, env.tree.groups):
        decode_chunk(blob[loc.offset:loc.offset + loc.clen], loc.digest, loc.ulen)


def test_a_pack_stops_at_its_limit(env: LoadedEnv, repo: Repository) -> None:
    hint = _hint(env)
    first = chunk_loc(env.tree.groups[0], hint.records[0].chunk)
    packed, _ = pack_hint(repo, hint, env.tree.groups, None, limit=first.clen + 1)
    assert [n > 0 for n in packed.pack.lengths].count(True) == 1
    locs = replay_locs(packed, env.tree.groups)
    assert locs[0].blob == packed.pack.blob
    assert all(loc.blob != packed.pack.blob for loc in locs[1:])  # from the groups' blobs
    with pytest.raises(WeenvError, match="nothing to pack"):
        pack_hint(repo, Hint(env.digest, ()), env.tree.groups, None)


def test_pack_tag_moves_the_tag_only_from_the_expected_hint(env: LoadedEnv,
                                                            repo: Repository) -> None:
    groups = env.tree.groups
    assert pack_tag(repo, env.digest, groups, "latest", None).reason == "no hint is tagged latest"
    digest = publish_hint(repo, _hint(env), "latest")
    moved = pack_tag(repo, env.digest, groups, "latest", None, expect="0" * 64)
    assert moved.hint is None and "moved" in moved.reason
    assert repo.get_tag("hints", env.digest, "latest") == digest
    done = pack_tag(repo, env.digest, groups, "latest", None, expect=digest)
    assert done.reason is None and done.hint == repo.get_tag("hints", env.digest, "latest")
    assert repo.get_hint(done.hint).pack.blob == done.pack
    again = pack_tag(repo, env.digest, groups, "latest", None)
    assert again.hint == done.hint and again.reason == "the hint has a pack already"


def _replay(env: LoadedEnv, hint: Hint, store: FaultyStore, cache: ChunkCache) -> Prefetcher:
    fetcher = Fetcher(store, cache, coalesce_gap=0)
    prefetcher = Prefetcher(env.tree.groups, fetcher)
    run(prefetcher.run, lambda: _found(env, hint))
    return prefetcher


def _found(env: LoadedEnv, hint: Hint):  # noqa: ANN202
    base = found(env, list(hint.records))
    return type(base)(base.digest, base.source, hint)


def _read_all(env: LoadedEnv, fetcher: Fetcher) -> None:
    async def main() -> None:
        reader = Reader(env.tree, fetcher)
        for path, content in CONTENTS.items():
            assert await reader.read(inode_of(env.tree, path), 0, 1 << 20) == content

    run(main)


def test_a_packed_replay_takes_fewer_requests(env: LoadedEnv, repo: Repository,
                                              tmp_path: Path) -> None:
    hint = _hint(env)
    locs = hint_locs(hint.records, env.tree.groups)
    plain = FaultyStore(env.store)
    _replay(env, hint, plain, ChunkCache(tmp_path / "c1", 1 << 30))
    packed, _ = pack_hint(repo, hint, env.tree.groups, None)
    store = FaultyStore(env.store)
    cache = ChunkCache(tmp_path / "c2", 1 << 30)
    prefetcher = _replay(env, packed, store, cache)
    assert all(cache.contains(loc.digest) for loc in locs)
    assert store.calls["get_range"] == 1 < plain.calls["get_range"]
    assert prefetcher.progress()["chunks_missing"] == 0
    _read_all(env, Fetcher(env.store, cache))


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_replay_falls_back_to_the_groups_blobs(env: LoadedEnv, repo: Repository,
                                                 tmp_path: Path, damage: str) -> None:
    hint = _hint(env)
    packed, _ = pack_hint(repo, hint, env.tree.groups, None)
    path = repo.store.root / object_key("blobs", packed.pack.blob)
    if damage == "missing":
        path.unlink()
    else:  # every byte changed: no frame of it decodes or verifies
        data = path.read_bytes()
        os.chmod(path, 0o644)
        path.write_bytes(bytes(b ^ 0x5A for b in data))
    cache = ChunkCache(tmp_path / "c", 1 << 30)
    prefetcher = _replay(env, packed, FaultyStore(env.store), cache)
    assert all(cache.contains(loc.digest) for loc in hint_locs(hint.records, env.tree.groups))
    assert prefetcher.progress()["chunks_missing"] == 0
    _read_all(env, Fetcher(env.store, cache))
