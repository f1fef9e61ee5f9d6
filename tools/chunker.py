"""Cutting file data into chunks, deduplicating them, and packing new ones into blob files.

Owns: fixed-size chunking of large files (all-zero chunks become zero chunks, holes that are
never stored), batching of small files into shared chunks (a batch closes before it would
pass `chunk_size`), dedup (chunk digest -> ChunkRef for large-file chunks and whole batches,
whole-file digest -> (ChunkRef, inner offset, size) for small files), seeded from earlier
indexes and from the build itself, and writing the new chunks' zstd frames into temporary
blob files that roll over at `max_blob_size`, each hashed as it is written.

Hint-ordered layout (layout.py): with a `LayoutOrder`, the chunks and small files it ranks
are written into their own blob(s), in rank order, after everything else: their frames are
spooled to a file in the work directory as they come, and hinted small files are batched in
rank order at the end. A ranked chunk is written again even when an earlier index has it,
since reusing it would keep the old layout (rewriting identical frames in the same order gives
the same blob, so a rebuild with the same hint uploads nothing new).

Determinism: every decision (dedup, batch boundaries, frame order, blob rollover) is taken
on the calling thread in input order; only compression runs in a thread pool (zstandard and
blake3 release the GIL), and frames are written in submission order. Same input and options,
same blobs byte for byte, same index.

Must not: upload anything (publish.py) or decide which earlier indexes to trust
(builder.py). It reads each file's data exactly once, in order, so it works on tar streams.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import blake3

from weenvfs.format import constants as C
from weenvfs.format.chunk import DEFAULT_LEVEL, encode_chunk
from weenvfs.format.digest import digest_bytes, short
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import ChunkRef, Node

from .entries import DataStream, Entry
from .layout import HintedSpool, LayoutOrder

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOB_SIZE = 256 << 20
_MAX = 1 << 64


@dataclass(frozen=True)
class ChunkOptions:
    """How data is cut, compressed and packed."""

    chunk_size: int = C.DEFAULT_CHUNK_SIZE
    batch_threshold: int = C.DEFAULT_BATCH_THRESHOLD
    level: int = DEFAULT_LEVEL
    max_blob_size: int = DEFAULT_MAX_BLOB_SIZE
    workers: int = 0  # 0: one per CPU, at most 8

    def __post_init__(self) -> None:
        if not C.MIN_CHUNK_SIZE <= self.chunk_size <= C.MAX_CHUNK_SIZE:
            raise ValueError(
                f"chunk size {self.chunk_size} outside {C.MIN_CHUNK_SIZE}..{C.MAX_CHUNK_SIZE}"
            )
        if not 0 <= self.batch_threshold <= self.chunk_size:
            raise ValueError(f"batch threshold {self.batch_threshold} outside 0..chunk size")
        if self.max_blob_size < 1:
            raise ValueError("max blob size must be positive")

    @property
    def thread_count(self) -> int:
        return self.workers or min(8, os.cpu_count() or 1)


class _Slot:
    """A chunk of this build whose frame is not written (or whose blob is not closed) yet.

    A batch slot gets its digest when the batch closes; if that batch already exists, the
    slot becomes an alias of the existing ChunkRef instead of being written.
    """

    __slots__ = ("digest", "ulen", "blob_seq", "offset", "clen", "alias")

    def __init__(self, digest: bytes = b"", ulen: int = 0) -> None:
        self.digest, self.ulen = digest, ulen
        self.blob_seq = self.offset = self.clen = -1
        self.alias: ChunkRef | _Slot | None = None


_Chunk = ChunkRef | _Slot


class DedupTable:
    """What the build may reuse: chunks by plaintext digest, small files by file digest."""

    def __init__(self) -> None:
        self.chunks: dict[bytes, _Chunk] = {}
        self.files: dict[bytes, tuple[_Chunk, int, int]] = {}

    def add_index(self, index: GroupIndex) -> None:
        """Seed from an earlier index: its stored chunks and its small files' digests."""
        blobs = index.blob_digests()
        for n in range(index.header.chunk_count):
            rec = index.chunk(n)
            if not rec.zero:
                ref = ChunkRef(rec.digest, blobs[rec.blob], rec.offset, rec.clen, rec.ulen)
                self.chunks.setdefault(rec.digest, ref)
        for ino, file_digest in index.file_digests():
            chunks = index.file_chunks(ino)
            rec = index.chunk(chunks[0]) if len(chunks) == 1 else None
            if rec is None or rec.zero:
                continue
            ref = ChunkRef(rec.digest, blobs[rec.blob], rec.offset, rec.clen, rec.ulen)
            inode = index.inode(ino)
            self.files.setdefault(file_digest, (ref, inode.inner_offset, inode.size))


