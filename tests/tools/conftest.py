"""Fixtures of the build-side tests: a store, and reading what a build published.

Owns: the `repo` fixture (a Repository over a LocalStore in tmp_path), `read_file` (a file's
bytes decoded from its chunks: ranged GETs, `decode_chunk`, `file_spans`), `index_snapshot`
(a composed tree in the form of `support.trees.snapshot`, so a built index compares with a
directory or with the OCI oracle through `compare_snapshots`), and `store_state` (tags and
indexes, to assert that a failed build published nothing).

Must not: build groups itself (tests call the real builder) or mock any component.
"""

from __future__ import annotations

import dataclasses
import hashlib
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import trees

from weenvfs.format.chunk import decode_chunk
from weenvfs.format.compose import ComposedTree
from weenvfs.format.index import GroupIndex, file_spans
from weenvfs.format.refs import object_key
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    """An empty writable LocalStore under tmp_path/store, closed after the test."""
    with LocalStore(tmp_path / "store", create=True) as s:
        yield s


@pytest.fixture
def repo(store: LocalStore) -> Repository:
    return Repository(store)


def read_file(repo: Repository, index: GroupIndex, ino: int) -> bytes:
    """The whole content of regular file `ino`, every chunk fetched and verified."""
    size = index.inode(ino).size
    out = []
    for span in file_spans(index, ino, 0, size):
        rec = index.chunk(span.chunk)
        if rec.zero:
            out.append(bytes(span.end - span.start))
            continue
        key = object_key("blobs", index.blob_digest(rec.blob))
        frame = repo.store.get_range(key, rec.offset, rec.clen)
        out.append(decode_chunk(frame, rec.digest, rec.ulen)[span.start : span.end])
    data = b"".join(out)
    assert len(data) == size
    return data


def index_snapshot(repo: Repository, indexes: list[GroupIndex]) -> dict[bytes, trees.Entry]:
    """The composed tree of `indexes` (lowest first) as `trees.snapshot` would see it."""
    tree = ComposedTree(indexes)
    walked = list(tree.walk())
    links: dict[tuple[int, int], list[bytes]] = {}
    for path, e in walked:
        rec = indexes[e.group].inode(e.inode)
        if not rec.is_dir and rec.nlink > 1:
            links.setdefault((e.group, e.inode), []).append(path or b".")
    out = {}
    for path, e in walked:
        index = indexes[e.group]
        rec = index.inode(e.inode)
        kind = trees.KIND_OF_MODE[stat.S_IFMT(rec.mode)]
        entry = trees.Entry(
            kind,
            stat.S_IMODE(rec.mode),
            rec.uid,
            rec.gid,
            rec.mtime_ns,
            xattrs=dict(index.xattrs(e.inode)),
            links=tuple(sorted(links[(e.group, e.inode)]))
            if rec.nlink > 1 and not rec.is_dir
            else None,
        )
        if kind == "reg":
            content = read_file(repo, index, e.inode)
            entry = dataclasses.replace(
                entry, size=rec.size, sha256=hashlib.sha256(content).hexdigest()
            )
        elif kind == "lnk":
            entry = dataclasses.replace(entry, target=index.readlink(e.inode))
        elif kind in ("chr", "blk"):
            entry = dataclasses.replace(entry, rdev=rec.rdev)
        out[path or b"."] = entry
    return out


def assert_same(expected: dict[bytes, trees.Entry], actual: dict[bytes, trees.Entry]) -> None:
    """Fail listing the differences between two snapshots."""
    diffs = trees.compare_snapshots(expected, actual)
    assert not diffs, f"{len(diffs)} difference(s):\n" + "\n".join(diffs[:40])


def store_state(store: LocalStore) -> dict[str, list[str]]:
    """Tags and indexes in the store (a failed build must leave none new)."""
    return {
        "tags": sorted(store.list("tags/")),
        "indexes": sorted(store.list("indexes/")),
    }


@pytest.fixture(name="assert_same")
def assert_same_fixture() -> Callable[[dict[bytes, trees.Entry], dict[bytes, trees.Entry]], None]:
    return assert_same


@pytest.fixture(name="store_state")
def store_state_fixture(store: LocalStore) -> Callable[[], dict[str, list[str]]]:
    return lambda: store_state(store)


@pytest.fixture(name="read_file")
def read_file_fixture(repo: Repository) -> Callable[[GroupIndex, int], bytes]:
    return lambda index, ino: read_file(repo, index, ino)


@pytest.fixture(name="index_snapshot")
def index_snapshot_fixture(
    repo: Repository,
) -> Callable[[list[GroupIndex]], dict[bytes, trees.Entry]]:
    return lambda indexes: index_snapshot(repo, indexes)
