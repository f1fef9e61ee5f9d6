"""`weenv verify`: a clean environment passes; each kind of damage is found and named."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from fixtures import (
    GroupEncoder,
    assert_one_line_error,
    base_specs,
    flip_byte,
    object_path,
    put_manifest,
    run_cli,
    standard_env,
)
from support.trees import file, with_parents

from weenvfs.format.chunk import compress_object
from weenvfs.format.digest import digest_hex, short
from weenvfs.format.hints import Hint, HintRecord, encode_hint
from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import GroupRef
from weenvfs.format.refs import tag_key
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools.verify import check_structure, verify


@pytest.fixture
def env(repo: Repository) -> str:
    return standard_env(repo)


def _verify(store: LocalStore, capsys: Any, *args: str) -> tuple[int, list[str]]:
    code, out, err = run_cli(["verify", *args, "--store", str(store.root)], capsys)
    assert err == ""
    return code, out.splitlines()


def _group_digest(repo: Repository, name: str) -> str:
    return repo.get_tag("groups", name, "latest")


def _blob_of(repo: Repository, name: str) -> str:
    (blob,) = repo.get_index(_group_digest(repo, name)).blob_digests()
    return blob


def test_clean_env_passes(store: LocalStore, env: str, capsys: Any) -> None:
    code, lines = _verify(store, capsys, "py-env")
    assert code == 0
    assert lines[-1].startswith("ok: py-env: 3 indexes")
    assert len(lines) == 1


def test_clean_env_counts(repo: Repository, env: str) -> None:
    report = verify(repo, "py-env")
    assert report.ok and report.manifest == env
    c = report.checked
    assert c["manifests"] == 1 and c["indexes"] == 3 and c["blobs"] == 3
    assert c["chunks"] >= 4 and c["zero chunks"] >= 3
    # Every batched small file (4 in base, 2 in mid, 1 in top) was hashed.
    assert c["file digests"] == 7
    quick = verify(repo, env, quick=True)
    assert quick.ok and quick.checked["chunks"] == 0 and quick.checked["blobs"] == 3


def test_flipped_byte_in_blob(repo: Repository, store: LocalStore, env: str, capsys: Any) -> None:
    flip_byte(object_path(store, "blobs", _blob_of(repo, "base")))
    code, lines = _verify(store, capsys, "py-env")
    assert code == 1
    index = short(_group_digest(repo, "base"))
    blob = short(_blob_of(repo, "base"))
    assert lines[0].startswith(f"blobs/{blob}: blob is corrupt: its content hashes to ")
    problems = [ln for ln in lines if ln.startswith(f"indexes/{index}: chunk ")]
    assert problems and len(problems) == len(lines) - 2
    assert any("digest mismatch" in ln or "decompress" in ln for ln in problems)
    assert lines[-1].startswith(f"FAILED: py-env: {len(problems) + 1} problem")
    # --quick does not read chunk data, so it cannot see this.
    assert _verify(store, capsys, "py-env", "--quick")[0] == 0


def test_flipped_byte_in_index(repo: Repository, store: LocalStore, env: str, capsys: Any) -> None:
    digest = _group_digest(repo, "mid")
    flip_byte(object_path(store, "indexes", digest))
    code, lines = _verify(store, capsys, "py-env")
    assert code == 1
    assert lines[0].startswith(f"indexes/{short(digest)}: index of group 'mid' is corrupt")
    assert lines[-1].startswith("FAILED: py-env: 1 problem ")


def test_deleted_blob(repo: Repository, store: LocalStore, env: str, capsys: Any) -> None:
    blob = _blob_of(repo, "top")
    object_path(store, "blobs", blob).unlink()
    for quick in ([], ["--quick"]):
        code, lines = _verify(store, capsys, "py-env", *quick)
        assert code == 1
        assert f"blob {short(blob)} (blob 0) is missing from the store" in lines[0]
        assert len(lines) == 2


def test_manifest_pointing_at_missing_index(
    repo: Repository, store: LocalStore, capsys: Any
) -> None:
    standard_env(repo)
    ghost = digest_hex(b"never stored")
    groups = [GroupRef("base", _group_digest(repo, "base")), GroupRef("ghost", ghost)]
    put_manifest(repo, "broken", groups)
    code, lines = _verify(store, capsys, "broken")
    assert code == 1
    assert lines[0] == f"indexes/{short(ghost)}: index of group 'ghost' is missing"


def test_every_problem_is_reported(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    object_path(store, "blobs", _blob_of(repo, "base")).unlink()
    flip_byte(object_path(store, "indexes", _group_digest(repo, "mid")))
    code, out, _ = run_cli(["verify", "py-env", "--store", str(store.root), "--json"], capsys)
    assert code == 1
    report = json.loads(out)
    assert not report["ok"]
    messages = [p["problem"] for p in report["problems"]]
    assert len(messages) == 2, messages
    assert "is missing from the store" in messages[0] and "is corrupt" in messages[1]
    assert report["problems"][1]["object"] == "indexes/" + _group_digest(repo, "mid")


def test_missing_and_corrupt_manifest(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    flip_byte(object_path(store, "manifests", env), 0)
    code, lines = _verify(store, capsys, "py-env")
    assert code == 1 and lines[0].startswith(f"manifests/{short(env)}: manifest is corrupt")
    object_path(store, "manifests", env).unlink()
    code, lines = _verify(store, capsys, env)
    assert code == 1 and lines[0] == f"manifests/{short(env)}: manifest is missing"


def _patched_index(repo: Repository, digest: str, offset: int, value: bytes) -> str:
    """Store a copy of index `digest` with `value` written at `offset` of the raw bytes."""
    raw = bytearray(repo.get_index(digest).raw)
    raw[offset : offset + len(value)] = value
    return repo.put_object("indexes", compress_object(bytes(raw)))


def test_bad_link_count_is_found(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    index = repo.get_index(_group_digest(repo, "top"))
    ino = index.resolve(b"app/main.py")
    assert ino is not None
    nlink_at = index.header.inode_offset + ino * 72 + 12  # mode, uid, gid, then nlink (u32)
    patched = _patched_index(repo, _group_digest(repo, "top"), nlink_at, (5).to_bytes(4, "little"))
    put_manifest(repo, "patched", [GroupRef("top", patched)])
    code, lines = _verify(store, capsys, "patched")
    assert code == 1
    assert lines[0] == f"indexes/{short(patched)}: inode {ino}: link count 5, expected 1"


def test_bad_dirent_is_found(repo: Repository, env: str) -> None:
    digest = _group_digest(repo, "top")
    index = repo.get_index(digest)
    # Point the root's first entry at an inode number past the table.
    dirent_at = index.header.dirent_offset + 8
    patched = _patched_index(repo, digest, dirent_at, (999).to_bytes(4, "little"))
    found = check_structure(GroupIndex(repo.get_index(patched).raw))
    assert any("directory inode 0 entry 0" in p and "999" in p for p in found.problems)
    assert any("not reachable from the root" in p for p in found.problems)


def test_wrong_file_digest_is_found(repo: Repository, store: LocalStore, capsys: Any) -> None:
    enc = GroupEncoder()
    for spec in with_parents([file("a", b"alpha"), file("b", b"beta")]):
        enc.add(spec)
    enc.nodes[b"b"].file_digest = bytes(32)
    index, _ = enc.finish(repo)
    put_manifest(repo, "digests", [GroupRef("g", index)])
    code, lines = _verify(store, capsys, "digests")
    assert code == 1
    assert lines[0].endswith("does not match its file digest")
    assert _verify(store, capsys, "digests", "--quick")[0] == 0


def test_hints_are_checked(repo: Repository, store: LocalStore, env: str, capsys: Any) -> None:
    groups = list(repo.get_manifest(env).groups)
    ghost = digest_hex(b"no such hint")
    put_manifest(repo, "nohint", groups, hints=ghost)
    code, lines = _verify(store, capsys, "nohint")
    assert code == 1 and lines[0] == f"hints/{short(ghost)}: hint is missing"
    # SPEC 9.3: the manifest's own hint is bound to the same manifest without `hints`.
    unhinted = put_manifest(repo, None, groups)
    good = repo.put_object("hints", encode_hint(Hint(unhinted, (HintRecord(0, 0, 1),))))
    put_manifest(repo, "hinted", groups, hints=good)
    assert _verify(store, capsys, "hinted")[0] == 0
    bad = repo.put_object("hints", encode_hint(Hint(unhinted, (HintRecord(7, 0, 1),))))
    put_manifest(repo, "badhint", groups, hints=bad)
    code, lines = _verify(store, capsys, "badhint")
    assert code == 1 and "1 of 1 hint records name no chunk" in lines[0]


def test_group_mode(repo: Repository, store: LocalStore, env: str, capsys: Any) -> None:
    assert _verify(store, capsys, "base", "--group")[0] == 0
    object_path(store, "blobs", _blob_of(repo, "base")).unlink()
    assert _verify(store, capsys, "base", "--group")[0] == 1
    assert _verify(store, capsys, "top", "--group")[0] == 0


def test_shared_chunks_are_fetched_once(repo: Repository) -> None:
    index_a, _ = _encode(repo, base_specs())
    put_manifest(repo, "twice", [GroupRef("a", index_a), GroupRef("b", index_a)])
    report = verify(repo, "twice")
    assert report.ok and report.checked["indexes"] == 1
    alone = put_manifest(repo, "once", [GroupRef("a", index_a)])
    assert verify(repo, alone).checked["chunks"] == report.checked["chunks"]


def _encode(repo: Repository, specs: list[Any]) -> tuple[str, str | None]:
    enc = GroupEncoder()
    for spec in with_parents(specs):
        enc.add(spec)
    return enc.finish(repo)


def test_unknown_ref_is_one_line(store: LocalStore, env: str, capsys: Any) -> None:
    code, _, err = run_cli(["verify", "nosuch", "--store", str(store.root)], capsys)
    assert "no environment nosuch:latest" in assert_one_line_error(code, err)


# -- issue 16 item 7: blobs are hashed, hints checked, --quick says what it skips ---------------


def test_junk_appended_to_a_blob_is_found(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    blob = _blob_of(repo, "base")
    with object_path(store, "blobs", blob).open("ab") as f:
        f.write(b"junk")  # every frame still decodes: only the blob's own digest shows it
    code, lines = _verify(store, capsys, "py-env")
    assert code == 1
    assert lines[0].startswith(f"blobs/{short(blob)}: blob is corrupt: its content hashes to ")


def test_a_huge_blob_is_hashed_in_bounded_memory(repo: Repository, store: LocalStore) -> None:
    import tracemalloc

    standard_env(repo)
    blob = _blob_of(repo, "base")
    path = object_path(store, "blobs", blob)
    os.truncate(path, path.stat().st_size + (128 << 20))  # sparse: extended by 128 MiB of zeros
    tracemalloc.start()
    try:
        report = verify(repo, "py-env")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [p.key for p in report.problems] == [f"blobs/{blob}"]
    assert peak < 32 << 20, peak  # streamed, never read whole


def test_quick_says_what_it_skips(store: LocalStore, env: str, capsys: Any) -> None:
    code, lines = _verify(store, capsys, "py-env", "--quick")
    assert code == 0
    assert "not hashed" in lines[-1] and "blobs" in lines[-1] and "chunks" in lines[-1]
    code, out, _ = run_cli(["verify", "py-env", "--quick", "--json", "--store", str(store.root)],
                           capsys)
    assert code == 0 and json.loads(out)["skipped"]


def test_a_corrupt_hint_is_a_problem(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    groups = list(repo.get_manifest(env).groups)
    top = repo.get_index(_group_digest(repo, "top"))
    records = (HintRecord(2, top.header.chunk_count, 1),)  # one past the last chunk of 'top'
    bad = repo.put_object("hints", encode_hint(Hint(put_manifest(repo, None, groups), records)))
    put_manifest(repo, "badchunk", groups, hints=bad)
    code, lines = _verify(store, capsys, "badchunk")
    assert code == 1 and "1 of 1 hint records name no chunk" in lines[0]
    junk = repo.put_object("hints", compress_object(b"not a hint at all, but zstd"))
    put_manifest(repo, "junkhint", groups, hints=junk)
    code, lines = _verify(store, capsys, "junkhint")
    assert code == 1 and lines[0].startswith(f"hints/{short(junk)}: hint does not decode")
    for quick in ((), ("--quick",)):
        assert _verify(store, capsys, "junkhint", *quick)[0] == 1


def test_a_hint_bound_to_another_manifest_is_a_problem(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    # The mount discards such a hint (SPEC 9.2, 9.3): verify must not call it ok.
    groups = list(repo.get_manifest(env).groups)
    other = repo.put_object("hints", encode_hint(Hint(env, (HintRecord(0, 0, 1),))))
    put_manifest(repo, "otherhint", groups, hints=other)
    unhinted = put_manifest(repo, None, groups)
    code, lines = _verify(store, capsys, "otherhint")
    assert code == 1
    assert lines[0] == (
        f"hints/{short(other)}: hint is bound to manifest {short(env)}, not {short(unhinted)}"
    )


def _packed(repo: Repository, env: str, tag: str) -> Hint:
    """A hint of every chunk of the environment's first group, packed and tagged `tag`."""
    from weenvfs.core.hint_pack import pack_hint
    from weenvfs.core.node_hints import publish_hint

    indexes = [repo.get_index(g.index) for g in repo.get_manifest(env).groups]
    records = tuple(HintRecord(0, n, n) for n in range(indexes[0].header.chunk_count))
    packed, _ = pack_hint(repo, Hint(env, records), indexes, None)
    publish_hint(repo, packed, tag)
    assert packed.pack is not None
    return packed


