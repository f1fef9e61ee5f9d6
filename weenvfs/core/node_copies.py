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

The node service forks a mount daemon for every mount, a hint replay per environment, and
each loads every index of its environment: 32 environments starting at once on the same
lower groups loaded the same three indexes 32 times over (about 10 ms of CPU each time,
hashing, decompressing and decoding 2 MB). `preload_env` keeps an environment's manifest and
indexes, loaded from their node copies exactly as above, in the memory of the process that
calls it (the node service does, after each request: fuse/mountd.py); the processes it
forks afterwards find them there (copy-on-write) and load nothing. Only what was verified
and checked is kept, by digest (immutable), bounded by PRELOAD_BYTES (least recently
preloaded first out); a process that never preloads keeps nothing.

`weenv mount NAME:TAG` names no digest, so the node service had nothing to preload for it
and every such mount loaded its indexes from their node copies (hash, decompress, decode:
about 25 ms at 100k files). `note_resolved` keeps, per store argument and reference, the
digest its last mount or resolution on this node resolved it to (`<cache>/refs/`), and
`last_resolved` tells the service what to preload and a warm `weenv run` what to start from
while the store confirms the tag (runtime/tag_guess.py, with `node_manifest` and
`resolve_digest`). It is a guess, never a resolution: a moved tag only means a preload nobody
uses, or a run that starts over before its command (every start resolves its tag in the
store).

Must not: fetch anything but tags, indexes and manifests, or keep what it did not verify
(never a tag as a resolution: tags move; HINTED is not a tag's target, only that one existed;
a noted resolution only steers preloading and guesses the store confirms). `preload_env`
never reaches the store: it takes node copies only.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from weenvfs.errors import RefNotFound
from weenvfs.format.digest import check_digest, digest_hex, fork_server
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import Manifest, decode_manifest, encode_manifest
from weenvfs.format.validate import check_tree
from weenvfs.store.repository import Repository

from .node_files import has_verdict, set_verdict, touch, write_atomically

log = logging.getLogger(__name__)
T = TypeVar("T")

INDEX_DIR = "indexes"
MANIFEST_DIR = "manifests"
REF_DIR = "refs"  # the last digest each (store argument, reference) resolved to: see the module
# The verdict of `check_tree` on a node copy. Renamed whenever what `check_tree` refuses
# changes, so that copies checked by an older validator are checked again.
TREE_VERDICT = "user.weenv.tree-checked-1"
HINTED = "user.weenv.had-hint"  # on a manifest's node copy: its environment had a hint once
PRELOAD_BYTES = 128 << 20  # decoded bytes of the manifests and indexes `preload_env` keeps
MANIFEST_SIZE = 4096  # what a kept manifest counts as (a few hundred bytes per group)

# (kind, cache folder, digest) -> (the verified object, its decoded size); see the module.
_preloaded: OrderedDict[tuple[str, str, str], tuple[Manifest | GroupIndex, int]] = OrderedDict()


def load_index(repo: Repository, digest: str, cache_dir: Path | None = None) -> GroupIndex:
    """Index `digest`, verified and checked to be a tree: from the node's copy in `cache_dir`
    when it is there and intact, else from `repo` (and then copied there)."""
    if cache_dir is None:
        return _checked(repo.get_object("indexes", digest))
    path = cache_dir / INDEX_DIR / digest
    kept = _preloaded.get(("index", str(cache_dir), digest))
    index = kept[0] if kept is not None else _index_copy(path, digest)
    if index is not None:
        assert isinstance(index, GroupIndex)
        touch(path)
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
    return _store_checked(repo, lambda: repo.resolve_env(
        ref, lambda digest: load_manifest(repo, digest, cache_dir)))


def load_manifest(repo: Repository, digest: str, cache_dir: Path | None = None) -> Manifest:
    """Manifest `digest`, verified: from the node's copy in `cache_dir` when it is there and
    intact, else from `repo` (and then copied there)."""
    if cache_dir is None:
        return repo.get_manifest(digest)
    path = cache_dir / MANIFEST_DIR / digest
    kept = _preloaded.get(("manifest", str(cache_dir), digest))
    manifest = kept[0] if kept is not None else _manifest_copy(path, digest)
    if manifest is not None:
        assert isinstance(manifest, Manifest)
        if kept is not None and not path.exists():
            # Kept in memory, its node copy evicted or cleared since: HINTED is marked on
            # that file, and `remember_hinted` cannot mark a file that is not there.
            _restore_copy(path, digest, manifest)
        touch(path)
        return manifest
    data = repo.get_object("manifests", digest)
    manifest = decode_manifest(data)
    try:
        write_atomically(path, data)
    except OSError as error:  # a full or read-only cache costs a round trip, nothing else
        log.info("cannot keep manifest %s in %s: %s", digest[:12], path.parent, error)
    return manifest


def resolve_digest(repo: Repository, ref: str) -> str:
    """The manifest digest `ref` names in the store (its tag's one round trip), with
    `resolve_env`'s errors: RefNotFound only once the store itself was found sound."""
    return _store_checked(repo, lambda: repo.env_digest(ref))


