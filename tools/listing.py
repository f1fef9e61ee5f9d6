"""What a store holds, for `weenv ls`: environments and groups by name, their tags and
versions, sizes, dates and hints; and the strict walk of a store's tags that gc marks from.

Owns: walking the tags of a store (`scan_tags`: every tag the store holds, readable or not)
and summarizing each tagged version once (a version is a digest; several tags may point at
it): for a group, its entries and file bytes and the stored index size (tools/inspect.py's
`group_stats`); for an environment, its groups, its file bytes (the sum of its groups') and the
hint tags recorded for it. Dates are the mtime of the tree's root directory (when its content
last changed, as the image recorded it; stores keep no write times). A tag that cannot be read
is listed as unreadable with why, as a missing manifest or index is listed as missing: one bad
tag does not hide the rest of the store. Must not: print (read_commands.py renders) or fetch
chunk data.
"""

from __future__ import annotations

import datetime
import os
import stat
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weenvfs.errors import ObjectMissing, RefNotFound, StoreError, StoreUnavailable
from weenvfs.format.constants import TAG_SIZE
from weenvfs.format.errors import FormatError
from weenvfs.format.index import ROOT_INODE
from weenvfs.format.refs import NAME_SEPARATOR_IN_KEY, TAG_KINDS, decode_tag, parse_tag_key
from weenvfs.store.base import TEMP_PREFIX, Store
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository

from .inspect import GroupStats, group_stats
from .reader import LoadedGroup, load_group


@dataclass(frozen=True, order=True)
class UnreadableTag:
    """A tag the store holds that cannot be read: its key and why."""

    key: str
    reason: str

    @property
    def label(self) -> str:
        """`kind/name:tag`, `kind/name:*` for a whole name's folder, else the key's path
        under tags/."""
        try:
            kind, name, tag = parse_tag_key(self.key)
        except FormatError:
            parts = self.key.split("/")
            if len(parts) == 3 and parts[1] in TAG_KINDS:
                return f"{parts[1]}/{parts[2].replace(NAME_SEPARATOR_IN_KEY, '/')}:*"
            return self.key.removeprefix("tags/")
        return f"{kind}/{name}:{tag}"

    def to_json(self) -> dict[str, str]:
        """The JSON-able form."""
        return {"tag": self.label, "key": self.key, "error": self.reason}


@dataclass
class TagScan:
    """The tags of one kind: (name, tag, digest) of each readable one, and the unreadable."""

    tags: list[tuple[str, str, str]] = field(default_factory=list)
    unreadable: list[UnreadableTag] = field(default_factory=list)


def local_root(store: Store) -> Path | None:
    """The folder of a local store (wrappers with `.inner` looked through), else None."""
    inner: object = store
    while not isinstance(inner, LocalStore) and hasattr(inner, "inner"):
        inner = inner.inner
    return inner.root if isinstance(inner, LocalStore) else None


def scan_tags(repo: Repository, kind: str) -> TagScan:
    """Every tag of `kind` the store holds. Unlike `Repository.list_tags`, nothing the store
    holds under tags/KIND/ is left out: a tag whose content is not a tag, one the store refuses
    to read, and, in a local store, whatever its listing skips (a folder or a symlink where a
    tag file belongs, a symlink that does not resolve, a symlinked name folder) are returned
    as unreadable. Only a tag deleted while scanning is skipped; a store that cannot be
    reached (a temporary StoreUnavailable) raises."""
    if kind not in TAG_KINDS:
        raise ValueError(f"unknown tag kind {kind!r}")
    scan = TagScan()
    seen: set[str] = set()
    for key in repo.store.list(f"tags/{kind}/"):
        seen.add(key)
        _read_tag(repo.store, key, scan)
    root = local_root(repo.store)
    if root is not None:
        for key in _unlisted(root, kind, seen):
            _read_tag(repo.store, key, scan)
    scan.unreadable.sort()
    return scan


def _read_tag(store: Store, key: str, scan: TagScan) -> None:
    try:
        data = store.get(key, TAG_SIZE)
        _, name, tag = parse_tag_key(key)
        digest = decode_tag(data)
    except ObjectMissing:
        root = local_root(store)
        if root is not None and os.path.lexists(root / key):  # there, but not a file
            scan.unreadable.append(UnreadableTag(key, _describe(root / key)))
        # else deleted while scanning: no longer a tag
    except StoreUnavailable as error:
        if error.temporary:
            raise
        scan.unreadable.append(UnreadableTag(key, str(error)))
    except (StoreError, FormatError) as error:
        scan.unreadable.append(UnreadableTag(key, str(error)))
    else:
        scan.tags.append((name, tag, digest))


