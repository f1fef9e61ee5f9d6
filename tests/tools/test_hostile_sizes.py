"""Oversized objects in a directory store, through every read-side command (issue 16 item 5).

A 5 GB manifest or tag file (sparse: `truncate` makes it cheap), an index that decompresses to
2 GiB (a 65 KB zstd bomb, beyond MAX_INDEX_SIZE), and a chunk record with clen 0xFFFFFFFF
against a blob that really is 5 GiB: `inspect`, `export` and `verify` used to read the object
whole or allocate the frame (9-10 GB resident) before any check. Each now refuses it in one
line with a non-zero exit, reading nothing of it, and each run stays within a few hundred MB
(`ru_maxrss` of the command's process: a resource bound, not a timing assertion).
"""

from __future__ import annotations

import os
from pathlib import Path

import zstandard
from fixtures import object_path, publish_env, put_manifest
from support.measured import MEMORY_BOUND, Measured, run_weenv_measured
from support.trees import file

from weenvfs.format import constants as C
from weenvfs.format.chunk import compress_object
from weenvfs.format.manifest import GroupRef
from weenvfs.format.refs import tag_key
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository

GIB = 1 << 30


def _run(store: LocalStore, *argv: str) -> Measured:
    done = run_weenv_measured(*argv, "--store", str(store.root))
    assert done.maxrss < MEMORY_BOUND, f"weenv {argv[0]}: {done.maxrss >> 20} MiB resident"
    return done


def _refused(done: Measured, *words: str) -> str:
    """The one error line of a refused command (stderr, non-zero exit), holding `words`."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0].startswith("weenv: error:") and "internal error" not in lines[0]
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def _verify_problem(done: Measured, key: str, *words: str) -> None:
    """`weenv verify` lists the problem on stdout under the object's key and exits 1."""
    assert done.returncode == 1 and done.stderr == "", done.stderr
    found = [line for line in done.stdout.splitlines() if key[:20] in line]
    assert any(all(word in line for word in words) for line in found), done.stdout


def _read_commands(ref: str, dest: Path) -> list[list[str]]:
    return [["inspect", ref], ["export", ref, str(dest)]]


def _env(repo: Repository) -> str:
    return publish_env(repo, "e", [("g", [file("a", b"a" * 1000), file("big", b"b" * 60_000)])])


def test_a_5gb_manifest_is_refused_unread(
    repo: Repository, store: LocalStore, tmp_path: Path
) -> None:
    digest = _env(repo)
    os.truncate(object_path(store, "manifests", digest), 5 * GIB)
    for argv in _read_commands("e", tmp_path / "out"):
        _refused(_run(store, *argv), "manifests/", "5368709120 bytes", f"{C.MAX_MANIFEST_SIZE}")
    assert not (tmp_path / "out").exists()
    for ref in ("e", digest):
        done = _run(store, "verify", ref)
        _verify_problem(done, f"manifests/{digest}", "5368709120 bytes", "not read")


def test_a_5gb_tag_is_refused_unread(repo: Repository, store: LocalStore, tmp_path: Path) -> None:
    _env(repo)
    os.truncate(store.root / tag_key("envs", "e", "latest"), 5 * GIB)
    for argv in [*_read_commands("e", tmp_path / "out"), ["verify", "e"]]:
        _refused(_run(store, *argv), "tags/envs/e/latest", f"limit is {C.TAG_SIZE}")


def _bomb(size: int) -> bytes:
    """One zstd frame of `size` zero bytes, with its content size, compressed streaming."""
    out = zstandard.ZstdCompressor(level=3).compressobj(size=size)
    piece = bytes(1 << 20)
    parts = [out.compress(piece) for _ in range(size // len(piece))]
    return b"".join([*parts, out.flush()])


def test_an_index_bomb_is_refused_before_decompressing(
    repo: Repository, store: LocalStore, tmp_path: Path
) -> None:
    bomb = _bomb(2 * GIB)  # the issue's: a 72 KB index that decompressed to 2 GB
    assert len(bomb) < 128 << 10  # a small object ...
    index = repo.put_object("indexes", bomb)  # ... stored under its true digest
    put_manifest(repo, "e", [GroupRef("g", index)])
    message = f"content size {2 * GIB} exceeds the limit {C.MAX_INDEX_SIZE}"
    for argv in [*_read_commands("e", tmp_path / "out"), ["inspect", index, "--group"]]:
        _refused(_run(store, *argv), message)
    _verify_problem(_run(store, "verify", "e"), f"indexes/{index}", message)


def _huge_frame(repo: Repository, store: LocalStore) -> tuple[str, str]:
    """Env `e` whose file /big has one chunk record with offset 0 and clen 0xFFFFFFFF, in a
    blob file that really is 5 GiB (sparse); (index digest, blob digest)."""
    (group,) = repo.get_manifest(repo.get_tag("envs", "e", "latest")).groups
    index = repo.get_index(group.index)
    ino = index.resolve(b"big")
    assert ino is not None
    (n,) = index.file_chunks(ino)
    raw = bytearray(index.raw)
    at = index.header.chunk_offset + n * C.CHUNK.size + 40  # digest, blob, flags: offset, clen
    raw[at : at + 12] = (0).to_bytes(8, "little") + C.MAX_U32.to_bytes(4, "little")
    blob = index.blob_digest(index.chunk(n).blob)
    os.truncate(object_path(store, "blobs", blob), 5 * GIB)
    patched = repo.put_object("indexes", compress_object(bytes(raw)))
    put_manifest(repo, "e", [GroupRef("g", patched)])
    return patched, blob


def test_a_chunk_record_with_a_4gib_frame_is_refused(
    repo: Repository, store: LocalStore, tmp_path: Path
) -> None:
    _env(repo)
    index, _ = _huge_frame(repo, store)
    dest = tmp_path / "out"
    _refused(_run(store, "export", "e", str(dest)), "clen", f"{C.MAX_U32}")
    done = _run(store, "verify", "e", "--quick")
    _verify_problem(done, f"indexes/{index}", "clen", f"{C.MAX_U32}")


def test_a_manifest_at_its_limit_is_still_read(repo: Repository, store: LocalStore) -> None:
    """The bound refuses only what is over it: a manifest padded to exactly its limit gets
    the digest check's refusal, not the size's."""
    path = object_path(store, "manifests", _env(repo))
    data = path.read_bytes()
    path.write_bytes(data + b" " * (C.MAX_MANIFEST_SIZE - len(data)))
    line = _refused(_run(store, "inspect", "e"), "corrupt")
    assert "limit" not in line
