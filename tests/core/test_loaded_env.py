"""`open_environment` validates every index it loads for a mount (issue 16 item 8).

A directory hardlink (the same directory at /usr and /data) passes every per-record check, so
without the tree validator the mount served it while inspect, export and verify refused it.
"""

from __future__ import annotations

import stat

import pytest

from weenvfs.core.loaded_env import open_environment
from weenvfs.format import constants as C
from weenvfs.format.chunk import compress_object
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import Node, encode_index
from weenvfs.format.manifest import GroupRef, Manifest, encode_manifest
from weenvfs.store.repository import Repository

DIR = stat.S_IFDIR | 0o755


def _publish(repo: Repository, name: str, raw: bytes) -> None:
    index = repo.put_object("indexes", compress_object(raw))
    manifest = repo.put_object("manifests", encode_manifest(Manifest((GroupRef("g", index),))))
    repo.set_tag("envs", name, "latest", manifest)


def _tree() -> bytes:
    root = Node(DIR)
    root.children[b"data"] = Node(DIR)
    root.children[b"usr"] = Node(DIR)
    root.children[b"usr"].children[b"bin"] = Node(DIR)
    return encode_index(root, 4096)


def _hardlinked(raw: bytes) -> bytes:
    """`raw` with /data's entry naming /usr's inode."""
    index = GroupIndex(raw)
    usr = index.resolve(b"usr")
    assert usr is not None
    first = index.inode(0).data_first  # /data sorts first among the root's entries
    out = bytearray(raw)
    at = index.header.dirent_offset + first * C.DIRENT.size + 8
    out[at : at + 4] = usr.to_bytes(4, "little")
    return bytes(out)


def test_a_directory_hardlink_is_refused_at_load(repo: Repository) -> None:
    _publish(repo, "good", _tree())
    _publish(repo, "bad", _hardlinked(_tree()))
    assert open_environment(repo.store, "good").digest
    for layer in (None, 0):
        with pytest.raises(FormatError, match="reachable by more than one path"):
            open_environment(repo.store, "bad", layer)


def test_an_index_named_by_several_groups_is_loaded_once(repo: Repository) -> None:
    """A manifest can name one index up to MAX_GROUPS times; the mount holds it once."""
    index = repo.put_object("indexes", compress_object(_tree()))
    groups = tuple(GroupRef(f"g{n}", index) for n in range(C.MAX_GROUPS))
    repo.set_tag("envs", "many", "latest",
                 repo.put_object("manifests", encode_manifest(Manifest(groups))))
    tree = open_environment(repo.store, "many").tree
    assert len(tree.groups) == C.MAX_GROUPS
    assert all(group is tree.groups[0] for group in tree.groups)
