"""Prefetch hints on the node: recording what a mount reads, merging runs, finding and
publishing an environment's hint.

Owns:
- `HintRecorder`: the first access of every chunk, and the first read of every file, in
  order, with the milliseconds since the mount started; fed from the reader's read path, so
  it must stay cheap (a dict lookup per read and per chunk piece, nothing allocated for a
  chunk or file seen before);
- the pure functions `merge_runs` (union of runs ordered by earliest median access, bounded
  in size; for chunk records and for file records alike) and `check_hint` (SPEC.md 9.2: a
  hint is used only with its manifest and only if every record names an existing chunk and
  every file record a regular file);
- `find_hint` (`--hint TAG|DIGEST|none`: a tag under `tags/hints/<manifest digest>/`, a hint
  digest, or nothing; the manifest's own `hints` field as a fallback, SPEC.md 9.3) and
  `publish_run` (merge a recorded run into the hint a tag points at, store the hint object,
  then move the tag).

Hints are advisory: a missing, damaged or mismatched hint is logged and ignored, never a
mount failure. Publishing never changes a group or the manifest.

Must not: fetch chunks (core/prefetch.py replays hints), know FUSE, or decide the layout of
blobs (tools/layout.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from weenvfs.errors import (
    ObjectMissing,
    RefNotFound,
    StoreError,
    StoreUnavailable,
    UsageError,
    WeenvError,
)
from weenvfs.format import constants as C
from weenvfs.format.columns import kind_flags
from weenvfs.format.digest import digest_hex, short
from weenvfs.format.errors import FormatError
from weenvfs.format.hints import Hint, HintFile, HintRecord, encode_hint
from weenvfs.format.index import GroupIndex, Span
from weenvfs.format.manifest import Manifest, encode_manifest
from weenvfs.format.refs import DEFAULT_TAG, SEED_TAG, check_tag
from weenvfs.store.repository import Repository

from .loaded_env import LoadedEnv
from .node_copies import known_hinted
from .tree import FIRST_INODE, GROUP_SHIFT, split_inode

log = logging.getLogger(__name__)

NO_HINT = "none"
# Upper bound of a merged hint. A 5 GB environment has some 10k chunks of 1 MiB; runs that
# touch more than this many chunks keep the ones most runs share, earliest first.
DEFAULT_MAX_RECORDS = 1 << 18
HINT_DIGEST = re.compile(r"(?:blake3:)?([0-9a-f]{64})")  # a --hint that names a hint object


class HintRecorder:
    """Records the first access of every chunk since `start` (a `clock()` reading)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.start = clock()
        # (group << 32) | chunk -> ms (an int key: no tuple per access); insertion order is
        # first-access order
        self._seen: dict[int, int] = {}
        self._files: dict[int, int] = {}  # tree inode number -> ms, in first-read order

    def note(self, inode: int, spans: Iterable[Span]) -> None:
        """A read of file `inode` (a tree inode number) touched the chunks of `spans`."""
        if inode not in self._files:
            self._files[inode] = int((self._clock() - self.start) * 1000)
        base = ((inode - FIRST_INODE) >> GROUP_SHIFT) << GROUP_SHIFT  # core/tree.py numbering
        seen = self._seen
        for span in spans:
            key = base | span.chunk
            if key not in seen:
                seen[key] = int((self._clock() - self.start) * 1000)

    def __len__(self) -> int:
        return len(self._seen)

    def records(self) -> list[HintRecord]:
        """What was recorded, in first-access order (times non-decreasing)."""
        mask = (1 << GROUP_SHIFT) - 1
        return [HintRecord(k >> GROUP_SHIFT, k & mask, t) for k, t in self._seen.items()]

    def files(self) -> list[HintFile]:
        """The files read, as (group, inode in its index), in first-read order."""
        return [HintFile(*split_inode(inode), t) for inode, t in self._files.items()]


# -- merging (pure) -------------------------------------------------------------------------


@dataclass
class _Seen:
    times: list[int]
    first: tuple[int, int]  # (run, position) of the earliest sighting: keeps a run's order


Record = TypeVar("Record", HintRecord, HintFile)