def test_tagged_hints_and_their_packs_are_checked(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    """What mounts replay (tags `latest`, `seed`, ...), not only the manifest's own hint."""
    packed = _packed(repo, env, "seed")
    assert packed.pack is not None
    frames = sum(1 for n in packed.pack.lengths if n)
    report = verify(repo, "py-env")
    assert report.ok and report.checked["pack frames"] == frames
    with pytest.MonkeyPatch.context() as patch:  # pieces smaller than a frame: one at a time
        patch.setattr("weenvfs.tools.verify._HASH_PIECE", 1)
        report = verify(repo, "py-env")
    assert report.ok and report.checked["pack frames"] == frames
    flip_byte(object_path(store, "blobs", packed.pack.blob), 1)
    code, lines = _verify(store, capsys, "py-env")
    assert code == 1 and "frame(s) of its pack blob" in lines[0] and "record 0" in lines[0]
    code, lines = _verify(store, capsys, "py-env", "--quick")  # frames not read
    assert code == 0 and "hint pack frames not checked" in lines[-1]
    object_path(store, "blobs", packed.pack.blob).unlink()
    for quick in ((), ("--quick",)):
        code, lines = _verify(store, capsys, "py-env", *quick)
        assert code == 1 and f"its pack blob {short(packed.pack.blob)} is missing" in lines[0]


def test_a_tagged_hint_naming_no_chunk_is_a_problem(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    bad = repo.put_object("hints", encode_hint(Hint(env, (HintRecord(9, 0, 1),))))
    repo.set_tag("hints", env, "latest", bad)
    code, lines = _verify(store, capsys, "py-env")
    assert code == 1 and lines[0] == f"hints/{short(bad)}: 1 of 1 hint records name no chunk"


def test_a_hint_tag_that_cannot_be_read_is_a_problem_not_a_stop(
    repo: Repository, store: LocalStore, env: str, capsys: Any
) -> None:
    """A hint tag whose content is not a digest is reported with the rest of the check (it
    ended the check with one error line); the environment's other hints are still checked."""
    _packed(repo, env, "seed")
    key = tag_key("hints", env, "latest")
    (store.root / key).parent.mkdir(parents=True, exist_ok=True)
    (store.root / key).write_bytes(b"garbage\n")
    code, lines = _verify(store, capsys, "py-env")
    assert code == 1 and lines[0].startswith(f"{key}: hint tag 'latest' cannot be read: ")
    assert len(lines) == 2 and lines[1].startswith("FAILED: py-env: 1 problem")