@dataclass
class ChunkStats:
    """Counts of one build. New and reused chunks are counted once each, by digest;
    `files_reused` counts small files matched by whole-file digest."""

    bytes_in: int = 0
    chunks_new: int = 0
    bytes_new: int = 0
    bytes_new_compressed: int = 0
    chunks_reused: int = 0
    bytes_reused: int = 0
    bytes_reused_compressed: int = 0
    chunks_zero: int = 0
    bytes_zero: int = 0
    files_reused: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class BlobFile:
    """A finished blob: its digest, its temporary file, its size and chunk count."""

    digest: str
    path: Path
    size: int
    chunks: int


class _BlobWriter:
    """Appends frames to temp blob files under `workdir`, rolling over at `max_size`."""

    def __init__(self, workdir: Path, max_size: int, prefix: str = "blob") -> None:
        self.workdir, self.max_size, self.prefix = workdir, max_size, prefix
        self.blobs: list[BlobFile] = []
        self._file = None
        self._path: Path | None = None
        self._hasher = blake3.blake3()
        self._size = self._chunks = 0

    def write(self, frame: bytes) -> tuple[int, int]:
        """Append `frame`; return (blob sequence number, offset in that blob)."""
        if self._file is not None and self._size + len(frame) > self.max_size:
            self.close_current()
        if self._file is None:
            self._path = self.workdir / f"{self.prefix}-{len(self.blobs):05d}"
            self._file = open(self._path, "wb")  # noqa: SIM115 - closed in close_current
            self._hasher = blake3.blake3()
            self._size = self._chunks = 0
        offset = self._size
        self._file.write(frame)
        self._hasher.update(frame)
        self._size += len(frame)
        self._chunks += 1
        return len(self.blobs), offset

    def close_current(self) -> None:
        if self._file is None or self._path is None:
            return
        self._file.close()
        self._file = None
        blob = BlobFile(self._hasher.hexdigest(), self._path, self._size, self._chunks)
        self.blobs.append(blob)
        log.debug("blob %s: %d chunks, %d bytes", short(blob.digest), blob.chunks, blob.size)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Chunker:
    """Turns the data of regular files into ChunkRefs on their Nodes (see module doc)."""

    def __init__(
        self,
        options: ChunkOptions,
        workdir: Path,
        dedup: DedupTable | None = None,
        on_bytes: Callable[[int], None] | None = None,
        order: LayoutOrder | None = None,
    ) -> None:
        self.options = options
        self.table = dedup or DedupTable()
        self.stats = ChunkStats()
        self._on_bytes = on_bytes or (lambda n: None)
        self._pool = ThreadPoolExecutor(options.thread_count, thread_name_prefix="weenv-zstd")
        self._queue: deque[tuple[_Slot, Future[bytes], int | None]] = deque()
        self._max_inflight = 2 * options.thread_count
        self._writer = _BlobWriter(workdir, options.max_blob_size)
        self._files: list[tuple[Node, list[_Chunk]]] = []
        self._batch: list[bytes] = []
        self._batch_len = 0
        self._batch_slot: _Slot | None = None
        self._reused: set[bytes] = set()
        self._zero_digests: dict[int, bytes] = {}
        self._zeros = bytes(options.chunk_size)
        self._hinted = None
        if order:
            writer = _BlobWriter(workdir, options.max_blob_size, prefix="hinted-blob")
            self._hinted = HintedSpool(order, workdir / "hinted.spool", writer, _Slot)

    # -- input ------------------------------------------------------------------------------

    def add_file(self, node: Node, entry: Entry) -> None:
        """Read `entry`'s data (once, in order) and attach its chunks to `node`."""
        node.size = entry.size
        if entry.size == 0:
            return
        if entry.open_data is None:
            raise ValueError(f"regular file {entry.path!r} without data")
        stream = entry.open_data()
        try:
            if entry.size < self.options.batch_threshold:
                self._small(node, stream.read_exact(entry.size, entry.path))
            else:
                self._large(node, stream, entry)
        finally:
            stream.close()
        self.stats.bytes_in += entry.size
        self._on_bytes(entry.size)

    def _small(self, node: Node, data: bytes) -> None:
        file_digest = digest_bytes(data)
        node.file_digest = file_digest
        if self._hinted is not None and file_digest in self._hinted.order.files:
            if file_digest in self._hinted.small:
                self.stats.files_reused += 1
            self._files.append((node, [self._hinted.add_small(node, file_digest, data)]))
            return
        known = self.table.files.get(file_digest)
        if known is not None:
            chunk, node.inner_offset, _ = known
            self.stats.files_reused += 1
            self._note_reuse(chunk)
        else:
            if self._batch_len + len(data) > self.options.chunk_size:
                self._close_batch()
            if self._batch_slot is None:
                self._batch_slot = _Slot()
            chunk = self._batch_slot
            node.inner_offset = self._batch_len
            self._batch.append(data)
            self._batch_len += len(data)
            self.table.files[file_digest] = (chunk, node.inner_offset, len(data))
        self._files.append((node, [chunk]))

    def _large(self, node: Node, stream: DataStream, entry: Entry) -> None:
        size, step = entry.size, self.options.chunk_size
        extents = stream.extents
        chunks: list[_Chunk] = []
        for start in range(0, size, step):
            end = min(size, start + step)
            if extents is not None and not _overlaps(extents, start, end):
                chunks.append(self._zero(end - start))
                continue
            stream.skip(start - stream.position, entry.path)
            data = stream.read_exact(end - start, entry.path)
            if data == (self._zeros if len(data) == step else bytes(len(data))):
                chunks.append(self._zero(len(data)))
            else:
                chunks.append(self._chunk(digest_bytes(data), data))
        self._files.append((node, chunks))

    def _zero(self, length: int) -> ChunkRef:
        digest = self._zero_digests.get(length)
        if digest is None:
            digest = self._zero_digests[length] = digest_bytes(bytes(length))
        self.stats.chunks_zero += 1
        self.stats.bytes_zero += length
        return ChunkRef(digest, None, 0, 0, length)

    def _chunk(self, digest: bytes, data: bytes) -> _Chunk:
        """The chunk for `data`: an existing one with its digest, else a new one."""
        known = self.table.chunks.get(digest)
        rank = None if self._hinted is None else self._hinted.order.chunks.get(digest)
        if known is not None and (rank is None or digest in self._hinted_slots()):
            self._note_reuse(known)
            return known
        slot = _Slot(digest, len(data))
        self.table.chunks[digest] = slot
        self._submit(slot, data, rank)
        return slot

    def _hinted_slots(self) -> dict[bytes, _Slot]:
        return {} if self._hinted is None else self._hinted.slots

    def _close_batch(self) -> None:
        slot = self._batch_slot
        if slot is None:
            return
        data = b"".join(self._batch)
        self._batch, self._batch_len, self._batch_slot = [], 0, None
        slot.digest, slot.ulen = digest_bytes(data), len(data)
        known = self.table.chunks.get(slot.digest)
        if known is not None:  # the very same batch exists already
            slot.alias = known
            self._note_reuse(known)
            return
        self.table.chunks[slot.digest] = slot
        self._submit(slot, data)

    def _note_reuse(self, chunk: _Chunk) -> None:
        if isinstance(chunk, ChunkRef) and chunk.digest not in self._reused:
            self._reused.add(chunk.digest)
            self.stats.chunks_reused += 1
            self.stats.bytes_reused += chunk.ulen
            self.stats.bytes_reused_compressed += chunk.clen

    # -- compression and output -------------------------------------------------------------

    def _submit(self, slot: _Slot, data: bytes, rank: int | None = None) -> None:
        future = self._pool.submit(encode_chunk, data, self.options.level)
        self._queue.append((slot, future, rank))
        if rank is not None and self._hinted is not None:
            self._hinted.slots[slot.digest] = slot
        self.stats.chunks_new += 1
        self.stats.bytes_new += len(data)
        while len(self._queue) > self._max_inflight:
            self._write_next()

    def _write_next(self) -> None:
        slot, future, rank = self._queue.popleft()
        frame = future.result()
        if rank is not None and self._hinted is not None:
            self._hinted.spool_frame(slot, frame, rank)  # written last, in rank order
        else:
            slot.blob_seq, slot.offset = self._writer.write(frame)
        slot.clen = len(frame)
        self.stats.bytes_new_compressed += len(frame)

    def finish(self) -> list[BlobFile]:
        """Flush the last batch and frames, close the last blob, and set every file's
        ChunkRefs. Returns the new blobs (none for a build that stored nothing new)."""
        self._close_batch()
        if self._hinted is not None:
            for slot, data, rank in self._hinted.batches(self.options.chunk_size):
                self.table.chunks.setdefault(slot.digest, slot)
                self._submit(slot, data, rank)
        while self._queue:
            self._write_next()
        self._writer.close_current()
        if self._hinted is not None:
            self._writer.blobs.extend(self._hinted.write(len(self._writer.blobs)))
        self._pool.shutdown()
        names = [b.digest for b in self._writer.blobs]
        for node, chunks in self._files:
            node.chunks = [_resolve(c, names) for c in chunks]
        self._files = []
        return list(self._writer.blobs)

    def close(self) -> None:
        """Stop the workers and close open files (after a failure; the caller removes the
        work directory)."""
        self._pool.shutdown(cancel_futures=True)
        self._writer.abort()
        if self._hinted is not None:
            self._hinted.close()


def _resolve(chunk: _Chunk, blob_names: list[str]) -> ChunkRef:
    while isinstance(chunk, _Slot) and chunk.alias is not None:
        chunk = chunk.alias
    if isinstance(chunk, ChunkRef):
        return chunk
    return ChunkRef(chunk.digest, blob_names[chunk.blob_seq], chunk.offset, chunk.clen, chunk.ulen)


def _overlaps(extents: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) meets any data extent (sorted, disjoint (start, end) pairs)."""
    i = bisect.bisect_right(extents, (start, _MAX))
    # The extent starting at or before `start` may reach into the range; the next one may
    # start inside it.
    if i and extents[i - 1][1] > start:
        return True
    return i < len(extents) and extents[i][0] < end
