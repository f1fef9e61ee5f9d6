"""Prefetch hints: chunk references of one environment in first-access order.

A hint is bound to one manifest digest; records name a chunk by (group position in the manifest,
chunk number in that group's index), so they stay small and need no digests. Stored
zstd-compressed. Pure; no I/O.
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


class Hint(NamedTuple):
    manifest: str
    records: tuple[HintRecord, ...]


def encode_hint(hint: Hint) -> bytes:
    """The stored (compressed) bytes of `hint`."""
    if len(hint.records) > C.MAX_HINT_RECORDS:
        raise FormatError("hint", f"{len(hint.records)} records exceed {C.MAX_HINT_RECORDS}")
    check_digest(hint.manifest, "hint manifest")
    for r in hint.records:
        if not (
            0 <= r.group <= 0xFFFF and 0 <= r.chunk <= C.MAX_U32 and 0 <= r.time_ms <= C.MAX_U32
        ):
            raise FormatError("hint record", f"{r} out of range")
    head = C.HINT_HEADER.pack(
        C.HINT_MAGIC, C.HINT_VERSION, 0, bytes.fromhex(hint.manifest), len(hint.records)
    )
    body = b"".join(C.HINT_RECORD.pack(r.group, 0, r.chunk, r.time_ms) for r in hint.records)
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
    expected = C.HINT_HEADER.size + count * C.HINT_RECORD.size
    if len(raw) != expected:
        raise FormatError("hint records", f"{count} records need {expected} bytes, got {len(raw)}")
    records = tuple(
        HintRecord(g, c, t) for g, _, c, t in C.HINT_RECORD.iter_unpack(raw[C.HINT_HEADER.size :])
    )
    return Hint(manifest.hex(), records)
