"""Prefetch hints: chunk references of one environment in first-access order, and (version
2) the files read, in first-read order.

A hint is bound to one manifest digest; records name a chunk by (group position in the manifest,
chunk number in that group's index), so they stay small and need no digests; file records name
a regular file by (group position, inode number in that group's index). Stored
zstd-compressed; a hint without file records is written as version 1, byte for byte as before.
Pure; no I/O.
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


class Hint(NamedTuple):
    manifest: str
    records: tuple[HintRecord, ...]
    files: tuple[HintFile, ...] = ()


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
    version = C.HINT_FILES_VERSION if hint.files else C.HINT_VERSION
    head = C.HINT_HEADER.pack(
        C.HINT_MAGIC, version, 0, bytes.fromhex(hint.manifest), len(hint.records)
    )
    body = b"".join(C.HINT_RECORD.pack(r.group, 0, r.chunk, r.time_ms) for r in hint.records)
    if hint.files:
        body += C.HINT_FILES_HEAD.pack(len(hint.files), 0) + b"".join(
            C.HINT_FILE.pack(f.group, 0, f.inode, f.time_ms) for f in hint.files)
    return compress_object(head + body)


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
    return Hint(manifest.hex(), records, _decode_files(raw, end))


def _decode_files(raw: bytes, at: int) -> tuple[HintFile, ...]:
    """The file table of a version 2 hint, at byte `at` (right after the chunk records)."""
    if len(raw) < at + C.HINT_FILES_HEAD.size:
        raise FormatError("hint file table", f"need {C.HINT_FILES_HEAD.size} bytes at {at}, "
                          f"got {len(raw) - at}")
    count, _ = C.HINT_FILES_HEAD.unpack_from(raw, at)
    at += C.HINT_FILES_HEAD.size
    expected = at + count * C.HINT_FILE.size
    if count > C.MAX_HINT_FILES or len(raw) != expected:
        raise FormatError("hint file records", f"{count} file records need {expected} bytes, "
                          f"got {len(raw)}")
    return tuple(HintFile(g, i, t) for g, _, i, t in C.HINT_FILE.iter_unpack(raw[at:]))