def merge_runs(
    runs: Sequence[Sequence[Record]], max_records: int = DEFAULT_MAX_RECORDS
) -> tuple[Record, ...]:
    """The union of `runs` (each in first-access order) of chunk records, or of file
    records, ordered by the median of each one's access times over the runs that read it
    (the lower median, so times stay whole milliseconds), ties in the order of the earliest
    run that read it. Beyond `max_records` those read by the fewest runs go first, then the
    latest. One run comes back as is (minus duplicates)."""
    seen: dict[tuple[int, int], _Seen] = {}
    make: Callable[[int, int, int], Record] | None = None
    for r, run in enumerate(runs):
        for position, rec in enumerate(run):
            make = type(rec)
            key = (rec[0], rec[1])  # (group, chunk) or (group, inode)
            found = seen.get(key)
            if found is None:
                seen[key] = _Seen([rec.time_ms], (r, position))
            elif found.first[0] != r:  # counted once per run
                found.times.append(rec.time_ms)
    ranked = [(key, _lower_median(s.times), s) for key, s in seen.items()]
    if len(ranked) > max_records:
        ranked.sort(key=lambda item: (-len(item[2].times), item[1], item[2].first))
        del ranked[max_records:]
    ranked.sort(key=lambda item: (item[1], item[2].first))
    if make is None:
        return ()
    return tuple(make(g, c, median) for (g, c), median, _ in ranked)


def _lower_median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def check_hint(hint: Hint, manifest_digest: str, indexes: Sequence[GroupIndex]) -> str | None:
    """Why `hint` must not be used with this manifest and its group indexes, or None. A file
    record must name a regular file (its inode's type bits, read for a whole group at once:
    a full decode of each record, ~2.3 us, made this 2.9 ms of every replaying mount's hint
    lookup for the RL family's 1,272 files, 1.05 ms so); the rest of that inode is checked
    where it is read (core/page_warm.py), as every index record is (format/validate.py)."""
    if hint.manifest != manifest_digest:
        return f"it is bound to manifest {short(hint.manifest)}, not {short(manifest_digest)}"
    counts = [index.header.chunk_count for index in indexes]
    for rec in hint.records:
        if rec.group >= len(counts) or rec.chunk >= counts[rec.group]:
            return f"record {tuple(rec)} names no chunk of this environment"
    regular: dict[int, bytes] = {}  # group -> 1 per inode that is a regular file, else 0
    for file in hint.files:
        if file.group < len(indexes) and file.group not in regular:
            regular[file.group] = kind_flags(indexes[file.group].inode_table(), stat.S_IFREG)
        flags = regular.get(file.group, b"")
        if file.inode >= len(flags) or not flags[file.inode]:
            return f"file record {tuple(file)} names no regular file of this environment"
    if hint.pack is not None:
        for rec, length in zip(hint.records, hint.pack.lengths, strict=True):
            if not length:
                continue
            chunk = indexes[rec.group].chunk(rec.chunk)
            if chunk.zero or length > C.max_frame_size(chunk.ulen):
                return f"the pack holds a frame of {length} bytes for record {tuple(rec)}"
    return None


# -- finding and publishing (store I/O) ----------------------------------------------------


def check_hint_spec(spec: str, what: str = "--hint", allow_none: bool = True) -> str:
    """Validate a hint tag, a hint digest or (if `allow_none`) `none`; UsageError if bad.
    `none` is never a tag: `--hint none` could not name it."""
    if spec == NO_HINT:
        if allow_none:
            return spec
    elif HINT_DIGEST.fullmatch(spec):
        return spec
    else:
        with contextlib.suppress(FormatError):
            return check_tag(spec)
    expected = "a tag, a hint digest or none" if allow_none else "a tag other than none"
    raise UsageError(f"{what}: {spec!r:.80} is not {expected}")


@dataclass(frozen=True)
class FoundHint:
    """A usable hint and where it came from (a tag, a digest, or the manifest); `partial`:
    the seed (SPEC.md 9.4), what the image's own command read, not what a workload reads."""

    digest: str
    source: str
    hint: Hint
    partial: bool = False


