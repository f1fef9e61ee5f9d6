"""Hostile indexes through every read-side tool: each is refused with one line, never served.

A chunk frame at offset 2**64-1 (issue 16 item 6) and a directory hardlink, the same directory
at /usr and /data (item 8): `inspect`, `export` and `verify` all refuse them, export before it
writes anything, from the one validator in format/ (and `GroupIndex.chunk`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fixtures import assert_one_line_error, publish_group, put_manifest, run_cli
from support.trees import dir, file  # noqa: A004

from weenvfs.format import constants as C
from weenvfs.format.chunk import compress_object
from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import GroupRef
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository


def _publish_patched(repo: Repository, name: str, patch: Any) -> str:
    """Publish a small group, patch its raw index with `patch(index, raw)`; tag both as `name`."""
    specs = [dir("."), dir("usr"), dir("data"), file("usr/x", b"x" * 5000), file("data/y", b"y")]
    digest = publish_group(repo, name, specs)
    index = repo.get_index(digest)
    raw = bytearray(index.raw)
    patch(index, raw)
    patched = repo.put_object("indexes", compress_object(bytes(raw)))
    repo.set_tag("groups", name, "latest", patched)
    put_manifest(repo, name, [GroupRef("g", patched)])
    return patched


def directory_hardlink(index: GroupIndex, raw: bytearray) -> None:
    """Make /data's entry name /usr's inode: the same directory at two paths."""
    usr = index.resolve(b"usr")
    n = next(i for i, (name, _) in enumerate(index.entries(0)) if name == b"data")
    first = index.inode(0).data_first
    at = index.header.dirent_offset + (first + n) * C.DIRENT.size + 8
    raw[at : at + 4] = int(usr).to_bytes(4, "little")  # type: ignore[arg-type]


def huge_offset(index: GroupIndex, raw: bytearray) -> None:
    """Move /usr/x's chunk frame to offset 2**64-1."""
    ino = index.resolve(b"usr/x")
    assert ino is not None
    (n,) = index.file_chunks(ino)
    at = index.header.chunk_offset + n * C.CHUNK.size + 40  # digest, blob, flags, then offset
    raw[at : at + 8] = (2**64 - 1).to_bytes(8, "little")


def _cli(store: LocalStore, capsys: Any, *argv: str) -> tuple[int, str, str]:
    return run_cli([*argv, "--store", str(store.root)], capsys)


@pytest.mark.parametrize(
    ("patch", "message"),
    [(directory_hardlink, "reachable by more than one path"), (huge_offset, "outside 0..2**63")],
)
def test_export_refuses_in_one_line(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any, patch: Any, message: str
) -> None:
    _publish_patched(repo, "bad", patch)
    dest = tmp_path / "out"
    code, _, err = _cli(store, capsys, "export", "bad", str(dest))
    line = assert_one_line_error(code, err)
    assert message in line and "internal error" not in line


def test_export_refuses_a_directory_hardlink_before_writing(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any
) -> None:
    _publish_patched(repo, "bad", directory_hardlink)
    dest = tmp_path / "out"
    code, _, err = _cli(store, capsys, "export", "bad", str(dest))
    assert_one_line_error(code, err)
    assert not dest.exists() or not any(dest.iterdir())
    code, _, err = _cli(store, capsys, "export", "bad", str(dest), "--group")
    assert "reachable by more than one path" in assert_one_line_error(code, err)


def test_inspect_refuses_a_directory_hardlink(
    repo: Repository, store: LocalStore, capsys: Any
) -> None:
    _publish_patched(repo, "bad", directory_hardlink)
    for argv in (["inspect", "bad"], ["inspect", "bad", "--group"]):
        code, _, err = _cli(store, capsys, *argv)
        assert "reachable by more than one path" in assert_one_line_error(code, err)


@pytest.mark.parametrize(
    ("patch", "message"),
    [(directory_hardlink, "reachable by more than one path"), (huge_offset, "outside 0..2**63")],
)
def test_verify_reports_it(
    repo: Repository, store: LocalStore, capsys: Any, patch: Any, message: str
) -> None:
    patched = _publish_patched(repo, "bad", patch)
    code, out, err = _cli(store, capsys, "verify", "bad")
    assert code == 1 and err == ""
    assert any(patched[:12] in line and message in line for line in out.splitlines()), out
