"""Corrupt and truncated objects: the codec refuses with `FormatError`, never anything else.

- flip every byte of every vector's raw index (xor 0xff, and a single low bit): decoding,
  walking every record and reading every lookup raises `FormatError` or gives an index that is
  still internally consistent (`exercise`); a composed tree over a corrupt group the same;
- flip every byte of stored objects (the vectors' raw-block frames and a real zstd frame):
  the digest always changes (so a fetch by digest catches it) and decoding raises nothing
  but `FormatError`;
- truncate stored objects and raw indexes at every offset: only `FormatError` (a raw index
  cut inside its final padding is still complete, and must then be consistent);
- hostile zstd headers declaring gigabytes are refused without allocating them.
"""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from typing import Any

import pytest
import zstandard
from format_support import exercise, exercise_composed

from weenvfs.format.chunk import compress_object, decode_chunk, decompress_object, encode_chunk
from weenvfs.format.compose import ComposedTree
from weenvfs.format.digest import digest_bytes, digest_hex
from weenvfs.format.errors import FormatError
from weenvfs.format.hints import decode_hint
from weenvfs.format.index import GroupIndex

RAW_INDEXES = ["minimal.index.bin", "files.index.bin", "env-base.index.bin", "env-mid.index.bin"]


def _decode_and_exercise(raw: bytes) -> bool:
    """True if `raw` decoded into a consistent index, False if the codec refused it."""
    try:
        index = GroupIndex(raw)
        exercise(index)
    except FormatError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", RAW_INDEXES)
@pytest.mark.parametrize("mask", [0xFF, 0x01])
def test_flip_every_byte_of_a_raw_index(
    name: str, mask: int, vector_files: dict[str, bytes]
) -> None:
    raw = vector_files[name]
    refused = 0
    for pos in range(len(raw)):
        flipped = bytearray(raw)
        flipped[pos] ^= mask
        refused += not _decode_and_exercise(bytes(flipped))
    assert refused > 0


@pytest.mark.slow
def test_flips_in_one_group_of_a_composed_tree(vector_files: dict[str, bytes]) -> None:
    lower = [GroupIndex(vector_files[f"env-{g}.index.bin"]) for g in ("base", "mid")]
    raw = vector_files["env-top.index.bin"]
    for pos in range(len(raw)):
        flipped = bytearray(raw)
        flipped[pos] ^= 0xFF
        with contextlib.suppress(FormatError):
            exercise_composed(ComposedTree([*lower, GroupIndex(bytes(flipped))]))


def _stored_objects(vector_files: dict[str, bytes]) -> list[tuple[str, bytes]]:
    real = compress_object(vector_files["files.index.bin"])
    return [
        ("files.index.zst", vector_files["files.index.zst"]),
        ("env-top.index.zst", vector_files["env-top.index.zst"]),
        ("real zstd", real),
    ]


def _decode_stored_index(data: bytes) -> None:
    with contextlib.suppress(FormatError):
        exercise(GroupIndex.from_object(data))


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1, 2])
def test_flip_every_byte_of_a_stored_index(which: int, vector_files: dict[str, bytes]) -> None:
    _, stored = _stored_objects(vector_files)[which]
    digest = digest_hex(stored)
    for pos in range(len(stored)):
        flipped = bytearray(stored)
        flipped[pos] ^= 0xFF
        assert digest_hex(flipped) != digest  # what a fetch by digest checks first
        _decode_stored_index(bytes(flipped))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_truncate_a_stored_index_at_every_offset(
    which: int, vector_files: dict[str, bytes]
) -> None:
    _, stored = _stored_objects(vector_files)[which]
    for cut in range(len(stored)):
        with pytest.raises(FormatError):
            GroupIndex.from_object(stored[:cut])


@pytest.mark.parametrize("name", RAW_INDEXES + ["env-top.index.bin"])
def test_truncate_a_raw_index_at_every_offset(name: str, vector_files: dict[str, bytes]) -> None:
    raw = vector_files[name]
    complete = GroupIndex(raw).header.string_offset + GroupIndex(raw).header.string_size
    for cut in range(len(raw)):
        if cut < complete:
            with pytest.raises(FormatError):
                exercise(GroupIndex(raw[:cut]))
        else:  # only final padding is missing: every table is whole
            assert _decode_and_exercise(raw[:cut])


SKIPPABLE = b"\x50\x2a\x4d\x18\x04\0\0\0abcd"  # a zstd skippable frame with 4 bytes


def test_trailing_bytes_after_a_stored_object_are_refused(vector_files: dict[str, bytes]) -> None:
    stored = vector_files["files.index.zst"]
    for tail in (b"\0", stored, SKIPPABLE):  # garbage, a second frame, a skippable frame
        with pytest.raises(FormatError, match="after the zstd frame"):
            GroupIndex.from_object(stored + tail)
    for head in (SKIPPABLE, SKIPPABLE + stored):
        with pytest.raises(FormatError, match="bad magic"):
            GroupIndex.from_object(head)


@pytest.mark.parametrize("name", ["files.hint.zst", "env.hint.zst"])
def test_hints_flipped_and_truncated(name: str, vector_files: dict[str, bytes]) -> None:
    stored = vector_files[name]
    for pos in range(len(stored)):
        flipped = bytearray(stored)
        flipped[pos] ^= 0xFF
        with contextlib.suppress(FormatError):
            decode_hint(bytes(flipped))
    for cut in range(len(stored)):
        with pytest.raises(FormatError):
            decode_hint(stored[:cut])


def _huge_header(frame: bytes, declared: int) -> bytes:
    # Replace the 2-byte content size of a small single-segment frame by a 4-byte one.
    assert frame[4] == 0x60, "expected FCS flag 1, single segment"
    return frame[:4] + bytes([0xA0]) + struct.pack("<I", declared) + frame[7:]


def _peak_after(fn: Any) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(FormatError):
            fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_hostile_content_size_is_not_allocated() -> None:
    plain = bytes(range(256)) * 40
    assert _peak_after(
        lambda: decode_chunk(_huge_header(encode_chunk(plain), 3 << 30), digest_bytes(plain), 10240)
    ) < (64 << 20)
    assert _peak_after(
        lambda: decompress_object(_huge_header(compress_object(plain), 3 << 30), "index", 1 << 32)
    ) < (64 << 20)


def test_chunk_frames_must_declare_their_size() -> None:
    plain = b"chunk data" * 100
    frame = encode_chunk(plain)
    assert decode_chunk(frame, digest_bytes(plain), len(plain)) == plain
    with pytest.raises(FormatError, match="declares"):
        decode_chunk(frame, digest_bytes(plain), len(plain) - 1)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(plain)
    with pytest.raises(FormatError, match="declares"):
        decode_chunk(unsized, digest_bytes(plain), len(plain))
    with pytest.raises(FormatError):
        decode_chunk(frame[:-1], digest_bytes(plain), len(plain))


def test_index_limits_are_enforced_on_the_declared_size() -> None:
    frame = compress_object(b"x" * 1000)
    with pytest.raises(FormatError, match="exceeds the limit"):
        decompress_object(frame, "index", 999)
