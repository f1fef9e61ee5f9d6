"""The chunks stored next to a chunk in its blob: what a cold reader with no hint is likely to
read next.

A builder packs a group's chunks into blobs in walk order (SPEC.md 5.3), so the bytes around a
chunk in its blob are the files beside it in the same folder: the other modules of a Python
package, the other libraries of a folder of shared objects. Programs read those in bursts but
in an order the blob does not follow (measured on the reference workload, issue 13: of 178
chunks read cold, 96 came from before the previous one in the blob), so sequential read-ahead
does not catch them and each became a wait for the store. Fetching the neighbourhood of every
chunk a reader waits for (up to `NEIGHBOURHOOD` bytes of the blob on each side) turned 197
waits into 72 at 512 KiB and 21 at 4 MiB (offline, the reads of the reference workload;
fetched: 61 and 146 MB of a 1.2 GB image, instead of 33). The fetcher keeps them undecoded
(core/frame_stash.py) and narrows the reach when the store is slow to send them;
benchmarks/coldstart_ref.py measures it, docs/benchmarks.md has the numbers.

Owns: the per-blob table of chunk frames sorted by offset (built on first use, from every
group's index, raw columns: a mount that never misses never pays for it), and `around(loc)`.
Must not: fetch (fetcher.py schedules what this returns) or know files.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from weenvfs.format.constants import CHUNK_ZERO
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex

from .chunk_plan import ChunkLoc, chunk_loc

# Most bytes of compressed blob on each side of a chunk a reader waited for (reference workload
# on loopback SeaweedFS, first run: waits 1.27 s at 512 KiB decoded, 0.85-1.04 s at 4 MiB
# undecoded, no better at 8 MiB; 2 MiB as fast as 4 MiB or faster in 6 alternating pairs,
# 0.80-1.01x, with ~120 MB fetched instead of 110-140 MB).
NEIGHBOURHOOD = 2 << 20


class Neighbours:
    """`around(loc)`: the chunks whose frames lie within `reach` bytes of `loc`'s in its blob."""

    def __init__(self, indexes: Sequence[GroupIndex], reach: int = NEIGHBOURHOOD) -> None:
        self.indexes = indexes
        self.reach = reach
        # blob digest -> (frame offsets ascending, (index, chunk number, frame end) of each)
        self._blobs: dict[str, tuple[list[int], list[tuple[int, int, int]]]] | None = None

    def around(self, loc: ChunkLoc, reach: int | None = None) -> list[ChunkLoc]:
        """The other chunks of `loc`'s blob whose frames lie within `reach` bytes (at most
        this table's) of its frame (inside [offset - reach, offset + clen + reach)), in blob
        order."""
        reach = self.reach if reach is None else min(reach, self.reach)
        if loc.blob is None or reach <= 0:
            return []
        if self._blobs is None:
            self._blobs = self._build()
        table = self._blobs.get(loc.blob)
        if table is None:
            return []
        offsets, owners = table
        lo = bisect.bisect_left(offsets, loc.offset - reach)
        limit = loc.offset + loc.clen + reach
        hi = bisect.bisect_left(offsets, limit)
        out = []
        for k in range(lo, hi):
            which, n, end = owners[k]
            if end > limit:
                continue
            try:
                near = chunk_loc(self.indexes[which], n)  # validated, as every read's chunks
            except FormatError:
                continue  # a damaged record is refused where a reader asks for it
            if near.digest != loc.digest:
                out.append(near)
        return out

    def _build(self) -> dict[str, tuple[list[int], list[tuple[int, int, int]]]]:
        """One pass over each index's raw chunk table (C-level unpacking); a frame shared by
        several groups (a reused chunk) is listed once."""
        frames: dict[str, dict[int, tuple[int, int, int]]] = {}
        for which, index in enumerate(self.indexes):
            blobs = index.blob_digests()
            for n, (_digest, blob, flags, offset, clen, _ulen) in enumerate(index.raw_chunks()):
                if flags & CHUNK_ZERO or blob >= len(blobs):
                    continue
                frames.setdefault(blobs[blob], {}).setdefault(offset, (which, n, offset + clen))
        out = {}
        for blob, by_offset in frames.items():
            offsets = sorted(by_offset)
            out[blob] = (offsets, [by_offset[o] for o in offsets])
        return out
