"""The snapshotter's semantics: containerd's Snapshotter interface over state.py and remote.py.

Ordinary layers behave as containerd's overlayfs snapshotter does: an active snapshot is an
upper folder over its parents (a bind mount when it has none), a view is its parents
read-only, a commit freezes the upper. A WeEnv layer (remote.py) is a committed snapshot
whose folder is its group's shared lazy mount:

- through labels: Prepare with `containerd.io/snapshot.ref` = the layer's chain ID and the
  `containerd.io/snapshot/weenv/*` labels (containerd's unpacker passes both) mounts the
  group, commits it as a snapshot named by the chain ID, and answers AlreadyExists, which
  tells containerd that the layer is there (stargz's protocol; the blob is never fetched);
- through the blob: a commit of a snapshot whose files are exactly one marker
  (`.weenv/layer-N.json`) mounts the group instead of keeping the marker (`ctr images pull`,
  which unpacks every blob itself).

Errors are `SnapshotError`s whose `code` names the gRPC status (service.py maps them).
Owns: what each call does and the restore at start (`restore`: every WeEnv snapshot takes its
mount again, remounting one that died). Must not: speak gRPC or mount overlays (containerd
mounts what `mounts()` returns).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from weenvfs.format.errors import FormatError
from weenvfs.format.oci_layer import MARKER_DIR, decode_marker, from_labels

from .filters import matches
from .labels import REMOTE_LABEL, REMOTE_VALUE, TARGET_LABEL
from .remote import Groups, LayerRefused, WeenvLayer
from .state import ACTIVE, COMMITTED, VIEW, Record, SnapshotState, remove_tree

log = logging.getLogger(__name__)

Mount = tuple[str, str, list[str]]  # type, source, options


class SnapshotError(Exception):
    """A call that failed; `code` is the gRPC status name."""

    code = "UNKNOWN"


class NotFound(SnapshotError):
    code = "NOT_FOUND"


class AlreadyExists(SnapshotError):
    code = "ALREADY_EXISTS"


class InvalidArgument(SnapshotError):
    code = "INVALID_ARGUMENT"


class FailedPrecondition(SnapshotError):
    code = "FAILED_PRECONDITION"


class Snapshots:
    """The snapshots of one root; every call is serialised by one lock."""

    def __init__(self, state: SnapshotState, groups: Groups) -> None:
        self.state = state
        self.groups = groups
        self.lock = threading.RLock()
        # WeEnv layers taken (`labels`, `marker`) and refused, snapshots `restored` (and
        # `restore_failed`) at start: plain integers, read by metrics.py at each scrape.
        self.counts: Counter[str] = Counter()

    @contextlib.contextmanager
    def _refusals(self) -> Iterator[None]:
        """Count a WeEnv layer refused: any SnapshotError of the block but AlreadyExists (how
        a layer taken through its labels answers)."""
        try:
            yield
        except AlreadyExists:
            raise
        except SnapshotError:
            self.counts["refused"] += 1
            raise

    # -- create -------------------------------------------------------------------------------

    def prepare(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        with self.lock:
            self._check_new(key, parent)
            target = labels.get(TARGET_LABEL)
            with self._refusals():
                ref = _layer_ref(labels)
                if ref is not None and target:
                    self._commit_remote(target, parent, labels, ref)
            record = self.state.create(key, parent, ACTIVE, labels)
            return self._mounts(record)

    def view(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        with self.lock:
            self._check_new(key, parent)
            return self._mounts(self.state.create(key, parent, VIEW, labels))

    def _check_new(self, key: str, parent: str) -> None:
        if not key:
            raise InvalidArgument("a snapshot key is required")
        if self.state.get(key) is not None:
            raise AlreadyExists(f"snapshot {key!r} already exists")
        if parent:
            found = self.state.get(parent)
            if found is None:
                raise NotFound(f"parent snapshot {parent!r} does not exist")
            if found.kind != COMMITTED:
                raise InvalidArgument(f"parent {parent!r} is not committed")

    def _commit_remote(self, target: str, parent: str, labels: dict[str, str],
                       ref: object) -> None:
        """Mount the group as committed snapshot `target`; raises AlreadyExists when done."""
        existing = self.state.get(target)
        if existing is None:
            layer = self._check_layer(ref)
            record = self.state.create(target, parent, COMMITTED,
                                       {**labels, REMOTE_LABEL: REMOTE_VALUE}, layer.to_json())
            self._take_mount(record, layer)
            self.counts["labels"] += 1
            log.info("WeEnv layer %d of %s ready as %s", layer.position, layer.manifest[:12],
                     target)
        elif existing.parent != parent:
            raise FailedPrecondition(f"snapshot {target!r} exists with another parent")
        raise AlreadyExists(f"target snapshot {target!r}: a WeEnv layer, mounted lazily")

    def _check_layer(self, ref: object) -> WeenvLayer:
        try:
            return self.groups.check(ref)  # type: ignore[arg-type]
        except LayerRefused as error:
            raise FailedPrecondition(str(error)) from None

    def _take_mount(self, record: Record, layer: WeenvLayer) -> None:
        """Acquire `record`'s group mount; on failure the record goes again."""
        try:
            self.groups.acquire(layer, record.id, self.state.dir(record))
        except LayerRefused as error:
            self.state.remove(record)
            raise FailedPrecondition(str(error)) from None

    # -- commit, remove -------------------------------------------------------------------

    def commit(self, name: str, key: str, labels: dict[str, str]) -> None:
        with self.lock:
            record = self._get(key)
            if record.kind != ACTIVE:
                raise FailedPrecondition(f"snapshot {key!r} is not active")
            if self.state.get(name) is not None:
                raise AlreadyExists(f"snapshot {name!r} already exists")
            merged = {**record.labels, **labels}
            layer = self._take_marker(record)
            if layer is None:
                self.state.save(replace(record, key=name, kind=COMMITTED, labels=merged), key)
                return
            self.state.save(replace(record, key=name, kind=COMMITTED, weenv=layer.to_json(),
                                    labels={**merged, REMOTE_LABEL: REMOTE_VALUE}), key)
            remove_tree(self.state.dir(record) / "fs" / MARKER_DIR)
            log.info("WeEnv layer %d of %s committed as %s (from its marker)", layer.position,
                     layer.manifest[:12], name)

    def _take_marker(self, record: Record) -> WeenvLayer | None:
        """When `record`'s files are exactly a WeEnv marker: its group, mounted for it."""
        with self._refusals():
            marker = _marker(self.state.dir(record) / "fs")
            if marker is None:
                return None
            layer = self._check_layer(marker)
            try:
                self.groups.acquire(layer, record.id, self.state.dir(record))
            except LayerRefused as error:
                raise FailedPrecondition(str(error)) from None
        self.counts["marker"] += 1
        return layer

    def remove(self, key: str) -> None:
        with self.lock:
            record = self._get(key)
            if self.state.children(key):
                raise FailedPrecondition(f"snapshot {key!r} has children")
            self._release(record)
            self.state.remove(record)

    def _release(self, record: Record) -> None:
        if record.weenv is not None:
            self.groups.release(WeenvLayer.from_json(record.weenv), record.id)

    def cleanup(self) -> list[str]:
        """Remove the folders no record owns (what a crash left); their names."""
        with self.lock:
            removed = []
            for folder in self.state.leftovers():
                try:
                    remove_tree(folder)
                    removed.append(folder.name)
                except OSError as error:
                    log.warning("cleanup left %s: %s", folder, error)
            return removed

    # -- read -------------------------------------------------------------------------------

    def stat(self, key: str) -> Record:
        with self.lock:
            return self._get(key)

    def mounts(self, key: str) -> list[Mount]:
        with self.lock:
            return self._mounts(self._get(key))

    def update(self, record: Record, paths: list[str]) -> Record:
        """Update the labels of `record.key` (only labels are mutable); `paths` is the field
        mask (`labels`, `labels.KEY`; empty: all mutable fields)."""
        with self.lock:
            current = self._get(record.key)
            labels = dict(current.labels)
            if not paths or "labels" in paths:
                labels = dict(record.labels)
            for path in paths:
                if path.startswith("labels."):
                    name = path.removeprefix("labels.")
                    if name in record.labels:
                        labels[name] = record.labels[name]
                    else:
                        labels.pop(name, None)
                elif path != "labels":
                    raise InvalidArgument(f"cannot update field {path!r}")
            return self.state.save(replace(current, labels=labels))

    def usage(self, key: str) -> tuple[int, int]:
        """(bytes, inodes) the snapshot uses on local disk (a WeEnv layer: none)."""
        with self.lock:
            record = self._get(key)
            folder = self.state.dir(record) / "fs"
        size = inodes = 0
        for dirpath, dirnames, files in os.walk(folder):
            for name in (*dirnames, *files):
                info = os.lstat(os.path.join(dirpath, name))
                size += info.st_blocks * 512
                inodes += 1
        return size, inodes

    def walk(self, filters: list[str]) -> Iterator[Record]:
        with self.lock:
            records = list(self.state.by_key.values())
        return (r for r in records if matches(r, filters))

    def _get(self, key: str) -> Record:
        record = self.state.get(key)
        if record is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        return record

    # -- mounts ---------------------------------------------------------------------------

    def _folder(self, record: Record) -> Path:
        """What a committed snapshot's files are: its fs/, or its group's mount."""
        if record.weenv is not None:
            return self.groups.mountpoint(WeenvLayer.from_json(record.weenv))
        return self.state.dir(record) / "fs"

    def _lowers(self, parent: str) -> list[str]:
        """The folders of `parent` and its ancestors, topmost first."""
        out = []
        while parent:
            record = self._get(parent)
            out.append(str(self._folder(record)))
            parent = record.parent
        return out

    def _mounts(self, record: Record) -> list[Mount]:
        lowers = self._lowers(record.parent)
        folder = self.state.dir(record)
        if record.kind == ACTIVE and not lowers:
            return [("bind", str(folder / "fs"), ["rw", "rbind"])]
        if record.kind == ACTIVE:
            return [("overlay", "overlay", [f"workdir={folder / 'work'}",
                                            f"upperdir={folder / 'fs'}",
                                            f"lowerdir={':'.join(lowers)}"])]
        if not lowers:  # a view of nothing, or a committed snapshot asked for its mounts
            return [("bind", str(self._folder(record)), ["ro", "rbind"])]
        if len(lowers) == 1:
            return [("bind", lowers[0], ["ro", "rbind"])]
        return [("overlay", "overlay", [f"lowerdir={':'.join(lowers)}"])]

    # -- restart ----------------------------------------------------------------------------

    def restore(self) -> tuple[int, list[str]]:
        """Take every WeEnv snapshot's group mount again (a dead one is remounted); how many
        were restored, and one line per failure (the snapshot stays; its mounts fail)."""
        restored, failed = 0, []
        with self.lock:
            for record in list(self.state.by_key.values()):
                if record.weenv is None:
                    continue
                layer = WeenvLayer.from_json(record.weenv)
                try:
                    self.groups.acquire(layer, record.id, self.state.dir(record))
                    restored += 1
                except LayerRefused as error:
                    failed.append(f"{record.key}: {error}")
            self.counts["restored"], self.counts["restore_failed"] = restored, len(failed)
        return restored, failed


def _layer_ref(labels: dict[str, str]) -> object:
    try:
        return from_labels(labels)
    except FormatError as error:
        raise InvalidArgument(f"WeEnv layer labels: {error}") from None


def _marker(fs: Path) -> object:
    """The reference of a WeEnv marker when `fs` holds exactly `.weenv/layer-N.json`, else
    None; InvalidArgument for a marker that does not parse."""
    try:
        top = os.listdir(fs)
        if top != [MARKER_DIR] or not (fs / MARKER_DIR).is_dir():
            return None
        inner = os.listdir(fs / MARKER_DIR)
        path = fs / MARKER_DIR / inner[0] if len(inner) == 1 else None
        if path is None or path.is_symlink() or not path.is_file():
            return None
        data = path.read_bytes()
    except OSError:
        return None
    try:
        return decode_marker(path.name, data)
    except FormatError as error:
        raise InvalidArgument(f"WeEnv layer marker: {error}") from None
