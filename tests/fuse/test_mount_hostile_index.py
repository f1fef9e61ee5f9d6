"""A mount of an index whose directory graph is not a tree fails with one line (issue 16 item 8).

The same directory at /usr and /data passes every per-record check; the mount used to serve it
while inspect, export and verify refused it. `open_environment` now validates each index once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mounts import publish, refused_mount
from support import trees
from support.trees import dir, file  # noqa: A004

from weenvfs.format import constants as C
from weenvfs.format.chunk import compress_object
from weenvfs.format.manifest import GroupRef, Manifest, encode_manifest
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository

pytestmark = [pytest.mark.requires_fuse]


def _hardlink_usr_at_data(store_dir: Path, ref: str) -> str:
    """Publish `bad:t`: `ref`'s only group with /data's entry naming /usr's inode."""
    with LocalStore(store_dir) as store:
        repo = Repository(store)
        name, _, tag = ref.partition(":")
        (group,) = repo.get_manifest(repo.get_tag("envs", name, tag)).groups
        index = repo.get_index(group.index)
        usr = index.resolve(b"usr")
        assert usr is not None
        first = index.inode(0).data_first  # /data sorts first among the root's entries
        raw = bytearray(index.raw)
        at = index.header.dirent_offset + first * C.DIRENT.size + 8
        raw[at : at + 4] = usr.to_bytes(4, "little")
        patched = repo.put_object("indexes", compress_object(bytes(raw)))
        manifest = Manifest((GroupRef("g", patched),))
        repo.set_tag("envs", "bad", "t", repo.put_object("manifests", encode_manifest(manifest)))
    return "bad:t"


def test_a_directory_hardlink_is_not_mounted(tmp_path: Path) -> None:
    src = trees.make_tree(tmp_path / "src", dir("usr"), dir("data"), file("usr/f", b"1"))
    bad = _hardlink_usr_at_data(tmp_path / "store", publish(tmp_path / "store", [src]))
    line = refused_mount(bad, tmp_path / "store", tmp_path)
    assert "reachable by more than one path" in line
