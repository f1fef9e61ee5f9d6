"""Hint-ordered blob layout: which data of a new build goes first, from a recorded hint.

Owns: turning a prefetch hint (records of (group position, chunk number) in an environment's
manifest) into a `LayoutOrder`: a rank (the record's position) per chunk digest, for chunks of
large files, and per whole-file digest, for the small files that shared a hinted batch chunk.
Digests, not positions, because the build that uses the order makes new indexes with other
chunk numbers; content addressing makes the ranks carry over. `load_layout_order` finds the
hint in a store: a hint digest, or an environment reference and a hint tag.

The chunker (chunker.py) writes the chunks that have a rank into their own blob(s), in rank
order, so that replaying the hint reads a few sequential ranges (eStargz's prioritized files).
`HintedSpool` is that part of the chunker: it keeps hinted frames and small files in a spool
file until the build ends, batches the small files in rank order, then writes every hinted
frame, in rank order, through the blob writer it is given. Nothing else changes: old blobs
stay valid, and the hint never enters a group.

Must not: compress, hash or dedup data (chunker.py) or read sources. Pure except
`load_layout_order` (store) and `HintedSpool` (its spool file).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weenvfs.errors import ObjectMissing, RefNotFound
from weenvfs.format.digest import digest_bytes, short
from weenvfs.format.hints import Hint
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import Node
from weenvfs.format.refs import DEFAULT_TAG, check_tag
from weenvfs.store.repository import Repository

log = logging.getLogger(__name__)

_HEX64 = re.compile(r"(?:blake3:)?([0-9a-f]{64})")


@dataclass
class LayoutOrder:
    """Ranks (lower first) of hinted data: by chunk digest and by small-file digest."""

    chunks: dict[bytes, int] = field(default_factory=dict)
    files: dict[bytes, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.chunks) + len(self.files)


def layout_order(hint: Hint, indexes: Sequence[GroupIndex]) -> LayoutOrder:
    """The order `hint` asks for, given the group indexes of the manifest it is bound to.
    Records naming no chunk (a hint for other indexes) and zero chunks are skipped."""
    order = LayoutOrder()
    small: dict[int, dict[int, list[bytes]]] = {}  # group -> chunk -> small-file digests
    for rank, rec in enumerate(hint.records):
        if rec.group >= len(indexes) or rec.chunk >= indexes[rec.group].header.chunk_count:
            continue
        index = indexes[rec.group]
        chunk = index.chunk(rec.chunk)
        if chunk.zero:
            continue
        order.chunks.setdefault(chunk.digest, rank)
        files = small.get(rec.group)
        if files is None:
            files = small[rec.group] = _small_files(index)
        for file_digest in files.get(rec.chunk, ()):
            order.files.setdefault(file_digest, rank)
    return order


def _small_files(index: GroupIndex) -> dict[int, list[bytes]]:
    """chunk number -> digests of the single-chunk files with a file digest in it."""
    out: dict[int, list[bytes]] = {}
    for ino, file_digest in index.file_digests():
        chunks = index.file_chunks(ino)
        if len(chunks) == 1:
            out.setdefault(chunks[0], []).append(file_digest)
    return out


def load_layout_order(repo: Repository, ref: str, tag: str = DEFAULT_TAG) -> LayoutOrder:
    """The layout order of a stored hint: `ref` is a hint digest, or an environment
    (`NAME[:TAG]` or manifest digest) whose hint tag `tag` is used. Raises RefNotFound."""
    match = _HEX64.fullmatch(ref)
    if match is not None and repo.has_object("hints", match.group(1)):
        hint = repo.get_hint(match.group(1))
        try:
            manifest = repo.get_manifest(hint.manifest)
        except ObjectMissing:
            raise RefNotFound(
                f"hint {short(match.group(1))}: its manifest {short(hint.manifest)} is not "
                "in the store"
            ) from None
        source = f"hint {short(match.group(1))}"
    else:
        digest, manifest = repo.resolve_env(ref)
        hint_digest = repo.get_tag("hints", digest, check_tag(tag))
        hint = repo.get_hint(hint_digest)
        source = f"hint {short(hint_digest)} ({ref}, tag {tag})"
    indexes = [repo.get_index(g.index) for g in manifest.groups]
    order = layout_order(hint, indexes)
    log.info("layout from %s: %d records -> %d chunk and %d small-file ranks", source,
             len(hint.records), len(order.chunks), len(order.files))
    return order


class HintedSpool:
    """The hinted part of one build (see the module doc). Slots are the chunker's
    placeholders for chunks not written yet (`digest`, `ulen`, `blob_seq`, `offset`, `alias`),
    made by `new_slot`; `writer` is a blob writer (`write(frame) -> (blob seq, offset)`,
    `close_current()`, `abort()`, `blobs`)."""

    def __init__(
        self, order: LayoutOrder, path: Path, writer: Any, new_slot: Callable[[], Any]
    ) -> None:
        self.order = order
        self.slots: dict[bytes, Any] = {}  # hinted chunks of this build, by digest
        self.small: dict[bytes, tuple[int, int, Any, list[Node], int, int]] = {}
        self._spool = open(path, "w+b")  # noqa: SIM115 - closed in close()
        self._spooled = 0
        self._writer = writer
        self._new_slot = new_slot
        self._frames: list[tuple[int, int, Any, int, int]] = []  # rank, seq, slot, at, size

    def _put(self, data: bytes) -> int:
        at = self._spooled
        self._spool.write(data)
        self._spooled += len(data)
        return at

    def _get(self, at: int, size: int) -> bytes:
        self._spool.seek(at)
        data = self._spool.read(size)
        self._spool.seek(self._spooled)
        return data

    def add_small(self, node: Node, file_digest: bytes, data: bytes) -> Any:
        """A hinted small file: a placeholder slot now, aliased to its batch by `batches()`
        (the same placeholder for every copy of the same content)."""
        known = self.small.get(file_digest)
        if known is not None:
            known[3].append(node)
            return known[2]
        placeholder = self._new_slot()
        rank = self.order.files[file_digest]
        entry = (rank, len(self.small), placeholder, [node], self._put(data), len(data))
        self.small[file_digest] = entry
        return placeholder

    def batches(self, chunk_size: int) -> list[tuple[Any, bytes, int]]:
        """Batch the hinted small files in rank order: (slot, data, rank) per batch; sets
        each file's inner offset and points its placeholder at its batch."""
        out: list[tuple[Any, bytes, int]] = []
        parts: list[bytes] = []
        slot, size, rank = self._new_slot(), 0, 0
        for r, _seq, placeholder, nodes, at, n in sorted(self.small.values(), key=_by_rank):
            if parts and size + n > chunk_size:
                out.append(_close_batch(slot, parts, rank))
                parts, slot, size = [], self._new_slot(), 0
            if not parts:
                rank = r
            parts.append(self._get(at, n))
            placeholder.alias = slot
            for node in nodes:
                node.inner_offset = size
            size += n
        if parts:
            out.append(_close_batch(slot, parts, rank))
        return out

    def spool_frame(self, slot: Any, frame: bytes, rank: int) -> None:
        """Keep the compressed `frame` of hinted chunk `slot` for `write()`."""
        self._frames.append((rank, len(self._frames), slot, self._put(frame), len(frame)))

    def write(self, first_seq: int) -> list[Any]:
        """Write the spooled frames in rank order, set each slot's blob number (counted from
        `first_seq`) and offset; return the writer's finished blobs."""
        for _rank, _seq, slot, at, n in sorted(self._frames, key=_by_rank):
            seq, slot.offset = self._writer.write(self._get(at, n))
            slot.blob_seq = first_seq + seq
        self._writer.close_current()
        self.close()
        return list(self._writer.blobs)

    def close(self) -> None:
        """Release the spool and any half-written blob (idempotent)."""
        self._writer.abort()
        self._spool.close()


def _by_rank(item: tuple[Any, ...]) -> tuple[int, int]:
    return item[0], item[1]  # (rank, arrival): ties keep the order data came in


def _close_batch(slot: Any, parts: list[bytes], rank: int) -> tuple[Any, bytes, int]:
    data = b"".join(parts)
    slot.digest, slot.ulen = digest_bytes(data), len(data)
    return slot, data, rank
