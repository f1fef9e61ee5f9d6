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

    async def read(self, offset: int, size: int) -> bytes:
        """Device bytes [offset, offset + size), short past the end of the device."""
        size = max(min(size, self.layout.size - offset), 0)
        pieces = self.layout.pieces(offset, size)
        if len(pieces) == 1 and pieces[0].at == 0 and pieces[0].length == size:
            return await self._read_piece(pieces[0])
        out = bytearray(size)
        if len(pieces) == 1:
            piece = pieces[0]
            out[piece.at:piece.at + piece.length] = await self._read_piece(piece)
            return bytes(out)

        async def fill(piece: DevicePiece) -> None:
            out[piece.at:piece.at + piece.length] = await self._read_piece(piece)

        async with trio.open_nursery() as nursery:
            for piece in pieces:
                nursery.start_soon(fill, piece)
        return bytes(out)

    async def _read_piece(self, piece: DevicePiece) -> bytes:
        data = await self.reader.read(make_inode(self.group, piece.ino), piece.file_offset,
                                      piece.length)
        if len(data) != piece.length:
            # The index promised these bytes (its size); a short read would shift every
            # byte after it. The reader verified what it has, so this is a damaged index.
            raise FormatError(f"inode {piece.ino}", f"ends early: {len(data)} of "
                              f"{piece.length} bytes at {piece.file_offset}")
        return data
