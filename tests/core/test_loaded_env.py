"""`open_environment` validates every index it loads for a mount (issue 16 item 8).

A directory hardlink (the same directory at /usr and /data) passes every per-record check, so
without the tree validator the mount served it while inspect, export and verify refused it.
"""

from __future__ import annotations

import stat

import pytest

from weenvfs.core.loaded_env import load_all, open_environment
from weenvfs.errors import ObjectMissing
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


def test_groups_load_in_parallel_and_the_first_bad_one_in_order_fails(
        repo: Repository) -> None:
    """Several distinct indexes load at once (load_all); a bad one fails the mount with its
    own error, the lowest bad group's when several are bad, as a loop in order would."""
    good = repo.put_object("indexes", compress_object(_tree()))
    bad = repo.put_object("indexes", compress_object(_hardlinked(_tree())))
    other = repo.put_object("indexes", compress_object(encode_index(Node(DIR), 4096)))
    groups = (GroupRef("a", good), GroupRef("b", other), GroupRef("c", good))
    repo.set_tag("envs", "three", "latest",
                 repo.put_object("manifests", encode_manifest(Manifest(groups))))
    tree = open_environment(repo.store, "three").tree
    assert len(tree.groups) == 3
    assert tree.groups[0] is tree.groups[2] and tree.groups[1] is not tree.groups[0]
    missing = "0" * 64
    groups = (GroupRef("a", good), GroupRef("b", missing), GroupRef("c", bad))
    repo.set_tag("envs", "broken", "latest",
                 repo.put_object("manifests", encode_manifest(Manifest(groups))))
    with pytest.raises(ObjectMissing):  # group b's error, not c's
        open_environment(repo.store, "broken")


def test_load_all_keeps_the_order_of_its_keys() -> None:
    seen: list[int] = []
    result = load_all([3, 1, 2], lambda key: seen.append(key) or key * 10)
    assert list(result.items()) == [(3, 30), (1, 10), (2, 20)] and sorted(seen) == [1, 2, 3]
