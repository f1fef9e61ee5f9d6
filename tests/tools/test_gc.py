"""`weenv gc`: dry runs delete nothing, --delete removes exactly the unreferenced objects,
reachable objects survive every case, and an unreadable reachable object stops everything."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from fixtures import (
    age,
    all_objects,
    assert_one_line_error,
    encode_group,
    flip_byte,
    object_path,
    put_manifest,
    run_cli,
    standard_env,
)
from support.trees import file

from weenvfs.format.digest import short
from weenvfs.format.hints import Hint, HintPack, HintRecord, encode_hint
from weenvfs.format.manifest import GroupRef
from weenvfs.store.base import TEMP_PREFIX
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools.gc import collect_garbage
from weenvfs.tools.verify import verify

HOUR = 3600.0


def _age_all(store: LocalStore, seconds: float = 2 * HOUR) -> None:
    for key in all_objects(store):
        age(store.root / key, seconds)


def _garbage(repo: Repository) -> set[str]:
    """Unreferenced objects: an untagged group, an untagged manifest over it, a stray hint
    and a stray blob. Returns their keys."""
    index, blob = encode_group(repo, [file("junk", b"j" * 10_000), file("tiny", b"t")])
    assert blob is not None
    manifest = put_manifest(repo, None, [GroupRef("junk", index)])
    hint = repo.put_object("hints", encode_hint(Hint(manifest, (HintRecord(0, 0, 5),))))
    stray = repo.put_object("blobs", b"stray blob of a crashed publish")
    return {
        f"indexes/{index}",
        f"blobs/{blob}",
        f"manifests/{manifest}",
        f"hints/{hint}",
        f"blobs/{stray}",
    }


@pytest.fixture
def garbage(repo: Repository, store: LocalStore) -> set[str]:
    standard_env(repo)
    keys = _garbage(repo)
    _age_all(store)
    return keys


def _gc(store: LocalStore, capsys: Any, *args: str) -> tuple[int, str, str]:
    return run_cli(["gc", "--store", str(store.root), *args], capsys)


def test_dry_run_deletes_nothing(store: LocalStore, garbage: set[str], capsys: Any) -> None:
    before = all_objects(store)
    code, out, _ = _gc(store, capsys)
    assert code == 0
    assert all_objects(store) == before
    listed = {ln.split()[2] for ln in out.splitlines() if ln.startswith("would delete")}
    assert listed == garbage
    assert "gc: dry run, 5 objects" in out and "nothing deleted" in out


def test_delete_removes_exactly_the_garbage(
    repo: Repository, store: LocalStore, garbage: set[str], capsys: Any
) -> None:
    before = all_objects(store)
    code, out, _ = _gc(store, capsys, "--delete", "--json")
    assert code == 0
    report = json.loads(out)
    assert {u["key"] for u in report["unreferenced"]} == garbage
    assert report["deleted"] == 5 and report["reachable"]["indexes"] == 3
    assert all_objects(store) == before - garbage
    assert verify(repo, "py-env").ok
    # A second run finds nothing more.
    assert collect_garbage(repo, delete=True).unreferenced == []


def test_untagging_frees_only_what_nothing_else_reaches(
    repo: Repository, store: LocalStore, capsys: Any
) -> None:
    env = standard_env(repo)
    shared = repo.get_tag("groups", "base", "latest")
    put_manifest(repo, "other", [GroupRef("base", shared)])
    for name in ("mid", "top"):
        repo.delete_tag("groups", name, "latest")
    mid_index = repo.get_manifest(env).groups[1].index
    repo.delete_tag("envs", "py-env", "latest")
    _age_all(store)
    report = collect_garbage(repo, delete=True)
    deleted = {key for key, _ in report.unreferenced}
    assert f"manifests/{env}" in deleted and f"indexes/{mid_index}" in deleted
    assert repo.has_object("indexes", shared)
    assert verify(repo, "other").ok


def test_young_objects_are_kept(repo: Repository, store: LocalStore, capsys: Any) -> None:
    standard_env(repo)
    _age_all(store)
    young = _garbage(repo)
    code, out, _ = _gc(store, capsys, "--delete")
    assert code == 0
    assert "kept         5 unreferenced objects younger than the grace period" in out
    assert young <= all_objects(store)
    code, out, _ = _gc(store, capsys, "--delete", "--grace", "0")
    assert code == 0 and not young & all_objects(store)


def test_young_index_keeps_its_old_blobs(repo: Repository, store: LocalStore) -> None:
    # A publish in progress: it reused an old unreferenced blob and has written its index,
    # but not yet its tag.
    index, blob = encode_group(repo, [file("data", b"d" * 10_000)])
    _age_all(store)
    os.utime(object_path(store, "indexes", index))  # the index is new
    report = collect_garbage(repo, delete=True)
    assert report.unreferenced == [] and report.young == [f"indexes/{index}"]
    assert repo.has_object("blobs", blob or "")


def test_hint_tags_and_manifest_hints_are_roots(repo: Repository, store: LocalStore) -> None:
    env = standard_env(repo)
    tagged = repo.put_object("hints", encode_hint(Hint(env, (HintRecord(0, 1, 2),))))
    repo.set_tag("hints", env, "latest", tagged)
    embedded = repo.put_object("hints", encode_hint(Hint(env, (HintRecord(1, 0, 3),))))
    groups = list(repo.get_manifest(env).groups)
    put_manifest(repo, "hinted", groups, hints=embedded)
    _age_all(store)
    report = collect_garbage(repo, delete=True)
    assert report.unreferenced == []
    assert report.reachable["hints"] == {tagged, embedded}
    assert report.roots == {"envs": 2, "groups": 3, "hints": 1}


def test_a_hint_keeps_its_pack_blob(repo: Repository, store: LocalStore) -> None:
    """SPEC.md 9.1: a pack is a blob only its hint names; it lives as long as the hint."""
    env = standard_env(repo)
    pack = repo.put_object("blobs", b"frames of the hinted chunks")
    hint = Hint(env, (HintRecord(0, 1, 2),), pack=HintPack(pack, 27, (27,)))
    repo.set_tag("hints", env, "latest", repo.put_object("hints", encode_hint(hint)))
    _age_all(store)
    report = collect_garbage(repo, delete=True)
    assert report.unreferenced == [] and pack in report.reachable["blobs"]
    store.delete(f"tags/hints/{env}/latest")
    report = collect_garbage(repo, delete=True)
    assert f"blobs/{pack}" in {key for key, _ in report.unreferenced}
    assert not repo.has_object("blobs", pack)


def test_unreadable_reachable_index_aborts(
    repo: Repository, store: LocalStore, garbage: set[str], capsys: Any
) -> None:
    index = repo.get_tag("groups", "mid", "latest")
    flip_byte(object_path(store, "indexes", index))
    before = all_objects(store)
    code, out, err = _gc(store, capsys, "--delete")
    line = assert_one_line_error(code, err)
    assert "gc aborted, nothing deleted" in line and f"indexes/{short(index)}" in line
    assert out == "" and all_objects(store) == before


def test_tag_to_missing_manifest_aborts(
    repo: Repository, store: LocalStore, garbage: set[str], capsys: Any
) -> None:
    env = repo.get_tag("envs", "py-env", "latest")
    object_path(store, "manifests", env).unlink()
    before = all_objects(store)
    code, _, err = _gc(store, capsys, "--delete", "--grace", "0")
    line = assert_one_line_error(code, err)
    assert f"manifests/{short(env)}" in line and "tag envs/py-env:latest" in line
    assert all_objects(store) == before


def test_unknown_keys_and_temp_files(
    repo: Repository, store: LocalStore, garbage: set[str], capsys: Any
) -> None:
    store.put("blobs/README", b"not a digest")
    temp = store.root / "blobs" / (TEMP_PREFIX + "crashed")
    temp.write_bytes(b"half a blob")
    age(temp, 2 * HOUR)
    code, out, _ = _gc(store, capsys, "--delete")
    assert code == 0
    assert "unknown      blobs/README is not a digest key: left alone" in out
    assert "1 stale temp files" in out
    assert store.exists("blobs/README") and not temp.exists()


class _AgelessStore(FaultyStore):
    """A real local store behind a wrapper that cannot report object ages."""

    def mtime(self, key: str) -> float | None:
        return None


def test_objects_of_unknown_age_are_kept(repo: Repository, store: LocalStore) -> None:
    standard_env(repo)
    junk = _garbage(repo)
    _age_all(store)
    blind = Repository(_AgelessStore(store))
    report = collect_garbage(blind, delete=True)
    assert set(report.ageless) == junk and report.deleted == 0
    report = collect_garbage(blind, delete=True, grace=0)
    assert report.deleted == 5 and not junk & all_objects(store)


def test_bad_grace_is_a_usage_error(store: LocalStore, capsys: Any) -> None:
    code, _, err = _gc(store, capsys, "--grace", "soon")
    assert code == 2 and "invalid duration" in err


def _break_tag(path: Path, how: str) -> None:
    """Put something unreadable where the tag file `path` is (in a local store's folder)."""
    target = path.read_bytes()
    path.unlink()
    if how == "loop":
        path.symlink_to(path.name)
    elif how == "folder":
        path.mkdir()
    elif how == "dangling":
        path.symlink_to("nowhere")
    elif how == "outside":  # a valid tag, but outside the store
        outside = path.parents[4] / "outside-tag"
        outside.write_bytes(target)
        path.symlink_to(outside)
    else:
        path.write_bytes(b"garbage\n")


@pytest.mark.parametrize("kind", ["envs", "groups", "hints"])
@pytest.mark.parametrize("how", ["loop", "folder", "dangling", "outside", "garbage"])
def test_an_unreadable_tag_aborts(
    repo: Repository, store: LocalStore, capsys: Any, kind: str, how: str
) -> None:
    """A tag that is there but cannot be read may name anything: nothing is deleted. The
    local store's listing skips folders and symlinks it cannot follow, so gc must not rely
    on it alone (they used to make the tag's manifest garbage)."""
    env = standard_env(repo)
    repo.set_tag("hints", env, "latest", repo.put_object(
        "hints", encode_hint(Hint(env, (HintRecord(0, 1, 2),)))))
    name = {"envs": "py-env", "groups": "top", "hints": env}[kind]
    _break_tag(store.root / "tags" / kind / name / "latest", how)
    _age_all(store)
    before = all_objects(store)
    code, out, err = _gc(store, capsys, "--delete", "--grace", "0")
    line = assert_one_line_error(code, err)
    assert "gc aborted, nothing deleted" in line, line
    assert f"cannot read tag {kind}/{name}:latest: " in line, line
    assert out == "" and all_objects(store) == before


def test_a_symlinked_name_folder_aborts(
    repo: Repository, store: LocalStore, capsys: Any
) -> None:
    """tags/envs/NAME as a symlink to a folder: `inspect NAME` reads through it, the store's
    listing does not."""
    standard_env(repo)
    real = store.root / "elsewhere"
    (store.root / "tags" / "envs" / "py-env").rename(real)
    (store.root / "tags" / "envs" / "py-env").symlink_to(real)
    assert repo.get_tag("envs", "py-env", "latest")
    _age_all(store)
    before = all_objects(store)
    code, _, err = _gc(store, capsys, "--delete", "--grace", "0")
    line = assert_one_line_error(code, err)
    assert "gc aborted, nothing deleted: cannot read tag envs/py-env:*: " in line, line
    assert all_objects(store) == before


def test_a_temp_file_among_tags_is_not_a_tag(repo: Repository, store: LocalStore) -> None:
    """A crashed tag write leaves a temp file: not a tag, and not a reason to abort."""
    standard_env(repo)
    (store.root / "tags" / "envs" / "py-env" / (TEMP_PREFIX + "crashed")).mkdir()
    _age_all(store)
    report = collect_garbage(repo, delete=True, grace=0)
    assert report.roots["envs"] == 1 and report.deleted == 0
