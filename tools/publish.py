"""Publishing in the spec's order: blobs, then the index, then the tag; manifests likewise.

Owns: uploading a build's blob files (skipping blobs the store has), checking that every
older blob the index reuses is still stored, storing the index, and only then moving the
group tag; `compose_env`, which resolves group references, stores a manifest and tags it.
A failure anywhere before the tag leaves only unreferenced objects (gc removes them), so a
reader never sees a tag that points at something missing.

Must not: build trees or chunks, or delete anything.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weenvfs.core.kernel_image import stack_image, stack_key
from weenvfs.errors import StoreError, UsageError
from weenvfs.format.chunk import compress_object
from weenvfs.format.digest import short
from weenvfs.format.erofs_group import group_image
from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import (
    GroupRef,
    Manifest,
    RuntimeConfig,
    check_provenance,
    encode_manifest,
)
from weenvfs.format.refs import check_name, check_tag, parse_name_tag
from weenvfs.store.repository import Repository

from .chunker import BlobFile
from .progress import Progress

log = logging.getLogger(__name__)

# Stack images this process derived (stack_key -> image; a stack is named by its indexes, so
# an image never goes stale), the most recent few: each can be tens of MB.
_DERIVED: OrderedDict[str, bytes] = OrderedDict()
_DERIVED_MAX = 4


@dataclass(frozen=True)
class Published:
    """What `publish_group` stored."""

    index_digest: str
    blobs_uploaded: int
    bytes_uploaded: int


def publish_group(
    repo: Repository,
    name: str,
    tag: str,
    blobs: Sequence[BlobFile],
    index_object: bytes,
    progress: Progress | None = None,
) -> Published:
    """Store `blobs`, then the index object, then point the group tag `name:tag` at it."""
    check_name(name, "group name")
    check_tag(tag)
    stored = store_group(repo, blobs, index_object, progress)
    tag_group(repo, name, tag, stored)
    return stored


def tag_group(repo: Repository, name: str, tag: str, stored: Published) -> None:
    """Point the group tag `name:tag` at the index `store_group` stored (the last write)."""
    repo.set_tag("groups", name, tag, stored.index_digest)
    log.info(
        "published group %s:%s -> %s (%d blobs uploaded)",
        name,
        tag,
        short(stored.index_digest),
        stored.blobs_uploaded,
    )


def store_group(
    repo: Repository,
    blobs: Sequence[BlobFile],
    index_object: bytes,
    progress: Progress | None = None,
) -> Published:
    """Store `blobs`, then the index object (write ordering), without tagging anything."""
    progress = progress or Progress.quiet()
    uploaded = uploaded_bytes = 0
    if blobs:
        progress.begin("uploading", sum(b.size for b in blobs))
        for blob in blobs:
            if repo.put_object_file("blobs", blob.digest, blob.path):
                uploaded += 1
                uploaded_bytes += blob.size
            progress.update(blob.size)
        progress.end()
    _check_reused_blobs(repo, index_object, {b.digest for b in blobs})
    return Published(repo.put_object("indexes", index_object), uploaded, uploaded_bytes)


def _check_reused_blobs(repo: Repository, index_object: bytes, new: set[str]) -> None:
    """Refuse to store an index whose reused blobs are gone (e.g. collected meanwhile)."""
    for digest in GroupIndex.from_object(index_object).blob_digests():
        if digest not in new and not repo.has_object("blobs", digest):
            raise StoreError(
                f"cannot publish: reused blob {short(digest)} is missing from {repo.store.url}"
            )


def group_ref(repo: Repository, ref: str) -> GroupRef:
    """The GroupRef of a group given as NAME[:TAG] or an index digest (which must exist)."""
    digest, _ = repo.resolve_group(ref)
    if digest == ref.removeprefix("blake3:").removeprefix("@"):
        name = f"sha-{short(digest)}"
    else:
        name = parse_name_tag(ref, "group")[0]
    return GroupRef(name, digest)


def publish_images(repo: Repository, refs: Sequence[GroupRef]) -> list[GroupRef]:
    """`refs` (lowest first) each with its EROFS image (SPEC.md 15.9) stored as
    `erofs/<digest>` (zstd) and named: a node fetches it instead of deriving it (seconds of
    Python for a large group, at the first mount of each stack on a node). The lowest
    group's depends on its index only; one above depends on the groups below it too, so it is
    derived as a node derives it (core/kernel_image.stack_image)."""
    indexes = [repo.get_index(ref.index) for ref in refs]
    out = []
    for position, ref in enumerate(refs):
        if ref.erofs is not None:
            out.append(ref)
            continue
        image = group_image(indexes[0]) if position == 0 else _stack_image(refs, indexes,
                                                                          position)
        digest = repo.put_object("erofs", compress_object(image))
        log.info("published the EROFS image of group %s (%d KiB) -> %s", ref.name,
                 len(image) >> 10, short(digest))
        out.append(GroupRef(ref.name, ref.index, digest))
    return out


def _stack_image(refs: Sequence[GroupRef], indexes: Sequence[GroupIndex], position: int) -> bytes:
    """The image of group `position` over the groups below it, derived once per process and
    stack: a release composing many environments over the same groups (one process) derives
    each shared stack's image once."""
    key = stack_key([ref.index for ref in refs[: position + 1]])
    image = _DERIVED.pop(key, None)
    if image is None:
        image = stack_image(indexes, position)
    _DERIVED[key] = image
    while len(_DERIVED) > _DERIVED_MAX:
        _DERIVED.popitem(last=False)
    return image


def compose_env(
    repo: Repository,
    name: str,
    tag: str,
    groups: Sequence[str],
    config: RuntimeConfig | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> str:
    """Store a manifest of `groups` (lowest first) and tag it `name:tag`; return its digest.

    Every group must resolve, and `provenance` must be canonical JSON (no floats: SPEC.md
    8.3), before anything is written.
    """
    check_name(name, "environment name")
    check_tag(tag)
    check_provenance(provenance or {})
    if not groups:
        raise UsageError("an environment needs at least one group")
    refs = publish_images(repo, [group_ref(repo, g) for g in groups])
    manifest = Manifest(tuple(refs), config or RuntimeConfig(), None, dict(provenance or {}))
    digest = repo.put_object("manifests", encode_manifest(manifest))
    repo.set_tag("envs", name, tag, digest)
    log.info("published environment %s:%s -> %s", name, tag, short(digest))
    return digest
