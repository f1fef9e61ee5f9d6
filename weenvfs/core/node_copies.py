"""The node's copies of group indexes (fetched once, checked to be a tree once) and of
environment manifests (fetched once).

A mount needs every index of its environment, verified against its digest and checked to be
a tree (`format.validate.check_tree`: a shared directory or a cycle passes every per-record
check). The tree check costs time that grows with the files (100k files: about 25 ms, at
every mount), and fetching costs a store round trip, yet an index is immutable: its digest
names it. So a mount keeps the stored object as `<cache>/indexes/<digest>`, still verifies
its digest at every use (a millisecond or two for 4 MB), and records the tree check's verdict
on the file (node_files.py): the next mount of an index only hashes and decompresses it.

A manifest is immutable too, and each start of an environment read it from the store up to
three times (the resolution, the mount daemon, the hint replay: a round trip each, two of them
on a cold start's critical path, one on every warm `weenv run`). `load_manifest` keeps it as
`<cache>/manifests/<digest>`, verified against its digest at every use. `resolve_env` is how
every start resolves a reference with it (the tag always from the store), and checks the store
only when the reference does not resolve, so that a missing or unreadable store says so: a
round trip up front cost every start one more.

Whether an environment has a hint decides whether its run records one (runtime/recording.py):
a store round trip on every start, warm ones too. Hints are published, merged and replaced,
never taken back by a run, so once a start saw one, `remember_hinted` marks the manifest's
node copy (HINTED) and `known_hinted` answers later starts without the store. (A hint removed
by hand is then not recorded again on this node by default; `--record-hint` still does.)

Must not: fetch anything but tags, indexes and manifests, or keep what it did not verify
(never a tag: tags move; HINTED is not a tag's target, only that one existed).
"""

from __future__ import annotations

import logging
from pathlib import Path

from weenvfs.errors import RefNotFound
from weenvfs.format.digest import digest_hex
from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import Manifest, decode_manifest
from weenvfs.format.validate import check_tree
from weenvfs.store.repository import Repository

from .node_files import has_verdict, set_verdict, touch, write_atomically

log = logging.getLogger(__name__)

INDEX_DIR = "indexes"
MANIFEST_DIR = "manifests"
# The verdict of `check_tree` on a node copy. Renamed whenever what `check_tree` refuses
# changes, so that copies checked by an older validator are checked again.
TREE_VERDICT = "user.weenv.tree-checked-1"
HINTED = "user.weenv.had-hint"  # on a manifest's node copy: its environment had a hint once


def load_index(repo: Repository, digest: str, cache_dir: Path | None = None) -> GroupIndex:
    """Index `digest`, verified and checked to be a tree: from the node's copy in `cache_dir`
    when it is there and intact, else from `repo` (and then copied there)."""
    if cache_dir is None:
        return _checked(repo.get_object("indexes", digest))
    path = cache_dir / INDEX_DIR / digest
    data = _node_copy(path, digest)
    if data is not None:
        touch(path)
        if has_verdict(path, TREE_VERDICT):
            return GroupIndex.from_object(data)
        index = _checked(data)
        set_verdict(path, TREE_VERDICT)
        return index
    data = repo.get_object("indexes", digest)
    index = _checked(data)
    try:
        write_atomically(path, data)
        set_verdict(path, TREE_VERDICT)
    except OSError as error:  # a full or read-only cache costs speed, never the mount
        log.info("cannot keep index %s in %s: %s", digest[:12], path.parent, error)
    return index


def resolve_env(repo: Repository, ref: str, cache_dir: Path | None) -> tuple[str, Manifest]:
    """(digest, manifest) of environment `ref` (`NAME[:TAG]` or a manifest digest), the
    manifest through the node's copy in `cache_dir`. RefNotFound only once `store.check()`
    found the store itself sound (else its error, in one line)."""
    try:
        return repo.resolve_env(ref, lambda digest: load_manifest(repo, digest, cache_dir))
    except RefNotFound:
        repo.store.check()
        raise


def load_manifest(repo: Repository, digest: str, cache_dir: Path | None = None) -> Manifest:
    """Manifest `digest`, verified: from the node's copy in `cache_dir` when it is there and
    intact, else from `repo` (and then copied there)."""
    if cache_dir is None:
        return repo.get_manifest(digest)
    path = cache_dir / MANIFEST_DIR / digest
    data = _node_copy(path, digest, "manifest")
    if data is not None:
        touch(path)
        return decode_manifest(data)
    data = repo.get_object("manifests", digest)
    manifest = decode_manifest(data)
    try:
        write_atomically(path, data)
    except OSError as error:  # a full or read-only cache costs a round trip, nothing else
        log.info("cannot keep manifest %s in %s: %s", digest[:12], path.parent, error)
    return manifest


def known_hinted(cache_dir: Path, digest: str) -> bool:
    """Whether a start on this node saw a hint of environment `digest` (see the module)."""
    return has_verdict(cache_dir / MANIFEST_DIR / digest, HINTED)


def remember_hinted(cache_dir: Path, digest: str) -> None:
    """Mark environment `digest` as having a hint, on its manifest's node copy (if any)."""
    set_verdict(cache_dir / MANIFEST_DIR / digest, HINTED)


def _node_copy(path: Path, digest: str, what: str = "index") -> bytes | None:
    """The node copy's bytes if it exists and still hashes to `digest`."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if digest_hex(data) == digest:
        return data
    log.warning("the node's copy of %s %s is damaged: fetching it again", what, digest[:12])
    return None


def _checked(data: bytes) -> GroupIndex:
    index = GroupIndex.from_object(data)
    check_tree(index)
    return index