def find_hint(
    repo: Repository,
    manifest_digest: str,
    manifest: Manifest,
    indexes: Sequence[GroupIndex],
    spec: str = DEFAULT_TAG,
) -> FoundHint | None:
    """The hint `spec` names for this environment: `none`; a hint digest; or a tag (default
    `latest`), falling back to the manifest's own `hints` field when that tag does not exist,
    and for `latest` then to the seed (SEED_TAG).
    Returns None when there is no usable hint (a bad one is logged and ignored); raises only
    for a malformed `spec`."""
    if spec == NO_HINT:
        return None
    try:
        where = _locate(repo, manifest_digest, manifest, spec)
    except (StoreError, FormatError) as e:
        log.warning("cannot read hint tag %s of %s: %s", spec, short(manifest_digest), e)
        return None
    if where is None:
        if spec == DEFAULT_TAG:
            return find_hint(repo, manifest_digest, manifest, indexes, SEED_TAG)
        log.info("no hint %s for %s", spec, short(manifest_digest))
        return None
    found = _load(repo, *where, indexes)
    if found is not None and where[1] == f"tag {SEED_TAG}":
        found = dataclasses.replace(found, partial=True)
    return found


def _locate(repo: Repository, manifest_digest: str, manifest: Manifest,
            spec: str) -> tuple[str, str, str] | None:
    """Where hint `spec` (not `none`) is, without reading it: (its digest, what named it,
    the manifest digest it must be bound to); None when the tag does not exist and the
    manifest names no hint of its own. StoreError or FormatError when the tag cannot be
    read."""
    match = HINT_DIGEST.fullmatch(spec)
    if match is not None:
        return match.group(1), f"hint {short(match.group(1))}", manifest_digest
    check_tag(spec)
    try:
        return repo.get_tag("hints", manifest_digest, spec), f"tag {spec}", manifest_digest
    except RefNotFound:
        pass
    if manifest.hints is None:
        return None
    # SPEC.md 9.3: bound to the same manifest without its `hints` field.
    bound = digest_hex(encode_manifest(dataclasses.replace(manifest, hints=None)))
    return manifest.hints, "the manifest", bound


def missing_hint(env: LoadedEnv, spec: str) -> str | None:
    """Why a hint the user named (`--hint TAG|DIGEST`, not the default `latest`, the `seed`
    a recording first run replays, nor `none`) will not be found: one line for a console
    warning, or None (it exists, or the store cannot say: the replay logs that). Hints stay
    advisory (the mount goes on without one: `--hint train --record-hints train` starts
    with no `train`), but a misspelt name should not pass unseen. Only where the hint is
    is looked at (`_locate`, and whether that object exists), not the hint itself."""
    if spec in (NO_HINT, DEFAULT_TAG, SEED_TAG):
        return None
    repo = Repository(env.store)
    try:
        where = _locate(repo, env.digest, env.manifest, spec)
        if where is None:
            return f"no hint tag {spec!r} for this environment: mounting without a hint"
        if not repo.has_object("hints", where[0]):
            return f"hint {short(where[0])} is not in the store: mounting without a hint"
    except (StoreError, FormatError):
        pass
    return None


def _load(
    repo: Repository, digest: str, source: str, bound: str, indexes: Sequence[GroupIndex]
) -> FoundHint | None:
    try:
        hint = repo.get_hint(digest)
    except ObjectMissing:
        log.warning("hint %s (%s) is missing from the store; ignored", short(digest), source)
        return None
    except (WeenvError, FormatError) as e:
        log.warning("hint %s (%s) cannot be used: %s", short(digest), source, e)
        return None
    why = check_hint(hint, bound, indexes)
    if why is not None:
        log.warning("hint %s (%s) ignored: %s", short(digest), source, why)
        return None
    return FoundHint(digest, source, hint)


def publish_hint(repo: Repository, hint: Hint, tag: str) -> str:
    """Store `hint`, then point `tags/hints/<its manifest>/<tag>` at it; return its digest."""
    digest = repo.put_object("hints", encode_hint(hint))
    repo.set_tag("hints", hint.manifest, tag, digest)
    log.info("published hint %s (%d chunks, %d files) as %s:%s", short(digest),
             len(hint.records), len(hint.files), short(hint.manifest), tag)
    return digest


