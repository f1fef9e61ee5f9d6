"""Which published groups a new build deduplicates against by default.

Owns: `recent_versions`, the versions of a group name already in the store that a new
version most likely shares data with: the tag being replaced, then `latest`, then the other
tags of the name in natural order, newest first (`v10` after `v9`), each digest once, at
most `limit` of them. Listing is by key prefix (one LIST of this name's tags, no other
name's). Must not: read chunk data or decide anything about the build itself.
"""

from __future__ import annotations

import re

from weenvfs.errors import ObjectMissing, RefNotFound, StoreError
from weenvfs.format.refs import DEFAULT_TAG, parse_tag_key, tag_key
from weenvfs.store.repository import Repository

DEFAULT_LIMIT = 3  # a bound: each version costs one index GET and its table's memory


def _natural(tag: str) -> list[tuple[int, int | str]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", tag) if p]


def recent_versions(repo: Repository, name: str, tag: str,
                    limit: int = DEFAULT_LIMIT) -> list[tuple[str, str]]:
    """(tag, index digest) of up to `limit` distinct versions of group `name`, `tag` first
    when it exists (see the module docstring); [] when the name has none."""
    prefix = tag_key("groups", name, DEFAULT_TAG).rsplit("/", 1)[0] + "/"
    try:
        tags = [parse_tag_key(key)[2] for key in repo.store.list(prefix)]
    except StoreError:
        return []
    rest = sorted((t for t in tags if t not in (tag, DEFAULT_TAG)), key=_natural, reverse=True)
    ordered = [t for t in (tag, DEFAULT_TAG) if t in tags] + rest
    found: list[tuple[str, str]] = []
    for candidate in ordered:
        if len(found) >= limit:
            break
        try:
            digest = repo.get_tag("groups", name, candidate)
        except (RefNotFound, ObjectMissing):
            continue  # deleted while listing
        if digest not in (d for _, d in found):
            found.append((candidate, digest))
    return found
