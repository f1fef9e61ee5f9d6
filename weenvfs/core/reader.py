"""File reads: (inode, offset, size) -> chunk pieces -> bytes from the fetcher.

Owns: turning a read of a regular file into the chunk pieces that hold it
(`weenvfs.format.index.file_spans`, a division since chunks have a fixed size) and their
`ChunkLoc`s, and read-ahead: when a file is read sequentially, the next chunks of that file are
handed to `Fetcher.schedule_prefetch` as a stream (background, fetched beside the demand reads
rather than after them: they are the reader's next demand reads; the fetcher drops read-ahead
when too much is queued or its `serve()` is not running), `readahead` chunks at first and twice
as many at each chunk the reader goes on into, up to `stream_ahead` bytes, as the kernel grows
its own read-ahead window (a long read from the store went one GET at a time with a fixed two
chunks, gated behind the demand read waiting for the chunk before them); and the cached files of
the chunks up to `advise_ahead` are read into memory by the kernel in the background
(`Fetcher.advise`: local disk only, so it may go further).

Demand overlap: the first read of a multi-chunk file also queues the rest of that file, up to
`first_ahead` bytes (the chunks after the read, then those before it), so a cold reader that
goes on through the file (a loader mapping a library, an interpreter reading a module) finds
its next chunks in flight instead of waiting for the store once per chunk. It is a prefetch
like read-ahead: bounded per file, dropped by the fetcher under load, fetched only while no
demand read waits, and cancelled with the fetcher's `serve()` at unmount.

Must not: fetch, verify or cache chunks itself (core/fetcher.py and core/cache.py do), or
import pyfuse3. Errors of the fetcher (`ChunkUnavailable`, `ChunkCorrupt`) pass through.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from weenvfs.format.index import file_spans

from .chunk_plan import ChunkLoc, chunk_loc
from .fetcher import Fetcher
from .tree import Tree

if TYPE_CHECKING:
    from .node_hints import HintRecorder

log = logging.getLogger(__name__)

DEFAULT_READAHEAD = 2  # chunks queued ahead of a sequential reader at first (from the store)
# Bytes queued ahead of a long sequential reader at most (its window doubles per chunk read).
DEFAULT_STREAM_AHEAD = 16 << 20
# Chunks whose cached files the kernel reads ahead of a sequential reader. The local disk's
# own read-ahead (8 MiB here) does not cross chunk files; this does (benchmarks/read.py).
DEFAULT_ADVISE_AHEAD = 8
# Bytes of a file queued when a read first touches it (a whole file up to this size). Four
# 1 MiB chunks: most libraries and modules fit, and a huge file costs at most this much.
DEFAULT_FIRST_AHEAD = 4 << 20
_TRACKED = 4096  # files whose read position is remembered for sequential detection

Piece = tuple[ChunkLoc, int, int]  # bytes [start, end) of one chunk's plaintext


class Reader:
    """Reads file data of `tree` through `fetcher`; `readahead` chunks ahead when sequential."""

    def __init__(
        self,
        tree: Tree,
        fetcher: Fetcher,
        readahead: int = DEFAULT_READAHEAD,
        advise_ahead: int = DEFAULT_ADVISE_AHEAD,
        first_ahead: int = DEFAULT_FIRST_AHEAD,
        stream_ahead: int = DEFAULT_STREAM_AHEAD,
    ) -> None:
        self.tree = tree
        self.fetcher = fetcher
        self.readahead = readahead
        self.stream_ahead = stream_ahead
        self.advise_ahead = advise_ahead
        self.first_ahead = first_ahead
        # Set by a mount that records a prefetch hint (core/node_hints.py): sees every chunk read.
        self.recorder: HintRecorder | None = None
        # inode -> (end of the last read, highest chunk position queued for read-ahead,
        # highest chunk position advised, chunks to queue ahead of the next sequential read)
        self._positions: OrderedDict[int, tuple[int, int, int, int]] = OrderedDict()

    def pieces(self, inode: int, offset: int, size: int) -> list[Piece]:
        """The chunk pieces holding bytes [offset, offset + size) of regular file `inode`,
        clipped at end of file (empty past it)."""
        index, ino = self.tree.file(inode)
        spans = file_spans(index, ino, offset, size)
        if self.recorder is not None:
            self.recorder.note(inode, spans)
        return [(chunk_loc(index, span.chunk), span.start, span.end) for span in spans]

    async def read(self, inode: int, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) of regular file `inode` (short at end of file)."""
        pieces = self.pieces(inode, offset, size)
        if not pieces:
            return b""
        if self.readahead:
            self._note_read(inode, offset, offset + size)
        return await self.fetcher.read(pieces)

    def read_cached(self, inode: int, offset: int, size: int) -> bytes | None:
        """What `read` returns, at once, when every chunk it needs is cached and verified in
        this process (`Fetcher.read_cached`); None otherwise (then `await read(...)`)."""
        pieces = self.pieces(inode, offset, size)
        if not pieces:
            return b""
        data = self.fetcher.read_cached(pieces)
        if data is not None and self.readahead:
            self._note_read(inode, offset, offset + size)
        return data

    def note_served(self, inode: int, offset: int, size: int, follows: bool) -> None:
        """A read of bytes [offset, offset + size) of `inode` that was served without this
        process (the kernel path's native device server reports a file's first read and each
        read that reaches a new chunk of it): recorded, and read ahead from, as `read` would."""
        if self.pieces(inode, offset, size) and self.readahead:
            if follows:
                self.continued(inode, offset)
            self._note_read(inode, offset, offset + size)

    def continued(self, inode: int, offset: int) -> None:
        """The reader of `inode` read on up to `offset` where this process did not see it (the
        native device server served those reads): the next read from there is sequential."""
        known = self._positions.get(inode)
        if known is not None:
            self._positions[inode] = (offset, *known[1:])

    # -- read-ahead -------------------------------------------------------------------------

    def _note_read(self, inode: int, start: int, end: int) -> None:
        """Remember where a read ended; queue the next chunks if it continued the last one."""
        known = self._positions.pop(inode, None)
        if known is None:
            last_end, advised, window = -1, -1, self.readahead
            queued = self._queue_first(inode, start, end) if self.first_ahead > 0 else -1
        else:
            last_end, queued, advised, window = known
        if start == last_end:
            queued, advised, window = self._queue_after(inode, last_end, end, queued, advised,
                                                        window)
        self._positions[inode] = (end, queued, advised, window)
        if len(self._positions) > _TRACKED:
            self._positions.popitem(last=False)

    def _queue_first(self, inode: int, start: int, end: int) -> int:
        """The first read of `inode` covered [start, end): queue the file's other chunks, those
        after the read first, up to `first_ahead` bytes; return the highest position queued
        after the read (-1: none), where sequential read-ahead goes on from."""
        index, ino = self.tree.file(inode)
        chunks = index.file_chunks(ino)
        if len(chunks) <= 1:
            return -1
        first = start // index.chunk_size
        last = min((max(end, start + 1) - 1) // index.chunk_size, len(chunks) - 1)
        budget = max(self.first_ahead // index.chunk_size, 1)
        after = list(range(last + 1, min(last + 1 + budget, len(chunks))))
        before = list(range(max(first - (budget - len(after)), 0), first))
        if not after and not before:
            return -1
        locs = [chunk_loc(index, chunks[k]) for k in after + before]
        if not self.fetcher.schedule_prefetch(locs) or not after:
            return -1
        return after[-1]

    def _queue_after(self, inode: int, last_end: int, end: int, queued: int, advised: int,
                     window: int) -> tuple[int, int, int]:
        """A read continued the last one (which ended at `last_end`) up to `end`: the window
        doubles if it went on into a new chunk (up to `stream_ahead`); queue, as a stream, up
        to `window` chunks after the one holding byte `end - 1` once no more than half that
        many are queued ahead of it (so a stream goes out in batches the fetcher sends as few
        large requests, not a 1 MiB request per chunk read: a ranged GET costs SeaweedFS nearly
        as much at 1 MiB as at 4), and advise the next ones up to `advise_ahead`; return the
        highest chunk positions now queued and advised, and the window."""
        index, ino = self.tree.file(inode)
        chunks = index.file_chunks(ino)
        if len(chunks) <= 1:
            return queued, advised, window
        current = (end - 1) // index.chunk_size
        if current > (last_end - 1) // index.chunk_size:  # on into a new chunk
            window = min(window * 2, max(self.readahead, self.stream_ahead // index.chunk_size))
        first = max(current + 1, queued + 1)
        last = min(current + window, len(chunks) - 1)
        if first <= last and queued - current <= window // 2:
            locs = [chunk_loc(index, chunks[k]) for k in range(first, last + 1)]
            # Dropped (a hint only): a later sequential read may queue it again.
            if self.fetcher.schedule_prefetch(locs, stream=True):
                queued = last
        near = max(current + window + 1, advised + 1)
        far = min(current + self.advise_ahead, len(chunks) - 1)
        if near <= far:
            self.fetcher.advise([chunk_loc(index, chunks[k]) for k in range(near, far + 1)])
            advised = far
        return queued, advised, window
