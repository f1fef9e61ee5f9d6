"""Reading file data out of a store, for the read-side tools (export, verify).

Owns: turning chunk records of a group index into verified plaintext: adjacent frames of one
blob are fetched with a single ranged read, every frame is decoded and checked against its
BLAKE3 digest (`format.chunk.decode_chunk`) before a byte is returned, zero chunks are
produced without any I/O, and a small LRU of decoded chunks makes batch chunks shared by many
small files cost one fetch. Files are streamed piece by piece, never held whole in memory.

Must not: write anything, cache on disk, or know about FUSE (the node has its own fetcher in
weenvfs/core). Synchronous: the tools run in plain threads.
"""

from __future__ import annotations

import io
import logging
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from weenvfs.errors import ObjectCorrupt, ObjectMissing, RefNotFound, StoreError, WeenvError
from weenvfs.format.chunk import decode_chunk
from weenvfs.format.compose import ComposedTree
from weenvfs.format.digest import short
from weenvfs.format.errors import FormatError
from weenvfs.format.index import ChunkRecord, GroupIndex, file_spans
from weenvfs.format.manifest import Manifest
from weenvfs.format.refs import object_key, parse_name_tag
from weenvfs.format.validate import check_tree
from weenvfs.store.base import Store
from weenvfs.store.repository import Repository

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 32 << 20
DEFAULT_MAX_REQUEST = 8 << 20  # bytes of frames fetched by one ranged read, at most
_ZERO_PIECE = 1 << 20  # holes are handed out as zeros in pieces of at most this size
# Marks a zero chunk in the queue of iter_chunks (by identity; an empty cached chunk that
# happened to be this very object would read the same: empty).
_ZERO = b""


class Piece(NamedTuple):
    """Bytes [offset, offset + length) of a file; `data` is None for a hole (all zeros)."""

    offset: int
    length: int
    data: bytes | memoryview | None


class ChunkResult(NamedTuple):
    """The outcome of fetching chunk record `number`: its plaintext, or why it failed."""

    number: int
    record: ChunkRecord
    plain: bytes | None
    error: WeenvError | None


class ChunkReader:
    """Fetches and verifies chunks of group indexes from `store`.

    `cache_bytes` bounds the LRU of decoded chunks (keyed by the plaintext digest, so one
    cache serves every group); only chunks of single-chunk files are cached, because those
    are the batch chunks many small files share. Counters: `requests`, `fetched_bytes`.
    """

    def __init__(
        self,
        store: Store,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_request: int = DEFAULT_MAX_REQUEST,
    ) -> None:
        self.store = store
        self.cache_bytes = cache_bytes
        self.max_request = max_request
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cached = 0
        self.requests = 0
        self.fetched_bytes = 0

    # -- chunks -----------------------------------------------------------------------------

    def iter_chunks(
        self, index: GroupIndex, numbers: Sequence[int], *, cache: bool = False
    ) -> Iterator[ChunkResult]:
        """A `ChunkResult` for each chunk record in `numbers`, in that order.

        Errors are returned, not raised, so a caller can report every bad chunk (verify);
        a failed ranged read fails every chunk it covered. Zero chunks and cache hits need
        no fetch and do not interrupt a run of adjacent frames. With `cache`, decoded chunks
        are kept in (and served from) the LRU.
        """
        run: list[tuple[int, ChunkRecord]] = []
        queue: list[tuple[int, ChunkRecord, bytes | None]] = []  # None: from the run
        for n in numbers:
            rec = index.chunk(n)
            known = _ZERO if rec.zero else self._cache_get(rec.digest) if cache else None
            if known is None:
                if run and not self._extends(run, rec):
                    yield from self._drain(index, run, queue, cache)
                    run, queue = [], []
                run.append((n, rec))
            queue.append((n, rec, known))
        yield from self._drain(index, run, queue, cache)

    def _drain(
        self,
        index: GroupIndex,
        run: list[tuple[int, ChunkRecord]],
        queue: list[tuple[int, ChunkRecord, bytes | None]],
        cache: bool,
    ) -> Iterator[ChunkResult]:
        """Fetch `run`, then hand out the queued results in their order."""
        fetched = self._flush(index, run, cache)
        for n, rec, known in queue:
            if known is None:
                yield next(fetched)
            else:
                yield ChunkResult(n, rec, bytes(rec.ulen) if known is _ZERO else known, None)

    def _extends(self, run: list[tuple[int, ChunkRecord]], rec: ChunkRecord) -> bool:
        """Whether `rec`'s frame directly follows the run's frames in the same blob."""
        first, last = run[0][1], run[-1][1]
        return (
            rec.blob == last.blob
            and rec.offset == last.offset + last.clen
            and rec.offset + rec.clen - first.offset <= self.max_request
        )

    def _flush(
        self, index: GroupIndex, run: list[tuple[int, ChunkRecord]], cache: bool
    ) -> Iterator[ChunkResult]:
        """Fetch a run of adjacent frames with one ranged read and decode each."""
        if not run:
            return
        first, last = run[0][1], run[-1][1]
        blob = index.blob_digest(first.blob)
        start, length = first.offset, last.offset + last.clen - first.offset
        try:
            data = self.store.get_range(object_key("blobs", blob), start, length)
        except StoreError as error:
            for n, rec in run:
                yield ChunkResult(n, rec, None, error)
            return
        self.requests += 1
        self.fetched_bytes += length
        view = memoryview(data)
        for n, rec in run:
            frame = view[rec.offset - start : rec.offset - start + rec.clen]
            try:
                plain = decode_chunk(frame, rec.digest, rec.ulen)
            except FormatError as error:
                where = f"chunk {short(rec.digest)} (blobs/{short(blob)} at {rec.offset})"
                yield ChunkResult(n, rec, None, ObjectCorrupt(f"{where}: {error}"))
                continue
            if cache:
                self._cache_put(rec.digest, plain)
            yield ChunkResult(n, rec, plain, None)

    def _cache_get(self, digest: bytes) -> bytes | None:
        plain = self._cache.get(digest)
        if plain is not None:
            self._cache.move_to_end(digest)
        return plain

    def _cache_put(self, digest: bytes, plain: bytes) -> None:
        if len(plain) > self.cache_bytes or digest in self._cache:
            return
        self._cache[digest] = plain
        self._cached += len(plain)
        while self._cached > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)

    # -- files ------------------------------------------------------------------------------

    def iter_pieces(self, index: GroupIndex, ino: int) -> Iterator[Piece]:
        """The data of regular file `ino` in file order; holes (zero chunks) as data=None.

        Memory stays bounded by one ranged read whatever the file's size.
        """
        size = index.inode(ino).size
        spans = file_spans(index, ino, 0, size)
        single = len(spans) == 1
        pos = 0
        results = self.iter_chunks(index, [s.chunk for s in spans], cache=single)
        for span, result in zip(spans, results, strict=True):
            length = span.end - span.start
            if result.error is not None:
                raise result.error
            if result.record.zero:
                yield Piece(pos, length, None)
            else:
                assert result.plain is not None
                yield Piece(pos, length, memoryview(result.plain)[span.start : span.end])
            pos += length

    def iter_file(self, index: GroupIndex, ino: int) -> Iterator[bytes | memoryview]:
        """The bytes of regular file `ino` in order, holes as zeros; concatenated = the file."""
        for piece in self.iter_pieces(index, ino):
            if piece.data is not None:
                yield piece.data
                continue
            left = piece.length
            while left:
                step = min(left, _ZERO_PIECE)
                yield bytes(step)
                left -= step

    def read_file(self, index: GroupIndex, ino: int) -> bytes:
        """The whole content of regular file `ino` (for small files and tests)."""
        return b"".join(self.iter_file(index, ino))

    def open_file(self, index: GroupIndex, ino: int) -> io.BufferedReader:
        """Regular file `ino` as a stream (holes as zeros), read piece by piece."""
        return io.BufferedReader(_Pieces(self.iter_file(index, ino)), _ZERO_PIECE)


