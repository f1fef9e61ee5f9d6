"""The column readers of the index's tables (format/columns.py) against record-by-record
decoding, with native words and with the portable reader, on random trees of every file
type; and the device layout they feed against one derived from decoded records."""

from __future__ import annotations

import stat

import pytest
from test_random_trees import random_tree

from weenvfs.format import columns
from weenvfs.format import constants as C
from weenvfs.format.device_layout import BLOCK_SIZE, DeviceLayout
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import encode_index

SEEDS = range(0, 120, 7)
KINDS = [stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO,
         stat.S_IFSOCK]


@pytest.fixture(params=["native words", "struct"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(columns, "NATIVE_LE", request.param == "native words")


def _index(seed: int) -> GroupIndex:
    root, chunk_size = random_tree(seed)
    return GroupIndex(encode_index(root, chunk_size))


@pytest.mark.parametrize("seed", SEEDS)
def test_columns_match_the_records(reader: None, seed: int) -> None:
    index = _index(seed)
    records = [index.inode(ino) for ino in range(index.inode_count)]
    table = index.inode_table()
    assert list(columns.u32_column(table, C.INODE.size, 0)) == [r.mode for r in records]
    assert list(columns.u32_column(table, C.INODE.size, 48)) == [r.data_first for r in records]
    assert list(columns.u32_column(table, C.INODE.size, 52)) == [r.data_count for r in records]
    assert list(columns.u64_column(table, C.INODE.size, 16)) == [r.size for r in records]
    for kind in KINDS:
        flags = columns.kind_flags(table, kind)
        assert list(flags) == [int(stat.S_IFMT(r.mode) == kind) for r in records]
    children = list(columns.u32_column(index.dirent_table(), C.DIRENT.size, 8))
    dirents = [C.DIRENT.unpack_from(index.dirent_table(), n * C.DIRENT.size)[2]
               for n in range(index.header.dirent_count)]
    assert children == dirents


@pytest.mark.parametrize("seed", SEEDS)
def test_device_layout_from_columns(reader: None, seed: int) -> None:
    # Every regular file with data, in inode order, one block-aligned extent each.
    index = _index(seed)
    layout = DeviceLayout(index)
    block = 0
    for ino in range(index.inode_count):
        record = index.inode(ino)
        if record.is_reg and record.size:
            assert layout.start_block(ino) == block
            block += -(-record.size // BLOCK_SIZE)
        else:
            with pytest.raises(KeyError):
                layout.start_block(ino)
    assert layout.blocks == block
    assert DeviceLayout.from_bytes(layout.to_bytes()).to_bytes() == layout.to_bytes()
