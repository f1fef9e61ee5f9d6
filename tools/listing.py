"""What a store holds, for `weenv ls`: environments and groups by name, their tags and
versions, sizes, dates and hints.

Owns: summarizing each tagged version of a store's tags (tag_scan.py walks them) once (a
version is a digest; several tags may point at it): for a group, its entries and file bytes
and the stored index size (tools/inspect.py's `group_stats`); for an environment, its groups,
its file bytes (the sum of its groups') and the hint tags recorded for it. Dates are the mtime
of the tree's root directory (when its content last changed, as the image recorded it; stores
keep no write times). A tag that cannot be read is listed as unreadable with why, as a missing
manifest or index is listed as missing: one bad tag does not hide the rest of the store.
Must not: print (read_commands.py renders) or fetch chunk data.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from typing import Any

from weenvfs.errors import ObjectMissing, RefNotFound
from weenvfs.format.index import ROOT_INODE
from weenvfs.format.refs import TAG_KINDS
from weenvfs.store.repository import Repository

from .inspect import GroupStats, group_stats
from .reader import LoadedGroup, load_group
from .tag_scan import scan_tags


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
