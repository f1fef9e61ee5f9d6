"""`weenv gc`: find, and with `delete=True` remove, objects no tag can reach.

Owns: the mark phase (every tag is a root: env tags -> manifests -> indexes -> blobs, and the
manifest's hint; group tags -> indexes -> blobs; hint tags -> hints -> their pack blobs), the
sweep over every key under blobs/, indexes/, manifests/ and hints/, and the safety rules:

- A reachable object is never deleted. Every reachable manifest, index and hint is read and
  verified to learn what it references; if any cannot be read or decoded, gc aborts before
  deleting anything (`GcAborted`, one line naming the object and the tag it came from).
  So does any tag the store holds that cannot be read (garbage content, or in a local store a
  folder, a dangling or looping symlink in its place): its target is unknown, so any object
  may be its root (tag_scan.scan_tags finds them; a store's plain listing skips some).
  Blobs are leaves and are not read; reachable blobs absent from the listing are reported.
- Publishing writes blobs, then indexes, then manifests, then tags, and can reuse an object
  that already exists. So an object younger than `grace` (default 1 hour) is kept even when
  unreferenced, and every young index or manifest counts as a root (its blobs are kept, even
  old reused ones). Tags are read again after listing, and anything they reach by then is
  kept too. The remaining race: a publish that checks for an old unreferenced object, and
  only writes the index that references it more than `grace` later, can lose it; keep
  publishes shorter than the grace period.
- Object ages come from the store: a store method `mtime(key) -> float | None` if the backend
  has one, else the file's mtime for a local store (wrappers with `.inner` are looked
  through). When the age is unknown the object is kept, unless `grace` is 0 (only safe when
  nothing publishes to the store while gc runs).
- A hint's own manifest field is not followed: a hint (tagged or not) does not keep an
  environment alive; its tag just dangles once the environment is collected.
- Deletion goes top-down (manifests, hints, indexes, then blobs), so an interrupted gc never
  leaves a manifest whose indexes are gone. Stale temp files of crashed writers older than
  `grace` are listed when the store offers `stale_temp(max_age)` (local stores) and, with
  `delete=True`, removed by its `cleanup_temp(max_age)`. The staging folders of builds and
  conversions that died (staging.py: blobs, registry downloads, decompressed archives) in the
  system's temp folder are listed and, with `delete=True`, removed.

Keys under those prefixes that are not digests are never touched (reported as unknown).
Must not: delete tags, or anything when the mark phase failed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from weenvfs.errors import StoreError, StoreUnavailable, WeenvError
from weenvfs.format.digest import short
from weenvfs.format.errors import FormatError
from weenvfs.format.refs import KINDS, TAG_KINDS, object_key
from weenvfs.store.base import Store
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository

from .staging import LEGACY_GRACE, StaleStaging, remove_stale, stale_stagings
from .tag_scan import scan_tags

log = logging.getLogger(__name__)

DEFAULT_GRACE = 3600.0
_DELETE_ORDER = ("manifests", "hints", "erofs", "indexes", "blobs")
_HEX = frozenset("0123456789abcdef")


class GcAborted(WeenvError):
    """gc aborted; nothing was deleted."""


@dataclass
class GcReport:
    """The outcome of one gc run."""

    reachable: dict[str, set[str]] = field(default_factory=lambda: {k: set() for k in KINDS})
    roots: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TAG_KINDS, 0))
    unreferenced: list[tuple[str, int]] = field(default_factory=list)  # (key, size)
    young: list[str] = field(default_factory=list)  # unreferenced, kept by the grace period
    ageless: list[str] = field(default_factory=list)  # unreferenced, kept: age unknown
    unknown: list[str] = field(default_factory=list)  # not digest keys: never touched
    missing: list[str] = field(default_factory=list)  # reachable but not stored (blobs)
    deleted: int = 0
    temp_removed: int | None = None
    stale_temp: list[tuple[str, int]] = field(default_factory=list)  # (path in the store, size)
    stale_staging: list[StaleStaging] = field(default_factory=list)

    @property
    def unreferenced_bytes(self) -> int:
        return sum(size for _, size in self.unreferenced)

    def to_json(self) -> dict[str, Any]:
        """The JSON-able form."""
        return {
            "reachable": {k: len(v) for k, v in self.reachable.items()},
            "roots": self.roots,
            "unreferenced": [{"key": k, "size": s} for k, s in self.unreferenced],
            "unreferenced_bytes": self.unreferenced_bytes,
            "kept_young": self.young,
            "kept_age_unknown": self.ageless,
            "unknown_keys": self.unknown,
            "missing": self.missing,
            "deleted": self.deleted,
            "temp_removed": self.temp_removed,
            "stale_temp": [{"path": p, "size": s} for p, s in self.stale_temp],
            "stale_staging": [{"path": str(s.path), "size": s.size} for s in self.stale_staging],
        }


class _Marker:
    """The mark phase: follows references from roots, reading every non-blob object."""

    def __init__(self, repo: Repository, report: GcReport) -> None:
        self.repo = repo
        self.marks = report.reachable

    def _read(self, kind: str, digest: str, origin: str, read: Callable[[str], Any]) -> Any:
        try:
            return read(digest)
        except (StoreUnavailable, GcAborted):
            raise
        except (StoreError, FormatError) as error:
            raise GcAborted(
                f"gc aborted, nothing deleted: cannot read reachable {kind}/{short(digest)} "
                f"({origin}): {error}"
            ) from None

    def manifest(self, digest: str, origin: str) -> None:
        if digest in self.marks["manifests"]:
            return
        manifest = self._read("manifests", digest, origin, self.repo.get_manifest)
        self.marks["manifests"].add(digest)
        via = f"{origin} -> manifests/{short(digest)}"
        for group in manifest.groups:
            self.index(group.index, via)
            if group.erofs is not None:  # not read: its digest is all gc needs
                self.marks["erofs"].add(group.erofs)
        if manifest.hints is not None:
            self.hint(manifest.hints, via)

    def index(self, digest: str, origin: str) -> None:
        if digest in self.marks["indexes"]:
            return
        index = self._read("indexes", digest, origin, self.repo.get_index)
        self.marks["indexes"].add(digest)
        self.marks["blobs"].update(index.blob_digests())

    def hint(self, digest: str, origin: str) -> None:
        if digest not in self.marks["hints"]:
            hint = self._read("hints", digest, origin, self.repo.get_hint)
            self.marks["hints"].add(digest)
            if hint.pack is not None:  # SPEC.md 9.1: a blob only the hint names
                self.marks["blobs"].add(hint.pack.blob)

    def tags(self, roots: dict[str, int]) -> None:
        """Mark from every tag (again, after listing, to catch tags set meanwhile). Every tag
        the store holds is a root: one that cannot be read (tag_scan.scan_tags) aborts."""
        follow = {"envs": self.manifest, "groups": self.index, "hints": self.hint}
        scans = {kind: scan_tags(self.repo, kind) for kind in TAG_KINDS}
        unreadable = sorted(u for scan in scans.values() for u in scan.unreadable)
        if unreadable:
            others = len(unreadable) - 1
            more = f" (and {others} more: weenv ls lists them)" if others else ""
            raise GcAborted(
                f"gc aborted, nothing deleted: cannot read tag {unreadable[0].label}: "
                f"{unreadable[0].reason}{more}"
            )
        for kind, scan in scans.items():
            for name, tag, digest in scan.tags:
                follow[kind](digest, f"tag {kind}/{name}:{tag}")
            roots[kind] = len(scan.tags)


def object_mtime(store: Store, key: str) -> float | None:
    """The modification time of an object, or None when the store cannot tell."""
    method = getattr(store, "mtime", None)
    if callable(method):
        value = method(key)
        return None if value is None else float(value)
    inner: object = store
    while not isinstance(inner, LocalStore) and hasattr(inner, "inner"):
        inner = inner.inner
    if isinstance(inner, LocalStore):
        try:
            return os.stat(inner.root / key).st_mtime
        except FileNotFoundError:
            return None
    return None


def _split_key(key: str) -> tuple[str, str]:
    kind, _, digest = key.partition("/")
    return kind, digest


def _is_digest(text: str) -> bool:
    return len(text) == 64 and set(text) <= _HEX


def _sweep(
    repo: Repository, report: GcReport, marker: _Marker, grace: float, now: float
) -> list[str]:
    """List every object; return the unreferenced, old-enough keys (young roots marked)."""
    candidates, young_roots = [], []
    listed: set[str] = set()
    for kind in KINDS:
        for key in repo.store.list(kind + "/"):
            digest = key[len(kind) + 1 :]
            if not _is_digest(digest):
                report.unknown.append(key)
                continue
            listed.add(key)
            if digest in report.reachable[kind]:
                continue
            mtime = object_mtime(repo.store, key) if grace > 0 else None
            if grace > 0 and mtime is None:
                report.ageless.append(key)
            elif grace > 0 and mtime is not None and now - mtime < grace:
                report.young.append(key)
                if kind in ("manifests", "indexes"):
                    young_roots.append(key)
            else:
                candidates.append(key)
    for key in young_roots:
        kind, digest = _split_key(key)
        origin = "younger than the grace period"
        (marker.manifest if kind == "manifests" else marker.index)(digest, origin)
    marker.tags(report.roots)
    report.missing = sorted(
        object_key(k, d)
        for k in KINDS
        for d in report.reachable[k]
        if object_key(k, d) not in listed
    )
    return [k for k in candidates if _split_key(k)[1] not in report.reachable[_split_key(k)[0]]]


def _delete(store: Store, keys: Iterable[str], report: GcReport) -> None:
    ordered = sorted(keys, key=lambda k: (_DELETE_ORDER.index(_split_key(k)[0]), k))
    for key in ordered:
        try:
            store.delete(key)
        except StoreError as error:
            raise WeenvError(
                f"gc stopped after deleting {report.deleted} objects: {error}"
            ) from None
        report.deleted += 1
        log.info("deleted %s", key)


def collect_garbage(
    repo: Repository,
    *,
    delete: bool = False,
    grace: float = DEFAULT_GRACE,
    now: float | None = None,
    staging_tmp_dir: str | None = None,
) -> GcReport:
    """Mark from every tag, sweep, and (with `delete`) remove the unreferenced objects."""
    if grace < 0:
        raise ValueError("grace must not be negative")
    report = GcReport()
    marker = _Marker(repo, report)
    marker.tags(report.roots)
    garbage = _sweep(repo, report, marker, grace, time.time() if now is None else now)
    for key in garbage:
        try:
            report.unreferenced.append((key, repo.store.size(key)))
        except StoreError:
            report.unreferenced.append((key, 0))  # vanished meanwhile
    list_temp = getattr(repo.store, "stale_temp", None)
    if callable(list_temp):
        report.stale_temp = list(list_temp(max_age=grace))
    report.stale_staging = stale_stagings(staging_tmp_dir, grace=max(grace, LEGACY_GRACE))
    if delete:
        _delete(repo.store, garbage, report)
        cleanup = getattr(repo.store, "cleanup_temp", None)
        if callable(cleanup):
            report.temp_removed = int(cleanup(max_age=grace))
        report.stale_staging = remove_stale(staging_tmp_dir, grace=max(grace, LEGACY_GRACE))
    return report
