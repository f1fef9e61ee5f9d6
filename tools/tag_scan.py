"""The strict walk of a store's tags: every tag it holds, readable or not.

`Repository.list_tags` reads what the store lists, and a local store's listing skips a folder,
a dangling or looping symlink or a symlinked name folder where a tag belongs; gc must not take
such a tag for absent (it would delete what the tag names), and `weenv ls` shows it.

Owns: `scan_tags` (the readable tags of a kind, and the unreadable ones with why) and
`local_root`. Must not: delete (gc.py) or print (read_commands.py).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from weenvfs.errors import ObjectMissing, StoreError, StoreUnavailable
from weenvfs.format.constants import TAG_SIZE
from weenvfs.format.errors import FormatError
from weenvfs.format.refs import NAME_SEPARATOR_IN_KEY, TAG_KINDS, decode_tag, parse_tag_key
from weenvfs.store.base import TEMP_PREFIX, Store
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository


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
