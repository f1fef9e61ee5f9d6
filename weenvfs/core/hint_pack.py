"""Packing a hint (SPEC.md 9.1, version 3): the chunks its records name, encoded again one
frame each in record order into one blob of their own, and the hint published again with the
table of their frame lengths.

Why: a replay fetches its hinted chunks in ranged requests, one per run of chunks that lie
together in their groups' blobs. Blobs hold chunks in walk order and a hint lists them in
first-access order, so the reference workload's 197 hinted chunks took 89 requests (57 with
every window merged), each a store round trip and about 2 ms of botocore CPU in the replay.
Packed, the same chunks take 7 requests, and the replay 0.41-0.48 s instead of 0.75-0.77 s
(docs/design-notes.md, "Hint packs").

Owns:
- `pack_hint`: the pack of a hint, written to the store as a blob (`blobs/<digest>`, so that
  gc, mirrors and verification treat it as any blob; gc keeps it while a hint names it).
  Chunks come from the node cache where it has them (every one hashed again before it is
  encoded), else from the store (their stored frame, verified, copied as is). The pack stops
  at MAX_PACK_BYTES of frames: later records stay unpacked and a replay reads them from their
  groups' blobs.
- `pack_tag`: pack the hint a tag points at and move the tag to the packed hint, unless the
  tag moved meanwhile (a newer run's hint wins; it gets its own pack).

A pack is only ever an optimisation: every frame a replay reads from it is verified against
the chunk's digest like any other, and a chunk the pack cannot deliver is fetched from its
group's blob (core/prefetch.py).

Must not: decide when to pack (fuse/mount.py after publishing a recorded hint, and `weenv
hints pack`), or fetch anything for a mount.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3

from weenvfs.errors import RefNotFound, WeenvError
from weenvfs.format.chunk import decode_chunk, encode_chunk
from weenvfs.format.digest import digest_bytes, short
from weenvfs.format.hints import Hint, HintPack
from weenvfs.format.index import GroupIndex
from weenvfs.format.refs import object_key
from weenvfs.store.repository import Repository

from .cache import ChunkCache
from .chunk_plan import ChunkLoc, chunk_loc
from .node_hints import check_hint, publish_hint

log = logging.getLogger(__name__)

# Frames packed at most: a replay's first windows are what a cold start waits for (the
# reference workload's pack is 34 MB), and the pack is written through a temporary file in
# the system's temp folder, which may be memory.
MAX_PACK_BYTES = 256 << 20


@dataclass(frozen=True)
class Packed:
    """What `pack_tag` did: the packed hint's digest (None: nothing to do), and why not."""

    hint: str | None
    pack: str | None
    chunks: int
    bytes: int
    from_cache: int
    reason: str | None = None


def pack_hint(repo: Repository, hint: Hint, indexes: Sequence[GroupIndex],
              cache: ChunkCache | None, *, limit: int = MAX_PACK_BYTES,
              progress: Callable[[int], None] | None = None) -> tuple[Hint, int]:
    """`hint` with a pack of its chunks (the pack blob stored), and how many chunks came
    from `cache`; `progress(1)` after each record. Raises StoreError/FormatError when a chunk
    the cache lacks cannot be read or verified from the store."""
    lengths: list[int] = []
    seen: set[bytes] = set()
    hasher = blake3.blake3()
    total = from_cache = 0
    with tempfile.NamedTemporaryFile(prefix="weenv-pack-") as out:  # removed on any exit
        for rec in hint.records:
            if progress is not None:
                progress(1)
            loc = chunk_loc(indexes[rec.group], rec.chunk)
            if loc.blob is None or loc.digest in seen or total + loc.clen > limit:
                lengths.append(0)
                continue
            seen.add(loc.digest)
            frame, cached = _frame(repo, loc, cache)
            from_cache += cached
            out.write(frame)
            hasher.update(frame)
            lengths.append(len(frame))
            total += len(frame)
        if not total:
            raise WeenvError("the hint names no stored chunk: nothing to pack")
        out.flush()
        digest = hasher.hexdigest()
        repo.put_object_file("blobs", digest, Path(out.name))
    packed = hint._replace(pack=HintPack(digest, total, tuple(lengths)))
    log.info("packed %d chunks (%d from the node cache) into blob %s, %d bytes", len(seen),
             from_cache, short(digest), total)
    return packed, from_cache


def _frame(repo: Repository, loc: ChunkLoc, cache: ChunkCache | None) -> tuple[bytes, bool]:
    """The frame to pack for `loc` and whether it came from the cache."""
    if cache is not None:
        handle = cache.open(loc.digest, loc.ulen, pin=False)
        if handle is not None:
            with handle:
                plain = handle.read()
            if digest_bytes(plain) == loc.digest:
                return encode_chunk(plain), True
            log.warning("cached chunk %s does not match its digest; packing the stored "
                        "frame", short(loc.digest))
    assert loc.blob is not None
    frame = repo.store.get_range(object_key("blobs", loc.blob), loc.offset, loc.clen)
    decode_chunk(frame, loc.digest, loc.ulen)  # verified before it is published again
    return frame, False


def pack_tag(repo: Repository, manifest_digest: str, indexes: Sequence[GroupIndex], tag: str,
             cache: ChunkCache | None, *, expect: str | None = None,
             limit: int = MAX_PACK_BYTES, started: Callable[[int], None] | None = None,
             progress: Callable[[int], None] | None = None) -> Packed:
    """Pack the hint `tag` points at for this manifest and point `tag` at the packed hint.
    With `expect`, only if the tag points at that hint digest (before and after packing).
    A hint that has a pack already is left alone. `started(records)` once packing starts,
    then `progress` as for `pack_hint`."""
    current = _tagged(repo, manifest_digest, tag)
    if current is None:
        return Packed(None, None, 0, 0, 0, f"no hint is tagged {tag}")
    if expect is not None and current != expect:
        return Packed(None, None, 0, 0, 0, f"tag {tag} moved to hint {short(current)}")
    hint = repo.get_hint(current)
    why = check_hint(hint, manifest_digest, indexes)
    if why is not None:
        raise WeenvError(f"hint {short(current)} cannot be packed: {why}")
    if hint.pack is not None:
        return Packed(current, hint.pack.blob, sum(1 for n in hint.pack.lengths if n),
                      hint.pack.size, 0, "the hint has a pack already")
    if started is not None:
        started(len(hint.records))
    packed, from_cache = pack_hint(repo, hint, indexes, cache, limit=limit, progress=progress)
    assert packed.pack is not None
    if _tagged(repo, manifest_digest, tag) != current:
        return Packed(None, packed.pack.blob, 0, 0, from_cache,
                      f"tag {tag} moved while packing; left as it is")
    digest = publish_hint(repo, packed, tag)
    return Packed(digest, packed.pack.blob, sum(1 for n in packed.pack.lengths if n),
                  packed.pack.size, from_cache)


def _tagged(repo: Repository, manifest_digest: str, tag: str) -> str | None:
    try:
        return repo.get_tag("hints", manifest_digest, tag)
    except RefNotFound:
        return None