def publish_run(
    repo: Repository,
    manifest_digest: str,
    manifest: Manifest,
    indexes: Sequence[GroupIndex],
    run: Sequence[HintRecord],
    tag: str = DEFAULT_TAG,
    *,
    replace: bool = False,
    max_records: int = DEFAULT_MAX_RECORDS,
    files: Sequence[HintFile] = (),
) -> tuple[str, Hint] | None:
    """Merge the recorded `run` (and the `files` it read) into the hint `tag` points at
    (unless `replace`), publish the result under `tag` and return (digest, hint); None when
    there is nothing to publish.

    The earlier hint counts as one run, so the merged order leans towards recent runs. Two
    mounts publishing under one tag at once: the last one wins (a lost run, never a broken
    hint)."""
    check_tag(tag)
    if not run:
        log.info("nothing was read: no hint published")
        return None
    runs: list[Sequence[HintRecord]] = [run]
    file_runs: list[Sequence[HintFile]] = [files]
    if not replace:
        earlier = _earlier(repo, manifest_digest, indexes, tag)
        if earlier is not None:
            runs.insert(0, earlier.records)
            file_runs.insert(0, earlier.files)
    hint = Hint(manifest_digest, merge_runs(runs, max_records),
                merge_runs(file_runs, min(max_records, C.MAX_HINT_FILES)))
    return publish_hint(repo, hint, tag), hint


def _earlier(
    repo: Repository, manifest_digest: str, indexes: Sequence[GroupIndex], tag: str
) -> Hint | None:
    try:
        digest = repo.get_tag("hints", manifest_digest, tag)
    except RefNotFound:
        return None
    found = _load(repo, digest, f"tag {tag}", manifest_digest, indexes)
    return None if found is None else found.hint


def has_hint(repo: Repository, manifest_digest: str, manifest: Manifest,
             tag: str = DEFAULT_TAG) -> bool:
    """Whether the environment has a hint a mount would try: tag `tag`, or the manifest's
    own `hints` field (whether it is usable is `find_hint`'s business)."""
    if manifest.hints is not None:
        return True
    try:
        repo.get_tag("hints", manifest_digest, tag)
    except RefNotFound:
        return False
    return True


# -- for a mounted environment --------------------------------------------------------------


def may_have_hint(env: LoadedEnv, spec: str, cache_dir: Path | None = None) -> bool:
    """Whether `spec` (`--hint`: a tag, a hint digest, none) may name a hint of `env`: a
    digest does; a tag if it exists or the manifest names a hint, `latest` also if the seed
    exists (one LIST of the environment's hint tags, or a GET or two where the store cannot
    list; a store that cannot be reached or another store error: maybe, the replay will
    say). `latest` also without asking the store when a start on the node with `cache_dir`
    saw it (node_copies.py `known_hinted`: `weenv run` marks it before it mounts, so the
    replay of a hinted environment starts a store round trip sooner)."""
    if spec == NO_HINT:
        return False
    if HINT_DIGEST.fullmatch(spec) or env.manifest.hints is not None:
        return True
    if spec == DEFAULT_TAG and cache_dir is not None and known_hinted(cache_dir, env.digest):
        return True
    repo = Repository(env.store)
    wanted = {spec, SEED_TAG} if spec == DEFAULT_TAG else {spec}
    try:
        return bool(wanted & repo.tag_names("hints", env.digest))
    except StoreUnavailable:
        return True  # the GETs would fail the same way, each after its retries
    except (StoreError, FormatError):
        pass  # a store that cannot list: its tags one by one
    try:
        return has_hint(repo, env.digest, env.manifest, spec) or (
            spec == DEFAULT_TAG and has_hint(repo, env.digest, env.manifest, SEED_TAG))
    except (StoreError, FormatError):
        return True


def env_hint_lookup(env: LoadedEnv, spec: str = DEFAULT_TAG) -> Callable[[], FoundHint | None]:
    """A call (for a thread) that finds the hint `spec` names for `env` (see `find_hint`)."""
    return functools.partial(
        find_hint, Repository(env.store), env.digest, env.manifest, env.tree.groups, spec
    )


def publish_env_run(
    env: LoadedEnv, run: Sequence[HintRecord], tag: str = DEFAULT_TAG, *, replace: bool = False,
    files: Sequence[HintFile] = (),
) -> tuple[str, Hint] | None:
    """`publish_run` for the environment `env` was loaded as."""
    return publish_run(
        Repository(env.store), env.digest, env.manifest, env.tree.groups, run, tag,
        replace=replace, files=files,
    )
