"""`weenv verify`: check the whole chain of trust of an environment or a group.

Owns: the list of checks and how each problem is reported. Every object is first checked
against its kind's size limit (SPEC 12.1) and refused unread if larger. Manifest: present,
hashes to its digest, decodes. Each index: present, hashes, decodes, and every record
validates (every inode, directory entry, chunk, xattr and file-digest record; names sorted and
well formed; every inode reachable as often as its link count says; multi-chunk files cut at
the chunk size). Each blob an index names: present, and every chunk frame lies inside it.
Unless `quick`: every blob is hashed whole against its digest (streamed in 8 MiB pieces, so a
10 GB blob costs bounded memory; junk no chunk record names shows only here), every chunk
frame is fetched, decompressed and checked against its digest (zero chunks against the
digest of zeros), and each file with a whole-file digest is hashed; the report lists what
`quick` skips. The manifest's hint, if any, and every hint a tag names for the manifest
(`latest`, the seed, others: what mounts replay): present, hashes, decodes, is bound to the
manifest (SPEC 9.2, 9.3) and names existing chunks; a hint's pack (SPEC 9.1): its blob
present and as long as its frames, and unless `quick` every frame decompressing to the chunk
its record names (a replay would drop a bad frame and fetch the chunk from its blob).

Every problem is collected (one line each) rather than stopping at the first; only an
unreachable store aborts the run. A chunk shared by several groups is fetched once. Must not:
change the store or repair anything.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import blake3

from weenvfs.core.kernel_image import stack_image
from weenvfs.errors import (
    ObjectMissing,
    ObjectTooLarge,
    RefNotFound,
    StoreError,
    StoreUnavailable,
)
from weenvfs.format.chunk import decode_chunk, decompress_object
from weenvfs.format.constants import MAX_IMAGE_SIZE
from weenvfs.format.digest import digest_bytes, digest_hex, short
from weenvfs.format.erofs_group import group_image
from weenvfs.format.errors import FormatError
from weenvfs.format.hints import Hint, decode_hint
from weenvfs.format.index import ROOT_INODE, GroupIndex, Inode
from weenvfs.format.manifest import Manifest, decode_manifest, encode_manifest
from weenvfs.format.refs import object_key, stored_limit, tag_key
from weenvfs.format.validate import check_tree
from weenvfs.store.repository import Repository

from .progress import Progress
from .reader import ChunkReader, resolve_digest

log = logging.getLogger(__name__)

_HASH_PIECE = 8 << 20  # bytes of a blob read (and held) at a time while hashing it
_BLOB_READS = 2  # whole reads of a blob before a digest mismatch is called corruption
# What `quick` leaves out, as said in the report (a quick "ok" must not read as a full one).
QUICK_SKIPS = ("blobs not hashed", "chunks not fetched", "file digests not checked",
               "hint pack frames not checked")


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the object it was found in (a store key) and what is wrong."""

    key: str
    message: str

    def line(self) -> str:
        """The one-line form: `kind/<short digest>: message`."""
        kind, _, digest = self.key.partition("/")
        return f"{kind}/{short(digest) if len(digest) == 64 else digest}: {self.message}"