def _store_checked(repo: Repository, resolve: Callable[[], T]) -> T:
    """`resolve()`; a RefNotFound is raised only once `repo`'s store answered its check (an
    unreachable or unreadable store raises its own error instead)."""
    try:
        return resolve()
    except RefNotFound:
        repo.store.check()
        raise


def node_manifest(cache_dir: Path, digest: str) -> Manifest | None:
    """Manifest `digest` from this process's memory (`preload_env`) or its intact node copy;
    None if neither has it (never the store)."""
    kept = _preloaded.get(("manifest", str(cache_dir), digest))
    if kept is not None:
        assert isinstance(kept[0], Manifest)
        return kept[0]
    return _manifest_copy(cache_dir / MANIFEST_DIR / digest, digest)


def preload_env(cache_dir: Path, digest: str) -> int:
    """Keep environment `digest`'s manifest and group indexes in this process's memory, from
    their node copies in `cache_dir` (verified and checked as `load_index` does; never from
    the store), for the processes it forks later (see the module). An object whose node copy
    is missing or damaged is left out (its user loads it as before), and a `digest` that is
    none is no environment. Returns how many objects it kept now."""
    try:
        check_digest(digest)
    except FormatError:
        return 0
    fork_server()  # the caller forks: hashing here must not make blake3's thread pool
    folder = str(cache_dir)
    manifest, kept_now = _keep(("manifest", folder, digest),
                               lambda: _manifest_copy(cache_dir / MANIFEST_DIR / digest, digest))
    if not isinstance(manifest, Manifest):
        return 0
    for index in dict.fromkeys(group.index for group in manifest.groups):
        kept_now += _keep(("index", folder, index),
                          lambda index=index: _index_copy(cache_dir / INDEX_DIR / index, index))[1]
    return kept_now


def forget_preloaded() -> None:
    """Drop everything `preload_env` kept (tests; a process that no longer forks)."""
    _preloaded.clear()


def _keep(key: tuple[str, str, str], load: Callable[[], Manifest | GroupIndex | None]
          ) -> tuple[Manifest | GroupIndex | None, int]:
    """The object kept for `key` (now the most recent), else `load()`'s, kept within
    PRELOAD_BYTES (least recent out first); and 1 if it was kept now, else 0."""
    kept = _preloaded.get(key)
    if kept is not None:
        _preloaded.move_to_end(key)
        return kept[0], 0
    made = load()
    if made is None:
        return None, 0
    size = len(made.raw) if isinstance(made, GroupIndex) else MANIFEST_SIZE
    if size > PRELOAD_BYTES:
        return made, 0
    _preloaded[key] = (made, size)
    total = sum(size for _, size in _preloaded.values())
    while total > PRELOAD_BYTES:
        total -= _preloaded.popitem(last=False)[1][1]
    return made, 1


def note_resolved(cache_dir: Path, store: str, ref: str, digest: str) -> None:
    """Note that `ref` in the store given as `store` resolved to environment `digest` (see
    the module; written only when it changed, best effort)."""
    if ref == digest or last_resolved(cache_dir, store, ref) == digest:
        return
    try:
        write_atomically(_ref_path(cache_dir, store, ref), f"{digest}\n".encode())
    except OSError as error:  # costs a preload, nothing else
        log.info("cannot note what %s resolved to in %s: %s", ref, cache_dir, error)


def last_resolved(cache_dir: Path, store: str, ref: str) -> str | None:
    """The digest `note_resolved` noted last for `ref` in `store`, if any (a guess: see the
    module)."""
    try:
        digest = _ref_path(cache_dir, store, ref).read_text().strip()
        check_digest(digest)
    except (OSError, UnicodeDecodeError, FormatError):
        return None
    return digest


def _ref_path(cache_dir: Path, store: str, ref: str) -> Path:
    # (A store folder named in bytes that are not UTF-8 arrives as surrogate escapes.)
    key = hashlib.sha256(f"{store}\n{ref}".encode(errors="surrogateescape")).hexdigest()
    return cache_dir / REF_DIR / key


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


def _index_copy(path: Path, digest: str) -> GroupIndex | None:
    """Index `digest` from its node copy at `path` when that is intact (checked to be a tree
    once: its verdict is kept on the file), else None."""
    data = _node_copy(path, digest)
    if data is None:
        return None
    if has_verdict(path, TREE_VERDICT):
        return GroupIndex.from_object(data)
    index = _checked(data)
    set_verdict(path, TREE_VERDICT)
    return index


def _restore_copy(path: Path, digest: str, manifest: Manifest) -> None:
    """Write the node copy of a verified `manifest` again (its canonical bytes, which hash
    to `digest`: decoding refuses any other); best effort, as every node copy."""
    data = encode_manifest(manifest)
    if digest_hex(data) != digest:
        return
    try:
        write_atomically(path, data)
    except OSError as error:
        log.info("cannot keep manifest %s in %s: %s", digest[:12], path.parent, error)


def _manifest_copy(path: Path, digest: str) -> Manifest | None:
    """Manifest `digest` from its node copy at `path` when that is intact, else None."""
    data = _node_copy(path, digest, "manifest")
    return None if data is None else decode_manifest(data)


def _checked(data: bytes) -> GroupIndex:
    index = GroupIndex.from_object(data)
    check_tree(index)
    return index