def _unlisted(root: Path, kind: str, seen: set[str]) -> list[str]:
    """The keys under tags/KIND/ of a local store's folder that its listing left out: every
    entry where a name folder or a tag file belongs (temp files aside) that was not listed,
    except the real name folders themselves. tags/ or tags/KIND that exists but is not a folder
    is one too."""
    found = []
    base = root / "tags" / kind
    for path in (root / "tags", base):
        if os.path.lexists(path) and not path.is_dir():
            return [path.relative_to(root).as_posix()]
    for name in _entries(base):
        key = f"tags/{kind}/{name.name}"
        if name.is_dir(follow_symlinks=False):
            found += [f"{key}/{e.name}" for e in _entries(Path(name.path))]
        else:
            found.append(key)
    return sorted(k for k in found if k not in seen)


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return [e for e in it if not e.name.startswith(TEMP_PREFIX)]
    except (FileNotFoundError, NotADirectoryError):
        return []  # none, or vanished meanwhile


def _describe(path: Path) -> str:
    """Why an entry the store calls missing is not a tag."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as error:
        return error.strerror or str(error)
    if stat.S_ISDIR(mode):
        return "a folder, not a tag file"
    if not stat.S_ISLNK(mode):
        return "not a regular file"
    try:
        target = os.stat(path).st_mode
    except OSError as error:
        return f"a symlink that does not resolve: {error.strerror}"
    if stat.S_ISDIR(target):
        return "a symlink to a folder, which the store does not list"
    return "a symlink to something that is not a regular file"


def _tags_by_name(tags: list[tuple[str, str, str]]) -> dict[str, dict[str, list[str]]]:
    """name -> digest -> its tags (sorted), for every (name, tag, digest)."""
    found: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name, tag, digest in tags:
        found[name][digest].append(tag)
    return {n: {d: sorted(t) for d, t in v.items()} for n, v in sorted(found.items())}


def _date(group: LoadedGroup) -> str:
    seconds = group.index.inode(ROOT_INODE).mtime_sec
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Groups:
    """Loads and summarizes each group index once (environments share groups)."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.cache: dict[str, tuple[LoadedGroup, GroupStats] | None] = {}

    def get(self, digest: str) -> tuple[LoadedGroup, GroupStats] | None:
        if digest not in self.cache:
            try:
                group = load_group(self.repo, digest)
                self.cache[digest] = (group, group_stats(group))
            except RefNotFound:  # a tag whose index is gone (gc'd by hand): shown as missing
                self.cache[digest] = None
        return self.cache[digest]

    def version(self, digest: str, tags: list[str]) -> dict[str, Any]:
        loaded = self.get(digest)
        if loaded is None:
            return {"digest": digest, "tags": tags, "missing": True}
        group, stats = loaded
        return {"digest": digest, "tags": tags, "entries": stats.inodes,
                "file_bytes": stats.file_bytes, "index_bytes": stats.index_bytes,
                "date": _date(group)}


def _hint_tags(tags: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    """manifest digest -> its hint tags."""
    hints: dict[str, list[str]] = defaultdict(list)
    for manifest, tag, _ in tags:
        hints[manifest].append(tag)
    return {k: sorted(v) for k, v in hints.items()}


def _env_version(repo: Repository, groups: _Groups, digest: str, tags: list[str],
                 hints: dict[str, list[str]]) -> dict[str, Any]:
    try:
        manifest = repo.get_manifest(digest)
    except ObjectMissing:
        return {"digest": digest, "tags": tags, "missing": True}
    loaded = [groups.get(g.index) for g in manifest.groups]
    present = [x for x in loaded if x is not None]
    return {
        "digest": digest, "tags": tags,
        "groups": [g.name for g in manifest.groups],
        "file_bytes": sum(stats.file_bytes for _, stats in present),
        "date": max((_date(group) for group, _ in present), default=None),
        "hints": hints.get(digest, []),
        **({"missing_groups": len(loaded) - len(present)} if len(present) < len(loaded) else {}),
    }


def list_store(repo: Repository) -> dict[str, Any]:
    """Every environment and group of the store by name, each tagged version once (newest
    first by date), and every tag that cannot be read (`unreadable_tags`: tag, key, error)."""
    scans = {kind: scan_tags(repo, kind) for kind in TAG_KINDS}
    groups = _Groups(repo)
    hints = _hint_tags(scans["hints"].tags)

    def newest_first(versions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(versions, key=lambda v: v.get("date") or "", reverse=True)

    envs = [
        {"name": name, "versions": newest_first(
            [_env_version(repo, groups, d, tags, hints) for d, tags in by_digest.items()])}
        for name, by_digest in _tags_by_name(scans["envs"].tags).items()
    ]
    group_list = [
        {"name": name, "versions": newest_first(
            [groups.version(d, tags) for d, tags in by_digest.items()])}
        for name, by_digest in _tags_by_name(scans["groups"].tags).items()
    ]
    unreadable = sorted(u for scan in scans.values() for u in scan.unreadable)
    return {"store": repo.store.url, "environments": envs, "groups": group_list,
            "unreadable_tags": [u.to_json() for u in unreadable]}