class _Pieces(io.RawIOBase):
    """Pieces of bytes as a raw stream."""

    def __init__(self, pieces: Iterator[bytes | memoryview]) -> None:
        self._pieces = pieces
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        while not self._buf:
            nxt = next(self._pieces, None)
            if nxt is None:
                return 0
            self._buf = memoryview(nxt)
        n = min(len(buf), len(self._buf))
        buf[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


# -- environments and groups --------------------------------------------------------------------


class LoadedGroup(NamedTuple):
    """A verified, decoded group index and the size of its stored object."""

    name: str
    digest: str
    index: GroupIndex
    stored_size: int


class LoadedEnv(NamedTuple):
    """An environment: its manifest digest, the manifest, and its groups lowest first."""

    digest: str
    manifest: Manifest
    groups: list[LoadedGroup]

    def tree(self) -> ComposedTree:
        """The composed tree of the groups (OCI union semantics)."""
        return ComposedTree([g.index for g in self.groups])


def load_group(repo: Repository, digest: str, name: str = "") -> LoadedGroup:
    """Fetch, verify, decode and validate (`check_tree`) index `digest` (`RefNotFound` if it
    is missing)."""
    try:
        data = repo.get_object("indexes", digest)
    except ObjectMissing:
        what = f"group {name!r} index" if name else "group index"
        raise RefNotFound(f"{what} {short(digest)} is missing from {repo.store.url}") from None
    index = GroupIndex.from_object(data)
    check_tree(index)
    return LoadedGroup(name, digest, index, len(data))


def load_env(repo: Repository, ref: str) -> LoadedEnv:
    """Resolve `ref` (NAME[:TAG] or manifest digest) and load every group index."""
    digest, manifest = repo.resolve_env(ref)
    groups = [load_group(repo, g.index, g.name) for g in manifest.groups]
    return LoadedEnv(digest, manifest, groups)


def load_group_ref(repo: Repository, ref: str) -> LoadedGroup:
    """Resolve a group `ref` (NAME[:TAG] or index digest) and load its index."""
    digest, index = repo.resolve_group(ref)
    check_tree(index)
    name = "" if digest in ref else ref
    return LoadedGroup(name, digest, index, repo.store.size(object_key("indexes", digest)))


_DIGEST_REF = re.compile(r"(?:blake3:|@)?([0-9a-f]{64})")


def resolve_digest(repo: Repository, kind: str, ref: str) -> str:
    """The digest `ref` names without fetching the object: a digest as is (optionally
    `blake3:` or `@` prefixed, as Repository accepts), or the target of tag `NAME[:TAG]` of
    `kind` ("envs" or "groups"); `RefNotFound` if there is no such tag."""
    m = _DIGEST_REF.fullmatch(ref)
    if m:
        return m.group(1)
    name, tag = parse_name_tag(ref, "environment" if kind == "envs" else "group")
    return repo.get_tag(kind, name, tag)
