"""core/node_hints.py: recording (no mount), merging and ordering (pure), binding checks, and
finding and publishing hints in a real LocalStore through the real Repository."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from weenvfs.core.loaded_env import open_environment
from weenvfs.core.node_hints import (
    NO_HINT,
    HintRecorder,
    check_hint,
    check_hint_spec,
    find_hint,
    may_have_hint,
    merge_runs,
    publish_run,
)
from weenvfs.core.tree import make_inode
from weenvfs.errors import StoreError, UsageError
from weenvfs.format.digest import digest_hex
from weenvfs.format.hints import Hint, HintFile, HintRecord, decode_hint, encode_hint
from weenvfs.format.index import Span
from weenvfs.format.manifest import GroupRef, Manifest, encode_manifest
from weenvfs.format.refs import SEED_TAG
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository

R = HintRecord
F = HintFile


class Clock:
    """A settable clock for the recorder (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- recording -------------------------------------------------------------------------------


def test_recorder_keeps_first_access_order_and_time() -> None:
    clock = Clock()
    rec = HintRecorder(clock)
    file_g0, file_g1 = make_inode(0, 5), make_inode(1, 7)
    clock.now += 0.010
    rec.note(file_g1, [Span(3, 0, 10), Span(4, 0, 10)])
    clock.now += 0.020
    rec.note(file_g0, [Span(3, 0, 10)])
    rec.note(file_g1, [Span(3, 0, 10)])  # seen: neither moves nor gets a new time
    clock.now += 1.5
    rec.note(file_g1, [Span(9, 5, 6)])
    assert rec.records() == [R(1, 3, 10), R(1, 4, 10), R(0, 3, 30), R(1, 9, 1530)]
    assert len(rec) == 4
    # Files in first-read order, by (group, inode in its index): what a replay reads ahead.
    assert rec.files() == [F(1, 7, 10), F(0, 5, 30)]


def test_recorder_records_groups_beyond_the_first_inode_word() -> None:
    rec = HintRecorder(Clock())
    rec.note(make_inode(3, (1 << 32) - 3), [Span((1 << 32) - 1, 0, 1)])
    assert rec.records() == [R(3, (1 << 32) - 1, 0)]
    assert rec.files() == [F(3, (1 << 32) - 3, 0)]


# -- merging and ordering (pure) -------------------------------------------------------------


def test_one_run_comes_back_as_is() -> None:
    run = [R(0, 5, 0), R(0, 1, 0), R(1, 2, 3), R(0, 9, 3), R(0, 4, 7)]
    assert merge_runs([run]) == tuple(run)


def test_duplicates_within_a_run_keep_the_first() -> None:
    assert merge_runs([[R(0, 1, 2), R(0, 1, 9), R(0, 2, 9)]]) == (R(0, 1, 2), R(0, 2, 9))


def test_union_ordered_by_median_first_access() -> None:
    runs = [
        [R(0, 1, 0), R(0, 2, 10), R(0, 3, 20)],
        [R(0, 2, 0), R(0, 1, 30), R(0, 4, 40)],
        [R(0, 2, 5), R(0, 3, 6), R(0, 1, 50)],
    ]
    # medians (lower): chunk 1 -> 30, chunk 2 -> 5, chunk 3 -> 6, chunk 4 -> 40
    assert merge_runs(runs) == (R(0, 2, 5), R(0, 3, 6), R(0, 1, 30), R(0, 4, 40))


def test_merged_times_never_decrease() -> None:
    runs = [[R(0, c, (c * 37) % 101) for c in sorted(range(50), key=lambda c: (c * 37) % 101)],
            [R(0, c, c) for c in range(0, 80, 2)]]
    times = [r.time_ms for r in merge_runs(runs)]
    assert times == sorted(times)
    assert {r.chunk for r in merge_runs(runs)} == set(range(50)) | set(range(0, 80, 2))


def test_bounded_merge_keeps_what_most_runs_read_then_the_earliest() -> None:
    runs = [
        [R(0, 1, 0), R(0, 2, 1), R(0, 3, 2)],
        [R(0, 3, 0), R(0, 4, 1)],
        [R(0, 3, 0), R(0, 4, 9), R(0, 5, 10)],
    ]
    # chunk 3 read by 3 runs, chunk 4 by 2; then one of 1, 2, 5 (read once): 1 is earliest
    assert merge_runs(runs, max_records=3) == (R(0, 1, 0), R(0, 3, 0), R(0, 4, 1))


def test_merge_is_deterministic_and_encodes() -> None:
    runs = [[R(g, c, c + g) for c in range(100) for g in (0, 1)], [R(1, 50, 0)]]
    merged = merge_runs(runs)
    assert merge_runs(runs) == merged
    hint = Hint("ab" * 32, merged)
    assert decode_hint(encode_hint(hint)) == hint


# -- binding checks and lookups --------------------------------------------------------------


def _env(repo: Repository, build_group, small_group) -> tuple[str, Manifest, list]:
    """A one-group environment over `small_group`, stored (its manifest digest, itself)."""
    manifest = Manifest((GroupRef("small", small_group.index_digest),))
    digest = repo.put_object("manifests", encode_manifest(manifest))
    return digest, manifest, [small_group.index]


def test_file_runs_merge_like_chunk_runs() -> None:
    merged = merge_runs([[F(0, 5, 0), F(0, 9, 40)], [F(0, 9, 2), F(1, 5, 3)]])
    assert merged == (F(0, 5, 0), F(0, 9, 2), F(1, 5, 3))
    assert merge_runs([[], []]) == ()


def test_check_hint_refuses_file_records_of_no_regular_file(repo, build_group, small_group):
    digest, _, indexes = _env(repo, build_group, small_group)
    index = small_group.index
    kinds = {ino: index.inode(ino) for _, ino in index.walk()}
    regular = next(ino for ino, rec in kinds.items() if rec.is_reg)
    directory = next(ino for ino, rec in kinds.items() if rec.is_dir)
    assert check_hint(Hint(digest, (), (F(0, regular, 0),)), digest, indexes) is None
    for bad in (F(0, directory, 0), F(0, index.header.inode_count, 0), F(1, regular, 0)):
        assert "names no regular file" in check_hint(Hint(digest, (), (bad,)), digest, indexes)


def test_check_hint_refuses_other_manifests_and_unknown_chunks(repo, build_group, small_group):
    digest, _, indexes = _env(repo, build_group, small_group)
    count = small_group.index.header.chunk_count
    assert check_hint(Hint(digest, (R(0, count - 1, 0),)), digest, indexes) is None
    assert "bound to" in check_hint(Hint("cd" * 32, ()), digest, indexes)
    assert "names no chunk" in check_hint(Hint(digest, (R(0, count, 0),)), digest, indexes)
    assert "names no chunk" in check_hint(Hint(digest, (R(1, 0, 0),)), digest, indexes)


def test_publish_then_find_by_tag_digest_and_none(repo, build_group, small_group) -> None:
    digest, manifest, indexes = _env(repo, build_group, small_group)
    assert find_hint(repo, digest, manifest, indexes) is None  # no tag yet
    published = publish_run(repo, digest, manifest, indexes, [R(0, 1, 0), R(0, 0, 4)], "train")
    assert published is not None
    hint_digest, hint = published
    assert hint.records == (R(0, 1, 0), R(0, 0, 4))
    found = find_hint(repo, digest, manifest, indexes, "train")
    assert found is not None and found.digest == hint_digest and found.hint == hint
    assert find_hint(repo, digest, manifest, indexes, hint_digest).hint == hint
    assert find_hint(repo, digest, manifest, indexes, NO_HINT) is None
    assert find_hint(repo, digest, manifest, indexes) is None  # tag latest: still none


def test_publishing_merges_runs_unless_replaced(repo, build_group, small_group) -> None:
    digest, manifest, indexes = _env(repo, build_group, small_group)
    publish_run(repo, digest, manifest, indexes, [R(0, 0, 0), R(0, 1, 10)])
    _, merged = publish_run(repo, digest, manifest, indexes, [R(0, 2, 0), R(0, 1, 2)])
    assert [(r.chunk, r.time_ms) for r in merged.records] == [(0, 0), (2, 0), (1, 2)]
    _, alone = publish_run(repo, digest, manifest, indexes, [R(0, 3, 1)], replace=True)
    assert alone.records == (R(0, 3, 1),)
    assert find_hint(repo, digest, manifest, indexes).hint == alone
    assert publish_run(repo, digest, manifest, indexes, []) is None


def test_published_files_merge_with_the_earlier_hints(repo, build_group, small_group) -> None:
    digest, manifest, indexes = _env(repo, build_group, small_group)
    index = small_group.index
    files = [ino for _, ino in index.walk() if index.inode(ino).is_reg][:3]
    publish_run(repo, digest, manifest, indexes, [R(0, 0, 0)], files=[F(0, files[0], 0)])
    _, merged = publish_run(repo, digest, manifest, indexes, [R(0, 1, 0)],
                            files=[F(0, files[1], 0), F(0, files[2], 5)])
    assert merged.files == (F(0, files[0], 0), F(0, files[1], 0), F(0, files[2], 5))
    assert find_hint(repo, digest, manifest, indexes).hint == merged
    _, plain = publish_run(repo, digest, manifest, indexes, [R(0, 1, 0)], replace=True)
    assert plain.files == ()


def test_publishing_changes_no_group_and_no_manifest(repo, build_group, small_group) -> None:
    digest, manifest, indexes = _env(repo, build_group, small_group)
    store = repo.store
    before = {k: store.get(k) for k in store.list("") if not k.startswith(("hints/", "tags/h"))}
    publish_run(repo, digest, manifest, indexes, [R(0, 0, 0)])
    after = {k: store.get(k) for k in store.list("") if not k.startswith(("hints/", "tags/h"))}
    assert after == before
    assert [k for k in store.list("tags/hints/")] == [f"tags/hints/{digest}/latest"]


def test_a_bad_hint_is_ignored_with_a_warning(repo, build_group, small_group, assert_logs):
    digest, manifest, indexes = _env(repo, build_group, small_group)
    other = repo.put_object("hints", encode_hint(Hint("cd" * 32, ())))
    with assert_logs(r"ignored: it is bound to manifest cdcdcdcdcdcd", count=1):
        assert find_hint(repo, digest, manifest, indexes, other) is None
    with assert_logs(r"missing from the store", count=1):
        assert find_hint(repo, digest, manifest, indexes, "ef" * 32) is None


def test_the_manifests_own_hint_is_the_fallback(repo, build_group, small_group) -> None:
    plain = Manifest((GroupRef("small", small_group.index_digest),))
    bound = digest_hex(encode_manifest(plain))  # SPEC.md 9.3: bound to hints=None
    hint_digest = repo.put_object("hints", encode_hint(Hint(bound, (R(0, 2, 0),))))
    manifest = dataclasses.replace(plain, hints=hint_digest)
    digest = repo.put_object("manifests", encode_manifest(manifest))
    found = find_hint(repo, digest, manifest, [small_group.index])
    assert found is not None and found.source == "the manifest"
    assert found.hint.records == (R(0, 2, 0),)


def test_the_seed_is_replayed_only_while_there_is_no_latest(repo, build_group, small_group):
    """SPEC.md 9.4: `latest`, else the manifest's own hint, else the seed; and only for the
    default tag (another tag names what it names)."""
    digest, manifest, indexes = _env(repo, build_group, small_group)
    seed_digest, seed = publish_run(repo, digest, manifest, indexes, [R(0, 0, 0)], SEED_TAG)
    found = find_hint(repo, digest, manifest, indexes)
    assert found is not None and found.digest == seed_digest and found.hint == seed
    assert found.partial  # the start-up only: misses still fetch their neighbourhoods
    assert find_hint(repo, digest, manifest, indexes, "train") is None
    own_digest, own = publish_run(repo, digest, manifest, indexes, [R(0, 1, 0)])
    latest = find_hint(repo, digest, manifest, indexes)
    assert latest.digest == own_digest and not latest.partial
    assert own.records == (R(0, 1, 0),)  # `latest` is not merged into the seed, nor it


class _CannotList(LocalStore):
    """A store that cannot list (as a read-only HTTP store), otherwise the real LocalStore."""

    def list(self, prefix: str = "") -> Iterator[str]:
        raise StoreError(f"store {self.url} cannot list")


@pytest.mark.parametrize("can_list", [True, False])
def test_may_have_hint_asks_for_the_tags_a_mount_would_replay(
        repo, build_group, small_group, local_store, can_list) -> None:
    """A mount starts a replay only when `may_have_hint`: `latest` or the seed for the
    default tag, the tag itself for another, always for a digest, never for none; one
    listing of the environment's hint tags, or GETs where the store cannot list."""
    digest, manifest, indexes = _env(repo, build_group, small_group)
    store = local_store if can_list else _CannotList(local_store.root)
    env = open_environment(store, digest)
    assert not may_have_hint(env, "latest") and not may_have_hint(env, "train")
    assert may_have_hint(env, "ab" * 32) and not may_have_hint(env, NO_HINT)
    publish_run(repo, digest, manifest, indexes, [R(0, 0, 0)], SEED_TAG)
    assert may_have_hint(env, "latest") and not may_have_hint(env, "train")
    publish_run(repo, digest, manifest, indexes, [R(0, 1, 0)], "train")
    assert may_have_hint(env, "train")


def test_may_have_hint_takes_the_node_s_word_for_latest(
        repo, build_group, small_group, local_store, tmp_path) -> None:
    """An environment the node's cache marks as hinted (`remember_hinted`: `weenv run` did,
    after it saw the hint) may have `latest` without a store request; another tag, or
    another node cache, still asks the store."""
    from weenvfs.core.node_copies import load_manifest, remember_hinted

    digest, _, _ = _env(repo, build_group, small_group)
    env = open_environment(local_store, digest)
    cache = tmp_path / "node"
    load_manifest(Repository(local_store), digest, cache)  # the node copy the mark goes on
    env.store = FaultyStore(local_store)
    assert not may_have_hint(env, "latest", cache)
    assert env.store.calls == {"list": 1}
    remember_hinted(cache, digest)
    assert may_have_hint(env, "latest", cache)
    assert env.store.calls == {"list": 1}  # not asked again
    assert not may_have_hint(env, "train", cache)
    assert not may_have_hint(env, "latest", tmp_path / "other")
    assert env.store.calls == {"list": 3}


def test_may_have_hint_during_an_outage_says_maybe_after_one_request(
        repo, build_group, small_group, local_store) -> None:
    """A store that cannot be reached: maybe (the replay reports what it finds), after the
    one listing; the tag GETs a store that cannot list gets would fail the same way."""
    digest, _, _ = _env(repo, build_group, small_group)
    env = open_environment(local_store, digest)
    env.store = FaultyStore(local_store, "P*")
    assert may_have_hint(env, "latest")
    assert env.store.calls == {"list": 1}


@pytest.mark.parametrize("spec", ["latest", "v1.2", NO_HINT, "ab" * 32, "blake3:" + "ab" * 32])
def test_hint_specs(spec: str) -> None:
    assert check_hint_spec(spec) == spec


@pytest.mark.parametrize("spec", ["", "a/b", "-x", "x" * 200])
def test_bad_hint_specs(spec: str) -> None:
    with pytest.raises(UsageError):
        check_hint_spec(spec)
    with pytest.raises(UsageError):
        check_hint_spec(NO_HINT, "--record-hints", allow_none=False)
