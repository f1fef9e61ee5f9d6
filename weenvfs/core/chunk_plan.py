"""Where chunks are and how they are asked for: `ChunkLoc` (everything needed to fetch and
verify one chunk), `chunk_loc` (from a group index), and `plan_requests`, which groups chunks
into ranged GETs (same blob, adjacent, small holes read through, bounded size).

Must not: fetch, cache or schedule anything (fetcher.py does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from weenvfs.format.index import GroupIndex

DEFAULT_COALESCE_GAP = 64 << 10  # read through at most this many unneeded bytes
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


class ChunkLoc(NamedTuple):
    """Everything needed to fetch and verify one chunk."""

    digest: bytes  # 32 raw bytes, BLAKE3 of the plaintext
    blob: str | None  # blob hex digest; None = all-zero chunk (never fetched)
    offset: int  # compressed offset in the blob
    clen: int  # compressed length
    ulen: int  # plaintext length


Span = tuple[ChunkLoc, int, int]  # bytes [start, end) of one chunk's plaintext


def chunk_loc(index: GroupIndex, n: int) -> ChunkLoc:
    """The location of chunk number `n` of `index`."""
    rec = index.chunk(n)
    blob = None if rec.zero else index.blob_digest(rec.blob)
    return ChunkLoc(rec.digest, blob, rec.offset, rec.clen, rec.ulen)


def plan_requests(locs: Iterable[ChunkLoc], gap: int, max_bytes: int) -> list[list[ChunkLoc]]:
    """Group chunks into ranged requests: same blob, sorted by offset, merged while the hole
    between neighbours is at most `gap` bytes and the range at most `max_bytes` (a single chunk
    bigger than that is still one request). Zero chunks and duplicates are dropped."""
    unique = {loc.digest: loc for loc in locs if loc.blob is not None}
    runs: list[list[ChunkLoc]] = []
    run_end = run_start = 0
    for loc in sorted(unique.values(), key=lambda c: (c.blob, c.offset)):
        end = loc.offset + loc.clen
        if (
            runs
            and runs[-1][0].blob == loc.blob
            and loc.offset - run_end <= gap
            and max(end, run_end) - run_start <= max_bytes
        ):
            runs[-1].append(loc)
            run_end = max(run_end, end)
        else:
            runs.append([loc])
            run_start, run_end = loc.offset, end
    return runs
