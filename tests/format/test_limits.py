"""Object size limits of SPEC.md 12.1 in the codec (issue 16 item 5): every decoder refuses
an object over its kind's limit before it allocates for it.

An index bomb (a small frame declaring more than MAX_INDEX_SIZE) is refused from its frame
header; a stored object longer than the largest frame of its limit is refused unread; a tag is
never longer than TAG_SIZE; an EROFS image that would exceed MAX_IMAGE_SIZE is refused before
its inodes are built. And the frame bound is one real writers keep: libzstd's frames of
incompressible data at every level stay under `max_frame_size`.
"""

from __future__ import annotations

import random
import stat

import pytest
import zstandard

from weenvfs.format import constants as C
from weenvfs.format import erofs, erofs_group
from weenvfs.format.chunk import decompress_object
from weenvfs.format.device_layout import DeviceLayout
from weenvfs.format.digest import digest_bytes
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import ChunkRef, Node, encode_index
from weenvfs.format.refs import KINDS, STORED_LIMITS, decode_tag, encode_tag, stored_limit

MIB = 1 << 20
CS = 4096


def _bomb(size: int) -> bytes:
    """One zstd frame of `size` zero bytes, with its content size, compressed streaming."""
    out = zstandard.ZstdCompressor(level=1).compressobj(size=size)
    piece = bytes(MIB)
    parts = [out.compress(piece) for _ in range(size // MIB)]
    return b"".join([*parts, out.flush()])


def test_an_index_bomb_is_refused_from_its_header() -> None:
    bomb = _bomb(C.MAX_INDEX_SIZE + MIB)
    assert len(bomb) < 64 << 10
    with pytest.raises(FormatError, match=f"content size {C.MAX_INDEX_SIZE + MIB} exceeds"):
        GroupIndex.from_object(bomb)


def test_a_stored_object_longer_than_its_largest_frame_is_refused() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 100)
    assert decompress_object(frame, "hint", 100) == b"x" * 100
    padded = frame + bytes(C.max_frame_size(100) + 1 - len(frame))
    with pytest.raises(FormatError, match=f"stored bytes exceed the limit {C.max_frame_size(100)}"):
        decompress_object(padded, "hint", 100)


@pytest.mark.parametrize("size", [0, 1, 100, 4095, 128 << 10, (128 << 10) + 1, MIB + 7])
def test_libzstd_frames_stay_within_the_bound(size: int) -> None:
    """Incompressible data is the worst case; the bound must hold at every level, with or
    without the content checksum (writers MAY add it)."""
    data = random.Random(size).randbytes(size)
    for level in (-5, 1, 3, 9, 19):
        for checksum in (False, True):
            frame = zstandard.ZstdCompressor(
                level=level, write_content_size=True, write_checksum=checksum
            ).compress(data)
            assert len(frame) <= C.max_frame_size(size), (size, level, checksum)


def test_stored_limits_cover_every_kind() -> None:
    assert set(STORED_LIMITS) == set(KINDS)
    assert stored_limit("indexes") == C.max_frame_size(C.MAX_INDEX_SIZE)
    assert stored_limit("manifests") == C.MAX_MANIFEST_SIZE and stored_limit("blobs") is None
    with pytest.raises(ValueError):
        stored_limit("tags")


def test_a_tag_longer_than_a_tag_is_refused_by_its_length() -> None:
    good = encode_tag("ab" * 32)
    assert len(good) == C.TAG_SIZE and decode_tag(good) == "ab" * 32
    with pytest.raises(FormatError, match=f"{C.TAG_SIZE + 1} bytes, more than the {C.TAG_SIZE}"):
        decode_tag(good + b"\n")


def _shared_ranges(copies: int, chunks: int) -> GroupIndex:
    """An index whose `copies` files all name one range of `chunks` zero-chunk records: a few
    KiB of index, `copies * chunks` chunk indexes in its image."""
    zero = ChunkRef(digest_bytes(bytes(CS)), None, 0, 0, CS)
    root = Node(stat.S_IFDIR | 0o755)
    root.children[b"range"] = Node(stat.S_IFREG | 0o644, size=chunks * CS, chunks=[zero] * chunks)
    for k in range(copies):
        root.children[b"f%03d" % k] = Node(stat.S_IFREG | 0o644, size=CS, chunks=[zero])
    raw = bytearray(encode_index(root, CS))
    index = GroupIndex(bytes(raw))
    shared = index.inode(index.resolve(b"range"))  # type: ignore[arg-type]
    for k in range(copies):
        ino = index.resolve(b"f%03d" % k)
        assert ino is not None
        rec = index.inode(ino)._replace(size=shared.size, data_first=shared.data_first,
                                         data_count=shared.data_count)
        C.INODE.pack_into(raw, index.header.inode_offset + ino * C.INODE.size, *rec)
    return GroupIndex(bytes(raw))


def test_an_image_over_the_limit_is_refused_before_its_inodes_are_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    index = _shared_ranges(copies=40, chunks=256)  # 41 x 256 chunk indexes of 8 bytes
    image = erofs_group.group_image(index)
    assert len(image) > 41 * 256 * 8
    # The real limit is 512 MiB; a smaller one shows where the refusal comes from.
    monkeypatch.setattr(erofs_group, "MAX_IMAGE_SIZE", 64 << 10)
    with pytest.raises(FormatError, match=f"EROFS image: would exceed {64 << 10} bytes"):
        erofs_group.GroupImage(index, DeviceLayout(index)).inodes()


def test_the_image_writer_refuses_an_image_over_the_limit_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inodes = [erofs.ErofsInode(stat.S_IFDIR | 0o755, 0, 0, 2, 0)]
    size = len(erofs.write_image(inodes, 0))
    monkeypatch.setattr(erofs, "MAX_IMAGE_SIZE", size - 1)
    with pytest.raises(FormatError, match=f"image: {size} bytes exceed {size - 1}"):
        erofs.write_image(inodes, 0)
