"""Prefetch hints: chunk references of one environment in first-access order, (version 2)
the files read, in first-read order, and (version 3) a pack: the hinted chunks encoded again,
one frame each, in record order, in one blob of their own, so that a replay reads a few large
ranges instead of one per scattered run of chunks.

A hint is bound to one manifest digest; records name a chunk by (group position in the manifest,
chunk number in that group's index), so they stay small and need no digests; file records name
a regular file by (group position, inode number in that group's index). Stored
zstd-compressed; a hint without file records or pack is written as version 1, byte for byte as
before, and one with file records but no pack as version 2. Pure; no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

from . import constants as C
from .chunk import compress_object, decompress_object
from .digest import check_digest
from .errors import FormatError, UnsupportedFormat


class HintRecord(NamedTuple):
    group: int
    chunk: int
    time_ms: int


class HintFile(NamedTuple):
    group: int
    inode: int
    time_ms: int


class HintPack(NamedTuple):
    """The blob holding the hinted chunks: `lengths[i]` is the frame length of record i's
    chunk in it (0: not in the pack); frames follow each other in record order from 0."""

    blob: str
    size: int
    lengths: tuple[int, ...]

    def offsets(self) -> list[int]:
        """The offset of each record's frame in the blob (that of the next frame for a
        record with no frame)."""
        out, at = [], 0
        for length in self.lengths:
            out.append(at)
            at += length
        return out


class Hint(NamedTuple):
    manifest: str
    records: tuple[HintRecord, ...]
    files: tuple[HintFile, ...] = ()
    pack: HintPack | None = None


def encode_hint(hint: Hint) -> bytes:
    """The stored (compressed) bytes of `hint`."""
    if len(hint.records) > C.MAX_HINT_RECORDS:
        raise FormatError("hint", f"{len(hint.records)} records exceed {C.MAX_HINT_RECORDS}")
    if len(hint.files) > C.MAX_HINT_FILES:
        raise FormatError("hint", f"{len(hint.files)} file records exceed {C.MAX_HINT_FILES}")
    check_digest(hint.manifest, "hint manifest")
    for what, records in (("hint record", hint.records), ("hint file record", hint.files)):
        for r in records:
            if not (0 <= r[0] <= 0xFFFF and 0 <= r[1] <= C.MAX_U32 and 0 <= r[2] <= C.MAX_U32):
                raise FormatError(what, f"{r} out of range")
    if hint.pack is not None:
        _check_pack(hint.pack, len(hint.records))
        version = C.HINT_PACK_VERSION
    else:
        version = C.HINT_FILES_VERSION if hint.files else C.HINT_VERSION
    head = C.HINT_HEADER.pack(
        C.HINT_MAGIC, version, 0, bytes.fromhex(hint.manifest), len(hint.records)
    )
    body = b"".join(C.HINT_RECORD.pack(r.group, 0, r.chunk, r.time_ms) for r in hint.records)
    if version != C.HINT_VERSION:
        body += C.HINT_FILES_HEAD.pack(len(hint.files), 0) + b"".join(
            C.HINT_FILE.pack(f.group, 0, f.inode, f.time_ms) for f in hint.files)
    if hint.pack is not None:
        body += C.HINT_PACK_HEAD.pack(bytes.fromhex(hint.pack.blob), hint.pack.size,
                                      len(hint.pack.lengths), 0)
        body += b"".join(C.HINT_PACK_ENTRY.pack(n) for n in hint.pack.lengths)
    return compress_object(head + body)


def _check_pack(pack: HintPack, record_count: int) -> None:
    check_digest(pack.blob, "hint pack blob")
    if len(pack.lengths) != record_count:
        raise FormatError("hint pack", f"{len(pack.lengths)} entries for {record_count} records")
    if any(not 0 <= n <= C.MAX_U32 for n in pack.lengths):
        raise FormatError("hint pack", "a frame length is out of range")
    if sum(pack.lengths) != pack.size or not 0 < pack.size <= C.MAX_BLOB_OFFSET:
        raise FormatError("hint pack", f"frame lengths add up to {sum(pack.lengths)}, "
                          f"not the pack's {pack.size} bytes")


def decode_hint(data: bytes) -> Hint:
    """Parse a stored hint, validating its header and size."""
    raw = decompress_object(data, "hint", C.MAX_HINT_SIZE)
    if len(raw) < C.HINT_HEADER.size:
        raise FormatError("hint header", f"need {C.HINT_HEADER.size} bytes, got {len(raw)}")
    magic, version, _, manifest, count = C.HINT_HEADER.unpack_from(raw, 0)
    if magic != C.HINT_MAGIC:
        raise FormatError("hint magic", f"expected {C.HINT_MAGIC!r}, got {magic!r}")
    if version not in C.SUPPORTED_HINT_VERSIONS:
        raise UnsupportedFormat("hint version", f"{version} is not supported")
    end = C.HINT_HEADER.size + count * C.HINT_RECORD.size
    if count > C.MAX_HINT_RECORDS or version == C.HINT_VERSION and len(raw) != end \
            or len(raw) < end:
        raise FormatError("hint records", f"{count} records need {end} bytes, got {len(raw)}")
    records = tuple(
        HintRecord(g, c, t) for g, _, c, t in C.HINT_RECORD.iter_unpack(raw[C.HINT_HEADER.size:end])
    )
    if version == C.HINT_VERSION:
        return Hint(manifest.hex(), records)
    files, end = _decode_files(raw, end)
    if version == C.HINT_FILES_VERSION:
        if len(raw) != end:
            raise FormatError("hint file records", f"{len(files)} file records need {end} "
                              f"bytes, got {len(raw)}")
        return Hint(manifest.hex(), records, files)
    return Hint(manifest.hex(), records, files, _decode_pack(raw, end, count))


def _decode_files(raw: bytes, at: int) -> tuple[tuple[HintFile, ...], int]:
    """The file table of a version 2 or 3 hint at byte `at` (right after the chunk records),
    and where it ends."""
    if len(raw) < at + C.HINT_FILES_HEAD.size:
        raise FormatError("hint file table", f"need {C.HINT_FILES_HEAD.size} bytes at {at}, "
                          f"got {len(raw) - at}")
    count, _ = C.HINT_FILES_HEAD.unpack_from(raw, at)
    at += C.HINT_FILES_HEAD.size
    end = at + count * C.HINT_FILE.size
    if count > C.MAX_HINT_FILES or len(raw) < end:
        raise FormatError("hint file records", f"{count} file records need {end} bytes, "
                          f"got {len(raw)}")
    files = tuple(HintFile(g, i, t) for g, _, i, t in C.HINT_FILE.iter_unpack(raw[at:end]))
    return files, end


def _decode_pack(raw: bytes, at: int, record_count: int) -> HintPack:
    """The pack table of a version 3 hint at byte `at` (right after the file table)."""
    expected = at + C.HINT_PACK_HEAD.size + record_count * C.HINT_PACK_ENTRY.size
    if len(raw) != expected:
        raise FormatError("hint pack", f"a pack table for {record_count} records needs "
                          f"{expected - at} bytes, got {len(raw) - at}")
    blob, size, count, _ = C.HINT_PACK_HEAD.unpack_from(raw, at)
    at += C.HINT_PACK_HEAD.size
    lengths = tuple(n for (n,) in C.HINT_PACK_ENTRY.iter_unpack(raw[at:]))
    pack = HintPack(blob.hex(), size, lengths)
    if count != record_count:
        raise FormatError("hint pack", f"{count} entries for {record_count} records")
    _check_pack(pack, record_count)
    return pack
