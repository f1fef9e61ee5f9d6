"""The node's copies of indexes and device layouts (core/node_copies.py, core/kernel_image.py,
core/node_files.py): fetched or derived once, checked against their digest at every use, and
never served when damaged.

Real components: a group built by tools/builder.py into a real local store (test_reader.py's
`make_env`), counted by FaultyStore in front of it; real files and xattrs in tmp_path.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from test_reader import make_env

from weenvfs.core import node_copies, node_files
from weenvfs.core.kernel_image import cached_layout
from weenvfs.core.loaded_env import LoadedEnv, open_environment
from weenvfs.core.node_copies import (
    INDEX_DIR,
    MANIFEST_DIR,
    TREE_VERDICT,
    load_index,
    load_manifest,
)
from weenvfs.format.device_layout import DeviceLayout
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.repository import Repository


@pytest.fixture
def env(repo: Repository, build_group, open_env) -> LoadedEnv:
    return make_env(repo, build_group, open_env)


def _needs_xattrs(folder: Path) -> None:
    probe = folder / ".probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.weenv.probe", b"1")
    except OSError:
        pytest.skip("the temp folder's file system has no user xattrs")


def test_an_index_is_fetched_and_tree_checked_once(env: LoadedEnv, tmp_path: Path,
                                                   monkeypatch) -> None:
    _needs_xattrs(tmp_path)
    store = FaultyStore(env.store)
    repo, digest = Repository(store), env.manifest.groups[0].index
    cache = tmp_path / "node"
    checks: list[int] = []
    real_check = node_copies.check_tree
    monkeypatch.setattr(node_copies, "check_tree",
                        lambda index: (checks.append(1), real_check(index))[1])
    first = load_index(repo, digest, cache)
    fetched = store.calls["get"]
    assert fetched >= 1 and checks == [1]
    assert node_files.has_verdict(cache / INDEX_DIR / digest, TREE_VERDICT)
    again = load_index(repo, digest, cache)
    assert store.calls["get"] == fetched and checks == [1]  # from the node, not re-checked
    assert again.raw == first.raw == env.tree.groups[0].raw
    # Without the verdict (another validator version): checked again, still not fetched.
    os.removexattr(cache / INDEX_DIR / digest, TREE_VERDICT)
    load_index(repo, digest, cache)
    assert store.calls["get"] == fetched and checks == [1, 1]


def test_a_damaged_copy_is_never_served(env: LoadedEnv, tmp_path: Path, assert_logs) -> None:
    _needs_xattrs(tmp_path)
    store = FaultyStore(env.store)
    repo, digest = Repository(store), env.manifest.groups[0].index
    cache = tmp_path / "node"
    good = load_index(repo, digest, cache).raw
    copy = cache / INDEX_DIR / digest
    # Damaged in place (the verdict xattr stays): the digest no longer matches.
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(copy, "r+b") as f:
        f.write(data)
    assert node_files.has_verdict(copy, TREE_VERDICT)
    before = store.calls["get"]
    with assert_logs("copy of index [0-9a-f]{12} is damaged: fetching it again", count=1):
        assert load_index(repo, digest, cache).raw == good
    assert store.calls["get"] == before + 1
    assert copy.read_bytes() != bytes(data)  # replaced by the fetched object


def test_without_a_cache_folder_nothing_is_kept(env: LoadedEnv, tmp_path: Path) -> None:
    before = set(tmp_path.rglob("*"))
    load_index(Repository(env.store), env.manifest.groups[0].index)
    assert set(tmp_path.rglob("*")) == before


def test_a_refused_index_is_not_kept(env: LoadedEnv, tmp_path: Path, monkeypatch) -> None:
    from weenvfs.format.errors import FormatError

    def refuse(index: object) -> None:
        raise FormatError("directory inode 1", "reachable by more than one path")

    monkeypatch.setattr("weenvfs.core.node_copies.check_tree", refuse)
    with pytest.raises(FormatError):
        load_index(Repository(env.store), env.manifest.groups[0].index, tmp_path / "node")
    assert not (tmp_path / "node" / INDEX_DIR / env.manifest.groups[0].index).exists()


def test_open_environment_keeps_its_indexes_on_the_node(env: LoadedEnv, tmp_path: Path):
    cache = tmp_path / "node"
    opened = open_environment(env.store, "env:t", cache_dir=cache)
    assert [p.name for p in (cache / INDEX_DIR).iterdir()] == [env.manifest.groups[0].index]
    assert opened.tree.groups[0].raw == env.tree.groups[0].raw


def test_a_layout_is_derived_once_and_read_back_equal(env: LoadedEnv, tmp_path: Path,
                                                      assert_logs, monkeypatch) -> None:
    index, digest = env.tree.groups[0], env.manifest.groups[0].index
    cache = tmp_path / "node"
    fresh = DeviceLayout(index)
    cached_layout(cache, digest, index)
    path = cache / "erofs" / f"{digest}.layout"
    assert path.exists()
    derived: list[int] = []
    real = DeviceLayout.__init__
    monkeypatch.setattr(DeviceLayout, "__init__",
                        lambda self, idx: (derived.append(1), real(self, idx))[1])
    back = cached_layout(cache, digest, index)
    assert derived == [] and back.size == fresh.size and back.files == fresh.files
    rng = random.Random(3)
    for _ in range(300):
        offset, size = rng.randrange(0, fresh.size), rng.randrange(1, 3 * 4096)
        assert back.pieces(offset, size) == fresh.pieces(offset, size)
    # Damaged in place: derived again, and the copy replaced.
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    path.write_bytes(bytes(data))
    with assert_logs("does not match its digest: deriving it again", count=1):
        again = cached_layout(cache, digest, index)
    assert derived == [1] and again.pieces(0, fresh.size) == fresh.pieces(0, fresh.size)
    assert cached_layout(cache, digest, index).size == fresh.size and derived == [1]


def test_saved_layouts_refuse_what_is_not_one(env: LoadedEnv) -> None:
    saved = DeviceLayout(env.tree.groups[0]).to_bytes()
    for bad in (b"", saved[:10], b"XXXXXXXX" + saved[8:], saved + b"\0", saved[:-1]):
        with pytest.raises(ValueError):
            DeviceLayout.from_bytes(bad)


def test_a_manifest_is_fetched_once_and_a_damaged_copy_never_served(
        env: LoadedEnv, tmp_path: Path, assert_logs) -> None:
    store = FaultyStore(env.store)
    repo, cache = Repository(store), tmp_path / "node"
    load = lambda d: load_manifest(repo, d, cache)  # noqa: E731
    digest, first = repo.resolve_env(env.digest, load)
    fetched = store.calls["get"]
    assert fetched >= 1 and first == env.manifest
    assert repo.resolve_env(env.digest, load) == (digest, first)
    assert store.calls["get"] == fetched  # from the node's copy
    copy = cache / MANIFEST_DIR / digest
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF
    copy.write_bytes(bytes(data))
    with assert_logs("copy of manifest [0-9a-f]{12} is damaged: fetching it again", count=1):
        assert repo.resolve_env(env.digest, load) == (digest, first)
    assert store.calls["get"] == fetched + 1
    assert copy.read_bytes() != bytes(data)  # replaced by the verified object


@pytest.fixture
def forget_preloaded(monkeypatch):
    """Preloading makes this process hash on one thread (format/digest.py `fork_server`):
    restored afterwards, with nothing kept."""
    from weenvfs.format import digest

    monkeypatch.setattr(digest, "_threads_allowed", digest._threads_allowed)
    yield
    node_copies.forget_preloaded()


def test_preloaded_objects_are_taken_from_memory_and_only_verified_ones_kept(
        env: LoadedEnv, tmp_path: Path, forget_preloaded, assert_logs) -> None:
    store = FaultyStore(env.store)
    repo, cache = Repository(store), tmp_path / "node"
    index_digest = env.manifest.groups[0].index
    # Nothing on the node yet: preloading never reaches the store, it keeps nothing.
    assert node_copies.preload_env(cache, env.digest) == 0
    assert sum(store.calls.values()) == 0
    repo.resolve_env(env.digest, lambda d: load_manifest(repo, d, cache))
    load_index(repo, index_digest, cache)
    # A damaged index copy is left out; the intact manifest is kept.
    copy = cache / INDEX_DIR / index_digest
    intact = copy.read_bytes()
    copy.write_bytes(intact[:-1] + bytes([intact[-1] ^ 0xFF]))
    with assert_logs("copy of index [0-9a-f]{12} is damaged", count=1):
        assert node_copies.preload_env(cache, env.digest) == 1
    copy.write_bytes(intact)
    assert node_copies.preload_env(cache, env.digest) == 1  # the index now; the manifest kept
    assert node_copies.preload_env(cache, env.digest) == 0  # both kept already
    assert node_copies.preload_env(cache, "../" + env.digest[3:]) == 0  # not a digest
    # Kept in memory: the node copies are no longer read (gone, or even damaged).
    copy.unlink()
    (cache / MANIFEST_DIR / env.digest).write_bytes(b"damaged")
    calls = sum(store.calls.values())
    assert load_index(repo, index_digest, cache).raw == env.tree.groups[0].raw
    assert load_manifest(repo, env.digest, cache) == env.manifest
    assert sum(store.calls.values()) == calls
    # Another cache folder is another node cache: nothing of this one is taken there.
    assert load_index(repo, index_digest, tmp_path / "other").raw == env.tree.groups[0].raw
    assert sum(store.calls.values()) == calls + 1
    node_copies.forget_preloaded()
    assert load_index(repo, index_digest, cache).raw == env.tree.groups[0].raw
    assert sum(store.calls.values()) == calls + 2  # fetched again: the copy was gone


def test_preloading_keeps_within_its_bound(env: LoadedEnv, tmp_path: Path, forget_preloaded,
                                          monkeypatch) -> None:
    repo, cache = Repository(env.store), tmp_path / "node"
    repo.resolve_env(env.digest, lambda d: load_manifest(repo, d, cache))
    load_index(repo, env.manifest.groups[0].index, cache)
    size = len(env.tree.groups[0].raw)
    monkeypatch.setattr(node_copies, "PRELOAD_BYTES", size - 1)  # the index does not fit
    assert node_copies.preload_env(cache, env.digest) == 1  # the manifest only
    assert [key[0] for key in node_copies._preloaded] == ["manifest"]
    monkeypatch.setattr(node_copies, "PRELOAD_BYTES", size + 4096)
    assert node_copies.preload_env(cache, env.digest) == 1
    assert [key[0] for key in node_copies._preloaded] == ["manifest", "index"]
    other = cache / "other"
    other.mkdir()
    for kind in (MANIFEST_DIR, INDEX_DIR):
        (other / kind).mkdir()
        for copy in (cache / kind).iterdir():
            (other / kind / copy.name).write_bytes(copy.read_bytes())
    # Another folder's objects push out the least recently preloaded ones, one by one.
    assert node_copies.preload_env(other, env.digest) == 2
    assert [key[:2] for key in node_copies._preloaded] == [
        ("manifest", str(other)), ("index", str(other))]


def test_a_noted_resolution_is_the_last_one_and_never_garbage(tmp_path: Path) -> None:
    """`note_resolved` keeps the last digest per (store argument, reference), written only
    when it changed; `last_resolved` gives None for anything else, a damaged note included,
    and a digest given as the reference is not noted (there is nothing to guess)."""
    cache, a, b = tmp_path / "node", "1" * 64, "2" * 64
    assert node_copies.last_resolved(cache, "/store", "env:latest") is None
    node_copies.note_resolved(cache, "/store", "env:latest", a)
    note = node_copies._ref_path(cache, "/store", "env:latest")
    written = note.stat().st_mtime_ns
    node_copies.note_resolved(cache, "/store", "env:latest", a)
    assert note.stat().st_mtime_ns == written  # unchanged: not written again
    assert node_copies.last_resolved(cache, "/store", "env:latest") == a
    assert node_copies.last_resolved(cache, "/other", "env:latest") is None
    assert node_copies.last_resolved(cache, "/store", "env:other") is None
    node_copies.note_resolved(cache, "/store", "env:latest", b)
    assert node_copies.last_resolved(cache, "/store", "env:latest") == b
    note.write_bytes(b"../../etc/passwd\n")
    assert node_copies.last_resolved(cache, "/store", "env:latest") is None
    note.write_bytes(b"\xff\xfe")
    assert node_copies.last_resolved(cache, "/store", "env:latest") is None
    node_copies.note_resolved(cache, "/store", a, a)
    assert node_copies.last_resolved(cache, "/store", a) is None


def test_a_file_is_hashed_where_it_lies(tmp_path: Path) -> None:
    """`node_files.hash_file` (images are checked by it at every mount): the digest of the
    content, empty files included."""
    from weenvfs.format.digest import digest_hex

    for size in (0, 1, 4096, 1 << 20 | 3):
        path = tmp_path / f"f{size}"
        data = random.Random(size).randbytes(size)
        path.write_bytes(data)
        assert node_files.hash_file(path, digest_hex) == digest_hex(data)


def test_a_preloaded_manifest_gets_its_node_copy_back(env: LoadedEnv, tmp_path: Path,
                                                      forget_preloaded) -> None:
    """A manifest kept in memory whose node copy was removed since (the cache cleared or
    evicted under a running node service) is written back by its next load, byte for byte:
    the node's HINTED mark lives on that file (`remember_hinted` / `known_hinted`)."""
    _needs_xattrs(tmp_path)
    repo, cache = Repository(env.store), tmp_path / "node"
    load_manifest(repo, env.digest, cache)
    copy = cache / MANIFEST_DIR / env.digest
    stored = copy.read_bytes()
    assert node_copies.preload_env(cache, env.digest) == 1  # the manifest (no index copy)
    copy.unlink()
    node_copies.remember_hinted(cache, env.digest)
    assert not node_copies.known_hinted(cache, env.digest)  # nothing to mark
    counted = FaultyStore(env.store)
    assert load_manifest(Repository(counted), env.digest, cache) == env.manifest
    assert sum(counted.calls.values()) == 0  # from memory, not the store
    assert copy.read_bytes() == stored
    node_copies.remember_hinted(cache, env.digest)
    assert node_copies.known_hinted(cache, env.digest)