@dataclass
class Report:
    """What `verify` found: problems and counts of what was checked."""

    ref: str
    manifest: str | None = None
    problems: list[Problem] = field(default_factory=list)
    checked: Counter[str] = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)  # checks --quick left out

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The JSON-able form (full keys)."""
        return {
            "ref": self.ref,
            "manifest": self.manifest,
            "ok": self.ok,
            "problems": [{"object": p.key, "problem": p.message} for p in self.problems],
            "checked": dict(sorted(self.checked.items())),
            "skipped": list(self.skipped),
        }


@dataclass
class _Pending:
    """Chunks of one index to fetch, and the files whose whole-file digest they check."""

    numbers: list[int] = field(default_factory=list)
    # chunk number -> (inode, start in the chunk, size, digest) of single-chunk files
    files: dict[int, list[tuple[int, int, int, bytes]]] = field(default_factory=dict)
    multi: list[tuple[int, bytes]] = field(default_factory=list)  # (inode, digest)


@dataclass
class Structure:
    """What the record-level walk of one index found."""

    problems: list[str] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # every chunk record that validates
    file_chunks: dict[int, range] = field(default_factory=dict)  # regular files that validate
    file_digests: list[tuple[int, bytes]] = field(default_factory=list)


def check_structure(index: GroupIndex) -> Structure:
    """Validate every record of `index` and the shape of its tree (no I/O)."""
    found = Structure()
    inodes: dict[int, Inode] = {}
    for ino in range(index.inode_count):
        try:
            inodes[ino] = index.inode(ino)
            _check_inode(index, ino, inodes[ino], found)
        except FormatError as error:
            found.problems.append(f"inode {ino}: {error}")
    for n in range(index.header.chunk_count):
        try:
            index.chunk(n)
            found.chunks.append(n)
        except FormatError as error:
            found.problems.append(f"chunk record {n}: {error}")
    for ino, dig in index.file_digests():
        if ino in found.file_chunks:
            found.file_digests.append((ino, dig))
        else:
            found.problems.append(f"file digest record names inode {ino}, not a valid file")
    try:
        check_tree(index)  # the validator every reader of an index applies
    except FormatError as error:
        found.problems.append(str(error))
    _check_tree(index, inodes, found)
    return found


def _check_inode(index: GroupIndex, ino: int, rec: Inode, found: Structure) -> None:
    """Per-inode checks beyond what `GroupIndex.inode` validates."""
    index.xattrs(ino)
    if rec.is_lnk:
        index.readlink(ino)
    if not rec.is_reg:
        return
    chunks = index.file_chunks(ino)
    last = len(chunks) - 1
    if last > 0:
        for k, n in enumerate(chunks):
            want = index.chunk_size if k < last else rec.size - last * index.chunk_size
            if index.chunk(n).ulen != want:
                found.problems.append(
                    f"inode {ino}: chunk {k} holds {index.chunk(n).ulen} bytes, expected {want}"
                )
    found.file_chunks[ino] = chunks


def _check_tree(index: GroupIndex, inodes: dict[int, Inode], found: Structure) -> None:
    """Directory entries (`entries` checks names and order), reachability, link counts."""
    links: Counter[int] = Counter()
    subdirs: Counter[int] = Counter()
    stack, seen_dirs = [ROOT_INODE], {ROOT_INODE}
    while stack:
        parent = stack.pop()
        count = index.entry_count(parent)
        position = 0
        while position < count:
            try:
                for _name, child in index.entries(parent, position):
                    position += 1
                    links[child] += 1
                    rec = inodes.get(child)
                    if rec is None or not rec.is_dir:
                        continue
                    subdirs[parent] += 1
                    if child not in seen_dirs:  # reached twice: reported by check_tree
                        seen_dirs.add(child)
                        stack.append(child)
            except FormatError as error:
                found.problems.append(f"directory inode {parent} entry {position}: {error}")
                position += 1
    for ino, rec in inodes.items():
        want = 2 + subdirs[ino] if rec.is_dir else links[ino]
        if ino != ROOT_INODE and not links[ino]:
            found.problems.append(f"inode {ino} is not reachable from the root")
        elif rec.nlink != want:
            found.problems.append(f"inode {ino}: link count {rec.nlink}, expected {want}")


class Verifier:
    """Runs the checks against one repository; `quick` skips fetching chunk data."""

    def __init__(
        self, repo: Repository, *, quick: bool = False, progress: Progress | None = None
    ) -> None:
        self.repo = repo
        self.store = repo.store
        self.quick = quick
        self.progress = progress
        self.reader = ChunkReader(repo.store)
        self._blob_sizes: dict[str, int | None] = {}
        self._done_frames: set[tuple[str, int, int, bytes]] = set()
        self._done_packs: set[str] = set()  # pack blobs checked (two tags may share a hint)
        self._zero_digests: dict[int, bytes] = {}
        self._done_indexes: dict[str, GroupIndex | None] = {}
        self.report = Report("")

    def _new_report(self, ref: str) -> Report:
        return Report(ref, skipped=list(QUICK_SKIPS) if self.quick else [])

    def _problem(self, key: str, message: str) -> None:
        log.debug("verify problem in %s: %s", key, message)
        self.report.problems.append(Problem(key, message))

    # -- entry points -----------------------------------------------------------------------

    def verify_env(self, ref: str) -> Report:
        """Check environment `ref` (NAME[:TAG] or manifest digest) and everything below it."""
        self.report = self._new_report(ref)
        digest = resolve_digest(self.repo, "envs", ref)
        self.report.manifest = digest
        manifest = self._manifest(digest)
        if manifest is None:
            return self.report
        indexes: list[GroupIndex | None] = []
        for g in manifest.groups:
            indexes.append(self._group(g.index, f"group {g.name!r}"))
        for position, g in enumerate(manifest.groups):
            below = indexes[: position + 1]
            if g.erofs is not None and all(index is not None for index in below):
                self._erofs(g.erofs, below, g.name)  # type: ignore[arg-type]
        if manifest.hints is not None:
            # SPEC 9.3: the manifest's own hint is bound to it with `hints` set to null.
            bound = digest_hex(encode_manifest(dataclasses.replace(manifest, hints=None)))
            self._hint(manifest.hints, bound, indexes)
        for hint in sorted(self._hint_tags(digest)):
            self._hint(hint, digest, indexes)  # what mounts replay: `latest`, the seed, ...
        return self.report

    def _hint_tags(self, digest: str) -> set[str]:
        """The hints the environment's hint tags name; a tag that names none (its content is
        not a digest) is reported, not a reason to stop."""
        found = set()
        for tag in sorted(self.repo.tag_names("hints", digest)):
            try:
                found.add(self.repo.get_tag("hints", digest, tag))
            except RefNotFound:
                continue  # deleted while listing
            except FormatError as error:
                self._problem(tag_key("hints", digest, tag),
                              f"hint tag {tag!r} cannot be read: {error}")
        return found

    def verify_group(self, ref: str) -> Report:
        """Check group `ref` (NAME[:TAG] or index digest), its blobs and chunks."""
        self.report = self._new_report(ref)
        self._group(resolve_digest(self.repo, "groups", ref), "group")
        return self.report

    # -- objects ----------------------------------------------------------------------------

    def _fetch(self, kind: str, digest: str, what: str) -> bytes | None:
        """The verified bytes of an object, or None after reporting why not."""
        key = object_key(kind, digest)
        try:
            data = self.store.get(key, stored_limit(kind))
        except ObjectMissing:
            self._problem(key, f"{what} is missing")
            return None
        except ObjectTooLarge as error:
            size = f"{error.size} bytes" if error.size is not None else "larger"
            self._problem(key, f"{what} is {size}, over the limit of {error.limit} (not read)")
            return None
        actual = digest_hex(data)
        if actual != digest:
            self._problem(key, f"{what} is corrupt: its content hashes to {short(actual)}")
            return None
        self.report.checked[kind] += 1
        return data

    def _manifest(self, digest: str) -> Manifest | None:
        data = self._fetch("manifests", digest, "manifest")
        if data is None:
            return None
        try:
            return decode_manifest(data)
        except FormatError as error:
            self._problem(object_key("manifests", digest), f"manifest does not decode: {error}")
            return None

    def _group(self, digest: str, what: str) -> GroupIndex | None:
        if digest in self._done_indexes:  # the same index twice in one manifest
            return self._done_indexes[digest]
        self._done_indexes[digest] = None
        key = object_key("indexes", digest)
        data = self._fetch("indexes", digest, f"index of {what}")
        if data is None:
            return None
        try:
            index = GroupIndex.from_object(data)
        except FormatError as error:
            self._problem(key, f"index of {what} does not decode: {error}")
            return None
        pending = self._structure(key, index)
        self._blobs(key, index, pending)
        if not self.quick:
            self._chunks(key, index, pending)
        self._done_indexes[digest] = index
        return index

    def _structure(self, key: str, index: GroupIndex) -> _Pending:
        """Record-level checks; collects the chunks and file digests to check later."""
        found = check_structure(index)
        for message in found.problems:
            self._problem(key, message)
        self.report.checked["inodes"] += index.inode_count
        self.report.checked["chunk records"] += index.header.chunk_count
        pending = _Pending(numbers=found.chunks)
        for ino, dig in found.file_digests:
            chunks = found.file_chunks.get(ino)
            if chunks is None:
                continue
            if len(chunks) == 1:
                rec = index.inode(ino)
                pending.files.setdefault(chunks[0], []).append(
                    (ino, rec.inner_offset, rec.size, dig)
                )
            else:
                pending.multi.append((ino, dig))
        return pending

    def _blobs(self, key: str, index: GroupIndex, pending: _Pending) -> None:
        """Every blob exists and holds every frame; drops chunks that cannot be fetched."""
        sizes = {}
        for n, blob in enumerate(index.blob_digests()):
            if blob not in self._blob_sizes:
                try:
                    self._blob_sizes[blob] = self.store.size(object_key("blobs", blob))
                    self.report.checked["blobs"] += 1
                except ObjectMissing:
                    self._blob_sizes[blob] = None
                if self._blob_sizes[blob] is not None and not self.quick:
                    self._hash_blob(blob, self._blob_sizes[blob])
            sizes[n] = self._blob_sizes[blob]
            if sizes[n] is None:
                self._problem(key, f"blob {short(blob)} (blob {n}) is missing from the store")
        usable = []
        for n in pending.numbers:
            rec = index.chunk(n)
            if rec.zero:
                usable.append(n)
                continue
            size = sizes[rec.blob]
            if size is None:
                continue
            if rec.offset + rec.clen > size:
                self._problem(
                    key,
                    f"chunk {n}: frame {rec.offset}+{rec.clen} extends past the end of blob "
                    f"{short(index.blob_digest(rec.blob))} ({size} bytes)",
                )
                continue
            usable.append(n)
        pending.numbers = usable

    def _hash_blob(self, blob: str, size: int | None) -> None:
        """Hash the whole blob against its digest, streamed in bounded pieces.

        Frames that decode say nothing about bytes no chunk record names (junk appended, a
        blob extended to 10 GB): only the blob's own digest does. Reported under the blob's
        key; the frames inside it are still checked one by one.
        """
        assert size is not None
        key = object_key("blobs", blob)
        # A mismatch may be damage in transit (docs/storage.md): read once more before
        # calling the stored blob corrupt.
        for _attempt in range(_BLOB_READS):
            hasher = blake3.blake3()
            offset = 0
            try:
                while offset < size:
                    piece = self.store.get_range(key, offset, min(_HASH_PIECE, size - offset))
                    if not piece:
                        break  # shrank while we read: the digest below says so
                    hasher.update(piece)
                    offset += len(piece)
            except StoreUnavailable:
                raise
            except StoreError as error:
                self._problem(key, f"blob cannot be read: {error}")
                return
            actual = hasher.hexdigest()
            if actual == blob:
                self.report.checked["blob bytes hashed"] += size
                return
        self._problem(key, f"blob is corrupt: its content hashes to {short(actual)}")

    # -- chunk data -------------------------------------------------------------------------

    def _chunks(self, key: str, index: GroupIndex, pending: _Pending) -> None:
        """Fetch, decompress and hash every usable chunk; check whole-file digests."""
        blobs = index.blob_digests()
        todo = []
        for n in pending.numbers:
            rec = index.chunk(n)
            if rec.zero:
                self._zero(key, n, rec.digest, rec.ulen, pending)
                continue
            frame = (blobs[rec.blob], rec.offset, rec.clen, rec.digest)
            if frame in self._done_frames and n not in pending.files:
                continue
            self._done_frames.add(frame)
            todo.append(n)
        todo.sort(key=lambda n: (index.chunk(n).blob, index.chunk(n).offset))
        failed: set[int] = set()
        progress = self.progress or Progress.quiet()
        progress.begin(f"verify {key[:20]}", sum(index.chunk(n).ulen for n in todo))
        # Cached: a batch chunk another group shares is fetched once for its file digests.
        for result in self.reader.iter_chunks(index, todo, cache=True):
            progress.update(result.record.ulen)
            if isinstance(result.error, StoreUnavailable):
                raise result.error
            if result.error is not None:
                failed.add(result.number)
                self._problem(key, f"chunk {result.number}: {result.error}")
                continue
            assert result.plain is not None
            self.report.checked["chunks"] += 1
            self.report.checked["chunk bytes"] += result.record.ulen
            self._file_digests(key, result.number, result.plain, pending)
        progress.end()
        self._multi_digests(key, index, pending, failed)

    def _zero(self, key: str, n: int, digest: bytes, ulen: int, pending: _Pending) -> None:
        expected = self._zero_digests.get(ulen)
        if expected is None:
            expected = self._zero_digests[ulen] = digest_bytes(bytes(ulen))
        if digest != expected:
            self._problem(key, f"chunk {n}: zero chunk of {ulen} bytes has a wrong digest")
            return
        self.report.checked["zero chunks"] += 1
        if n in pending.files:
            self._file_digests(key, n, bytes(ulen), pending)

    def _file_digests(self, key: str, n: int, plain: bytes, pending: _Pending) -> None:
        for ino, start, size, expected in pending.files.get(n, ()):
            self.report.checked["file digests"] += 1
            if digest_bytes(memoryview(plain)[start : start + size]) != expected:
                self._problem(key, f"inode {ino}: file content does not match its file digest")

    def _multi_digests(
        self, key: str, index: GroupIndex, pending: _Pending, failed: set[int]
    ) -> None:
        for ino, expected in pending.multi:
            if any(n in failed for n in index.file_chunks(ino)):
                continue  # already reported chunk by chunk
            hasher = blake3.blake3()
            try:
                for piece in self.reader.iter_file(index, ino):
                    hasher.update(piece)
            except StoreUnavailable:
                raise
            except (StoreError, FormatError) as error:
                self._problem(key, f"inode {ino}: cannot read the file: {error}")
                continue
            self.report.checked["file digests"] += 1
            if hasher.digest() != expected:
                self._problem(key, f"inode {ino}: file content does not match its file digest")

    # -- published EROFS images -------------------------------------------------------------

    def _erofs(self, digest: str, indexes: list[GroupIndex], name: str) -> None:
        """The published image of the top group of `indexes` must be exactly the one derived
        from them: from its own index for the lowest group, over the groups below it for
        the others (SPEC.md 15.9)."""
        key = object_key("erofs", digest)
        data = self._fetch("erofs", digest, f"EROFS image of group {name!r}")
        if data is None:
            return
        try:
            image = decompress_object(data, key, MAX_IMAGE_SIZE)
        except FormatError as error:
            self._problem(key, f"EROFS image does not decompress: {error}")
            return
        self.report.checked["erofs images"] += 1
        expected = (group_image(indexes[0]) if len(indexes) == 1
                    else stack_image(indexes, len(indexes) - 1))
        if image != expected:
            self._problem(key, f"EROFS image of group {name!r} is not the one its index "
                          "(and the groups below it) give")

    # -- hints ------------------------------------------------------------------------------

    def _hint(self, digest: str, bound: str, indexes: list[GroupIndex | None]) -> None:
        key = object_key("hints", digest)
        data = self._fetch("hints", digest, "hint")
        if data is None:
            return
        try:
            hint = decode_hint(data)
        except FormatError as error:
            self._problem(key, f"hint does not decode: {error}")
            return
        # A mount discards a hint bound to another manifest (SPEC 9.2): not "ok" here either.
        if hint.manifest != bound:
            self._problem(
                key, f"hint is bound to manifest {short(hint.manifest)}, not {short(bound)}"
            )
        bad = 0
        for rec in hint.records:
            index = indexes[rec.group] if rec.group < len(indexes) else None
            if rec.group >= len(indexes) or (
                index is not None and rec.chunk >= index.header.chunk_count
            ):
                bad += 1
        if bad:
            self._problem(key, f"{bad} of {len(hint.records)} hint records name no chunk")
        elif hint.pack is not None:
            self._pack(key, hint, indexes)

    def _pack(self, key: str, hint: Hint, indexes: list[GroupIndex | None]) -> None:
        """The hint's pack blob: there, long enough, and (unless quick) every frame in it
        the chunk its record names."""
        assert hint.pack is not None
        pack = hint.pack
        blob_key = object_key("blobs", pack.blob)
        if pack.blob in self._done_packs:
            return
        self._done_packs.add(pack.blob)
        try:
            size = self.store.size(blob_key)
        except ObjectMissing:
            self._problem(key, f"its pack blob {short(pack.blob)} is missing")
            return
        if size < sum(pack.lengths):
            self._problem(key, f"its pack blob {short(pack.blob)} holds {size} bytes, "
                          f"its frames {sum(pack.lengths)}")
            return
        if self.quick:
            return
        bad = []
        # Frames follow each other from offset 0: read them a piece of at most _HASH_PIECE
        # bytes at a time (a frame larger than that alone), so a pack costs bounded memory.
        piece, piece_at = b"", 0
        for i, (rec, length, offset) in enumerate(
                zip(hint.records, pack.lengths, pack.offsets(), strict=True)):
            index = indexes[rec.group]
            if not length or index is None:
                continue
            if offset + length > piece_at + len(piece):
                piece_at = offset
                piece = self.store.get_range(
                    blob_key, offset, max(length, min(_HASH_PIECE, sum(pack.lengths) - offset)))
            chunk = index.chunk(rec.chunk)
            try:
                decode_chunk(piece[offset - piece_at:offset - piece_at + length], chunk.digest,
                             chunk.ulen)
            except FormatError:
                bad.append(i)
                continue
            self.report.checked["pack frames"] += 1
        if bad:
            self._problem(key, f"{len(bad)} frame(s) of its pack blob {short(pack.blob)} are "
                          f"not the chunks their records name (first: record {bad[0]})")


def verify(
    repo: Repository,
    ref: str,
    *,
    group: bool = False,
    quick: bool = False,
    progress: Progress | None = None,
) -> Report:
    """Verify environment (or, with `group`, group) `ref`; the report lists every problem."""
    verifier = Verifier(repo, quick=quick, progress=progress)
    return verifier.verify_group(ref) if group else verifier.verify_env(ref)
