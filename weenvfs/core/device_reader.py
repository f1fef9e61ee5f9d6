"""Reads of a group's virtual data device: device range -> file ranges -> chunks.

Owns: serving `read(offset, size)` of the device that a group's EROFS image addresses
(device_layout.py says which file bytes sit where). Each file range goes through the same
`Reader` a FUSE tree mount uses, so fetching, verification, the node cache, read-ahead,
statistics and hint recording are the same on both paths; the ranges of one device read are
read concurrently (a kernel read-ahead across many small files becomes one burst of fetches,
which the fetcher coalesces). Bytes no file covers are zeros.

Must not: know about pyfuse3 (fuse/device_ops.py) or EROFS bytes, or fetch by itself.
"""

from __future__ import annotations

import trio

from weenvfs.format.device_layout import DeviceLayout, DevicePiece
from weenvfs.format.index import file_spans

from .chunk_plan import ChunkLoc, chunk_loc
from .reader import Reader
from .tree import FormatError, make_inode


class DeviceReader:
    """The data device of group `group` (its position in the tree's groups)."""

    def __init__(self, layout: DeviceLayout, reader: Reader, group: int) -> None:
        self.layout = layout
        self.reader = reader
        self.group = group

    @property
    def size(self) -> int:
        """The device's size in bytes."""
        return self.layout.size

    def read_cached(self, offset: int, size: int) -> bytes | None:
        """What `read` returns, at once, for a read within one file's range (and the zeros
        that pad it to whole blocks) whose chunks are all cached and verified in this process
        (`Reader.read_cached`: most kernel requests once data is on the node); None for
        anything else (then `await read(...)`)."""
        size = max(min(size, self.layout.size - offset), 0)
        pieces = self.layout.pieces(offset, size)
        if len(pieces) != 1:
            return None
        piece = pieces[0]
        data = self.reader.read_cached(make_inode(self.group, piece.ino), piece.file_offset,
                                       piece.length)
        if data is None:
            return None
        self._check_length(piece, data)
        return data if piece.length == size else self._padded(piece, data, size)

    def continued(self, offset: int) -> None:
        """The file at device byte `offset` was read on up to there without this process
        seeing it (`Reader.continued`): a read from there is sequential."""
        pieces = self.layout.pieces(offset, 1)
        if pieces:
            self.reader.continued(make_inode(self.group, pieces[0].ino), pieces[0].file_offset)

    def chunk(self, number: int) -> ChunkLoc:
        """Chunk `number` of the group's index."""
        return chunk_loc(self.reader.tree.groups[self.group], number)

    def chunks(self, offset: int, size: int) -> list[tuple[int, ChunkLoc]]:
        """(number in the group's index, location) of each stored chunk (not the zero ones)
        that device bytes [offset, offset + size) read."""
        out = []
        for piece in self.layout.pieces(offset, size):
            index, ino = self.reader.tree.file(make_inode(self.group, piece.ino))
            for span in file_spans(index, ino, piece.file_offset, piece.length):
                loc = chunk_loc(index, span.chunk)
                if loc.blob is not None:
                    out.append((span.chunk, loc))
        return out

    async def read(self, offset: int, size: int) -> bytes:
        """Device bytes [offset, offset + size), short past the end of the device."""
        size = max(min(size, self.layout.size - offset), 0)
        pieces = self.layout.pieces(offset, size)
        if len(pieces) == 1:
            data = await self._read_piece(pieces[0])
            return data if pieces[0].length == size else self._padded(pieces[0], data, size)
        out = bytearray(size)

        async def fill(piece: DevicePiece) -> None:
            out[piece.at:piece.at + piece.length] = await self._read_piece(piece)

        async with trio.open_nursery() as nursery:
            for piece in pieces:
                nursery.start_soon(fill, piece)
        return bytes(out)

    async def _read_piece(self, piece: DevicePiece) -> bytes:
        data = await self.reader.read(make_inode(self.group, piece.ino), piece.file_offset,
                                      piece.length)
        self._check_length(piece, data)
        return data

    @staticmethod
    def _check_length(piece: DevicePiece, data: bytes) -> None:
        if len(data) != piece.length:
            # The index promised these bytes (its size); a short read would shift every
            # byte after it. The reader verified what it has, so this is a damaged index.
            raise FormatError(f"inode {piece.ino}", f"ends early: {len(data)} of "
                              f"{piece.length} bytes at {piece.file_offset}")

    @staticmethod
    def _padded(piece: DevicePiece, data: bytes, size: int) -> bytes:
        """`data` at its place in `size` bytes of zeros (bytes no file covers)."""
        out = bytearray(size)
        out[piece.at:piece.at + piece.length] = data
        return bytes(out)
