"""Typed, verified access to the objects of a store: the chain of trust in one place.

`Repository` wraps any `Store` and knows the key layout of SPEC.md: it names objects by digest
when writing, verifies every object against its digest when reading, decodes manifests, indexes
and hints, and reads and writes tags. It enforces the write ordering (a tag may only point at an
object that exists) and resolves references (`NAME[:TAG]` or a digest). It never caches: callers
that need a cache (the node) keep their own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from weenvfs.errors import ObjectCorrupt, ObjectMissing, RefNotFound, StoreError
from weenvfs.format.constants import TAG_SIZE
from weenvfs.format.digest import digest_hex, short
from weenvfs.format.errors import FormatError
from weenvfs.format.hints import Hint, decode_hint
from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import Manifest, decode_manifest
from weenvfs.format.refs import (
    decode_tag,
    encode_tag,
    object_key,
    parse_name_tag,
    parse_tag_key,
    stored_limit,
    tag_key,
)

from .base import Store
from .retry import read_verified

log = logging.getLogger(__name__)
_DIGEST_REF = re.compile(r"(?:blake3:|@)?([0-9a-f]{64})")


class Repository:
    """Objects and tags of one store, verified on every read."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- immutable objects ------------------------------------------------------------------

    def put_object(self, kind: str, data: bytes) -> str:
        """Store `data` as an object of `kind` under its digest (skipped if present)."""
        digest = digest_hex(data)
        key = object_key(kind, digest)
        if not self.store.exists(key):
            self.store.put(key, data)
        return digest

    def put_object_file(self, kind: str, digest: str, path: Path) -> bool:
        """Upload the file at `path`, already hashed to `digest`; False if it was present."""
        key = object_key(kind, digest)
        if self.store.exists(key):
            return False
        self.store.put_file(key, path)
        return True

    def has_object(self, kind: str, digest: str) -> bool:
        """Whether the object exists (not verified)."""
        return self.store.exists(object_key(kind, digest))

    def get_object(self, kind: str, digest: str) -> bytes:
        """The bytes of an object, verified against its digest; `ObjectCorrupt` if each of
        `retry.CORRUPT_ATTEMPTS` reads fails verification, `ObjectTooLarge` (unread) if it
        is larger than its kind's limit (SPEC.md 12.1)."""
        key = object_key(kind, digest)
        limit = stored_limit(kind)

        def verify(data: bytes) -> None:
            actual = digest_hex(data)
            if actual != digest:
                raise ObjectCorrupt(f"corrupt: its content hashes to {short(actual)}")

        # A mismatch may be damage on the way (proxy, CDN, memory): read again before
        # calling the stored object corrupt (read_verified's rule).
        return read_verified(
            lambda: self.store.get(key, limit), verify, f"{kind}/{short(digest)}"
        )

    def get_manifest(self, digest: str) -> Manifest:
        """The verified, decoded manifest `digest`."""
        return decode_manifest(self.get_object("manifests", digest))

    def get_index(self, digest: str) -> GroupIndex:
        """The verified, decoded group index `digest`."""
        return GroupIndex.from_object(self.get_object("indexes", digest))

    def get_hint(self, digest: str) -> Hint:
        """The verified, decoded prefetch hint `digest`."""
        return decode_hint(self.get_object("hints", digest))

    # -- tags -------------------------------------------------------------------------------

    def set_tag(self, kind: str, name: str, tag: str, digest: str) -> None:
        """Point `name:tag` at `digest`, which must already be stored (write ordering)."""
        target = {"groups": "indexes", "envs": "manifests", "hints": "hints"}[kind]
        if not self.has_object(target, digest):
            raise StoreError(f"refusing to tag {name}:{tag}: {target}/{short(digest)} is missing")
        self.store.put(tag_key(kind, name, tag), encode_tag(digest))
        log.debug("tagged %s %s:%s -> %s", kind, name, tag, short(digest))

    def get_tag(self, kind: str, name: str, tag: str) -> str:
        """The digest `name:tag` points at (`RefNotFound` if there is no such tag)."""
        try:
            return decode_tag(self.store.get(tag_key(kind, name, tag), TAG_SIZE))
        except ObjectMissing:
            what = {"groups": "group", "envs": "environment", "hints": "hint"}[kind]
            near = self._near_refs(kind, f"{name}:{tag}") if kind != "hints" else []
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise RefNotFound(f"no {what} {name}:{tag} in {self.store.url}{hint}") from None

    def _near_refs(self, kind: str, ref: str, n: int = 3) -> list[str]:
        """Existing `name:tag` of `kind` closest to `ref` (difflib), for an error message:
        one LIST of tag keys, no GETs; [] when the store cannot list."""
        import difflib

        try:
            refs = []
            for key in self.store.list(f"tags/{kind}/"):
                _, name, tag = parse_tag_key(key)
                refs.append(f"{name}:{tag}")
        except (StoreError, FormatError):
            return []
        return difflib.get_close_matches(ref, refs, n=n, cutoff=0.6)

    def delete_tag(self, kind: str, name: str, tag: str) -> None:
        """Remove a tag (objects stay until `gc`)."""
        self.store.delete(tag_key(kind, name, tag))

    def tag_names(self, kind: str, name: str) -> set[str]:
        """The tags `name` of `kind` has: one LIST, no GET (StoreError where the store
        cannot list)."""
        return {parse_tag_key(key)[2] for key in self.store.list(_tag_prefix(kind, name))}

    def list_tags(self, kind: str, name: str | None = None) -> Iterator[tuple[str, str, str]]:
        """(name, tag, digest) of every tag of `kind` (with `name`: of that name only)."""
        prefix = f"tags/{kind}/" if name is None else _tag_prefix(kind, name)
        for key in self.store.list(prefix):
            _, name, tag = parse_tag_key(key)
            try:
                yield name, tag, decode_tag(self.store.get(key, TAG_SIZE))
            except ObjectMissing:
                continue  # deleted while listing

    # -- references -------------------------------------------------------------------------

    def _resolve(self, kind: str, ref: str) -> str:
        m = _DIGEST_REF.fullmatch(ref)
        if m:
            return m.group(1)
        name, tag = parse_name_tag(ref, "environment" if kind == "envs" else "group")
        return self.get_tag(kind, name, tag)

    def env_digest(self, ref: str) -> str:
        """The manifest digest of an environment given as `NAME[:TAG]` (its tag's one round
        trip) or as a manifest digest (none)."""
        return self._resolve("envs", ref)

    def resolve_env(self, ref: str, load: Callable[[str], Manifest] | None = None
                    ) -> tuple[str, Manifest]:
        """(digest, manifest) of an environment given as `NAME[:TAG]` or a manifest digest;
        the manifest read by `load(digest)` when given (a node's copy), else from the store."""
        digest = self.env_digest(ref)
        try:
            return digest, (load or self.get_manifest)(digest)
        except ObjectMissing:
            raise RefNotFound(
                f"no environment manifest {short(digest)} in {self.store.url}"
            ) from None

    def resolve_group(self, ref: str) -> tuple[str, GroupIndex]:
        """(digest, index) of a group given as `NAME[:TAG]` or an index digest."""
        digest = self._resolve("groups", ref)
        try:
            return digest, self.get_index(digest)
        except ObjectMissing:
            raise RefNotFound(f"no group index {short(digest)} in {self.store.url}") from None


def _tag_prefix(kind: str, name: str) -> str:
    """The key prefix of every tag of `name` of `kind` (the key of tag "x" without the x)."""
    return tag_key(kind, name, "x")[:-1]
