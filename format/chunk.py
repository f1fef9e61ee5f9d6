"""Chunk encoding: one independent zstd frame per chunk, verified by the plaintext's BLAKE3.

A blob is a plain concatenation of such frames; a chunk record in an index locates one frame by
(compressed offset, compressed length) within a blob. Pure functions, no I/O.
"""

from __future__ import annotations

import threading

import zstandard

from .constants import max_frame_size
from .digest import digest_bytes
from .errors import DigestMismatch, FormatError

DEFAULT_LEVEL = 3
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # Compressor objects are not thread-safe; keep one per thread and level.
    cache = _local.__dict__.setdefault("compressors", {})
    comp = cache.get(level)
    if comp is None:
        comp = cache[level] = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=False
        )
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


def encode_chunk(plain: bytes | memoryview, level: int = DEFAULT_LEVEL) -> bytes:
    """Compress one chunk's plaintext into a single zstd frame carrying its content size."""
    return _compressor(level).compress(plain)


def decode_chunk(frame: bytes | memoryview, digest: bytes, length: int) -> bytes:
    """Decompress one frame and verify it against the chunk record.

    Raises `FormatError` if the frame is not exactly one zstd frame of `length` bytes, and
    `DigestMismatch` if the plaintext does not hash to `digest` (32 raw bytes).
    """
    # Check the declared size first: the frame is not verified yet, and decompress() would
    # allocate whatever size a corrupt or hostile header declares.
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise FormatError("chunk frame", f"{digest.hex()[:12]}: not a zstd frame: {exc}") from None
    if declared != length:
        raise FormatError(
            "chunk frame", f"{digest.hex()[:12]}: declares {declared} bytes, expected {length}"
        )
    try:
        plain = _decompressor().decompress(frame, max_output_size=length)
    except zstandard.ZstdError as exc:
        raise FormatError("chunk frame", f"cannot decompress {digest.hex()[:12]}: {exc}") from None
    if len(plain) != length:
        raise FormatError(
            "chunk frame", f"{digest.hex()[:12]}: expected {length} bytes, got {len(plain)}"
        )
    actual = digest_bytes(plain)
    if actual != digest:
        raise DigestMismatch("chunk", digest.hex(), actual.hex())
    return plain


def decompress_object(data: bytes | memoryview, what: str, limit: int) -> bytes:
    """Decompress a whole zstd-compressed object (an index, a hint, an image) of at most
    `limit` bytes; the stored object itself may be at most `max_frame_size(limit)` bytes."""
    stored = max_frame_size(limit)
    if len(data) > stored:
        raise FormatError(what, f"{len(data)} stored bytes exceed the limit {stored}")
    if bytes(data[:4]) != _ZSTD_MAGIC:  # also refuses a skippable frame, which holds no data
        raise FormatError(what, "not a zstd frame (bad magic)")
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise FormatError(what, f"not a zstd frame: {exc}") from None
    if size < 0:
        raise FormatError(what, "zstd frame without a content size")
    if size > limit:
        raise FormatError(what, f"content size {size} exceeds the limit {limit}")
    # Streamed, so memory grows with the data actually decoded, not with the size a corrupt
    # header declares; and the frame must be complete and alone (no trailing bytes).
    stream = _decompressor().decompressobj()
    try:
        plain = stream.decompress(data)
    except zstandard.ZstdError as exc:
        raise FormatError(what, f"cannot decompress: {exc}") from None
    if not stream.eof:
        raise FormatError(what, "truncated zstd frame")
    if stream.unused_data:
        raise FormatError(what, f"{len(stream.unused_data)} bytes after the zstd frame")
    if len(plain) != size:
        raise FormatError(what, f"expected {size} bytes after decompression, got {len(plain)}")
    return plain


def compress_object(plain: bytes, level: int = 9) -> bytes:
    """Compress a whole object (index, hint) into one zstd frame with its content size."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(plain)
