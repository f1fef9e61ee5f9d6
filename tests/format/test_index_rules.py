"""The validation rules of SPEC.md 6.15, one by one, on a small index with patched fields.

Header: versions and feature bits (unknown incompat -> UnsupportedFormat, unknown compat ->
accepted), size, alignment, order, overlap and bounds of every table, each error naming its
field; a longer header, gaps and trailing bytes are accepted. Records: inode flags, types and
ranges, dirent names and order, cycles and shared directories, chunk flags and zero chunks,
file layouts, xattrs, file digests. Writer: refuses what the reader would refuse.
"""

from __future__ import annotations

import stat
import struct
from typing import Any

import pytest
from format_support import exercise

from weenvfs.format import columns
from weenvfs.format import constants as C
from weenvfs.format.compose import ComposedTree
from weenvfs.format.digest import digest_bytes
from weenvfs.format.errors import FormatError, UnsupportedFormat
from weenvfs.format.index import ChunkRecord, GroupIndex, Header, Inode, file_spans
from weenvfs.format.index_writer import ChunkRef, Node, encode_index
from weenvfs.format.validate import check_tree

CS = 4096
BLOB = "ab" * 32
DIR, REG = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644


def _ref(data: bytes, offset: int = 0) -> ChunkRef:
    if data.count(0) == len(data):
        return ChunkRef(digest_bytes(data), None, 0, 0, len(data))
    return ChunkRef(digest_bytes(data), BLOB, offset, 100, len(data))


def sample_tree() -> Node:
    """root/{a/{f, g}, big, dev, link, sub}: 8 inodes, every table non-empty."""
    batch = b"hello world"
    big = b"x" * CS + bytes(CS) + b"y" * 10
    root = Node(DIR)
    a = Node(DIR, xattrs={b"user.k": b"v"})
    root.children[b"a"] = a
    a.children[b"f"] = Node(REG, size=5, chunks=[_ref(batch)], file_digest=digest_bytes(b"hello"))
    a.children[b"g"] = Node(REG, size=5, chunks=[_ref(batch)], inner_offset=6)
    root.children[b"big"] = Node(
        REG, size=len(big), chunks=[_ref(big[:CS]), _ref(bytes(CS)), _ref(big[2 * CS :], 200)]
    )
    root.children[b"dev"] = Node(stat.S_IFCHR | 0o600, rdev=0x0103)
    root.children[b"link"] = Node(stat.S_IFLNK | 0o777, target=b"a/f", size=3)
    root.children[b"sub"] = Node(DIR)
    return root


RAW = encode_index(sample_tree(), CS)
IDX = GroupIndex(RAW)
H = IDX.header
INO = {path: ino for path, ino in IDX.walk()}
_FIELDS: dict[str, tuple[struct.Struct, tuple[str, ...], str]] = {
    "inode": (C.INODE, Inode._fields, "inode_offset"),
    "dirent": (C.DIRENT, ("name_offset", "name_length", "inode"), "dirent_offset"),
    "chunk": (C.CHUNK, ChunkRecord._fields, "chunk_offset"),
    "xattr": (
        C.XATTR,
        ("key_offset", "key_length", "value_offset", "value_length"),
        "xattr_offset",
    ),
    "file_digest": (C.FILE_DIGEST, ("inode", "digest"), "file_digest_offset"),
}


def header(raw: bytes = RAW, **fields: Any) -> bytes:
    """`raw` with header fields replaced."""
    hdr = Header(*C.INDEX_HEADER.unpack_from(raw, 0))._replace(**fields)
    return C.INDEX_HEADER.pack(*hdr) + raw[C.INDEX_HEADER.size :]


def record(table: str, n: int, raw: bytes = RAW, **fields: Any) -> bytes:
    """`raw` with fields of record `n` of `table` replaced."""
    st, names, offset_field = _FIELDS[table]
    at = getattr(Header(*C.INDEX_HEADER.unpack_from(raw, 0)), offset_field) + n * st.size
    values = dict(zip(names, st.unpack_from(raw, at), strict=True)) | fields
    out = bytearray(raw)
    st.pack_into(out, at, *values.values())
    return bytes(out)


def refused(raw: bytes, what: str, *, unsupported: bool = False) -> FormatError:
    """Assert that decoding and exercising `raw` is refused with a message about `what`."""
    with pytest.raises(UnsupportedFormat if unsupported else FormatError) as info:
        exercise(GroupIndex(raw))
    assert what in str(info.value), str(info.value)
    return info.value


def test_sample_is_valid() -> None:
    assert exercise(IDX) == 8
    assert H.chunk_count == 4 and H.xattr_count == 1 and H.file_digest_count == 1
    assert H.feature_incompat == C.INCOMPAT_ZERO_CHUNKS


# -- header -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, 0xFFFF])
def test_unknown_version_is_unsupported(version: int) -> None:
    err = refused(header(version=version), "index version", unsupported=True)
    assert err.what == "index version"


@pytest.mark.parametrize("bit", [1, 5, 31])
def test_unknown_incompat_bit_is_unsupported(bit: int) -> None:
    raw = header(feature_incompat=H.feature_incompat | 1 << bit)
    assert refused(raw, "unknown bits", unsupported=True).what == "index feature_incompat"


@pytest.mark.parametrize("bit", [1, 7, 31])
def test_unknown_compat_bit_is_accepted(bit: int) -> None:
    assert exercise(GroupIndex(header(feature_compat=H.feature_compat | 1 << bit))) == 8


def test_bad_magic_is_a_format_error_not_unsupported() -> None:
    with pytest.raises(FormatError) as info:
        GroupIndex(header(magic=b"WEENVIDY"))
    assert info.value.what == "index magic" and not isinstance(info.value, UnsupportedFormat)


@pytest.mark.parametrize("size", [0, 120, 127, 130, 132])
def test_bad_header_size(size: int) -> None:
    assert refused(header(header_size=size), "invalid value").what == "index header_size"


def test_header_size_past_the_first_table() -> None:
    assert refused(header(header_size=136), "overlaps").what == "index inode_offset"


def test_longer_header_gaps_and_trailing_bytes_are_accepted() -> None:
    # An 8-byte longer header (future fields), tables moved; then a gap; then a trailing table.
    shift = {f: getattr(H, f) + 8 for f in H._fields if f.endswith("_offset")}
    raw = header(RAW[:128] + bytes(8) + RAW[128:], header_size=136, **shift)
    gap = header(
        raw[: shift["string_offset"]] + bytes(16) + raw[shift["string_offset"] :],
        string_offset=shift["string_offset"] + 16,
    )
    for candidate in (raw, gap, gap + bytes(64)):
        index = GroupIndex(candidate)
        assert exercise(index) == 8
        assert [p for p, _ in index.walk()] == list(INO)


@pytest.mark.parametrize("field", [f for f in Header._fields if f.endswith("_offset")])
def test_misaligned_table_offset(field: str) -> None:
    err = refused(header(**{field: getattr(H, field) + 4}), "aligned")
    assert err.what == f"index {field}"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("inode_offset", 120),
        ("dirent_offset", H.inode_offset),
        ("chunk_offset", H.dirent_offset),
        ("string_offset", H.file_digest_offset),
    ],
)
def test_overlapping_or_misordered_tables(field: str, value: int) -> None:
    assert refused(header(**{field: value}), "overlaps").what == f"index {field}"


@pytest.mark.parametrize(
    ("field", "table"),
    [
        ("inode_count", "inode"),
        ("dirent_count", "dirent"),
        ("chunk_count", "chunk"),
        ("xattr_count", "xattr"),
        ("blob_count", "blob"),
        ("file_digest_count", "file_digest"),
        ("string_size", "string"),
    ],
)
@pytest.mark.parametrize("value", [10_000, 0xFFFFFFFF])
def test_table_past_the_end(field: str, table: str, value: int) -> None:
    assert refused(header(**{field: value}), "past the index size").what == f"index {table} table"


def test_string_size_beyond_u32_does_not_overflow() -> None:
    refused(header(string_size=(1 << 64) - 1), "past the index size")
    refused(header(string_offset=(1 << 64) - 8), "past the index size")


@pytest.mark.parametrize("chunk_size", [0, 4095, (64 << 20) + 1, 0xFFFFFFFF])
def test_chunk_size_range(chunk_size: int) -> None:
    assert refused(header(chunk_size=chunk_size), "outside").what == "index chunk_size"


def test_empty_and_rootless() -> None:
    assert refused(header(inode_count=0), "at least").what == "index inode_count"
    assert (
        refused(record("inode", 0, mode=REG, data_count=0), "not a directory").what
        == "index root inode"
    )
    refused(RAW[:127], "index header")


# -- inode records ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "what"),
    [
        (b"a/f", {"flags": 4}, "flags"),
        (b"a/f", {"flags": C.INODE_WHITEOUT}, "flags"),
        (b"a", {"flags": C.INODE_WHITEOUT}, "flags"),
        (b"dev", {"flags": C.INODE_OPAQUE}, "flags"),
        (b"a/f", {"mtime_nsec": 10**9}, "mtime_nsec"),
        (b"a/f", {"mode": 0o030644}, "unknown file type"),
        (b"dev", {"data_count": 1}, "data"),
        (b"a", {"data_count": 100}, "dirent range"),
        (b"big", {"data_first": 3}, "chunk range"),
        (b"link", {"data_count": 4096}, "longer than"),
        (b"link", {"data_first": 10_000}, "string table"),
        (b"a", {"xattr_count": 2}, "xattr"),
    ],
)
def test_inode_rules(path: bytes, fields: dict[str, int], what: str) -> None:
    err = refused(record("inode", INO[path], **fields), what)
    assert err.what.startswith(f"inode {INO[path]}")


def test_whiteout_and_opaque_where_they_belong_are_fine() -> None:
    raw = record("inode", INO[b"dev"], flags=C.INODE_WHITEOUT)
    raw = record("inode", INO[b"sub"], raw, flags=C.INODE_OPAQUE)
    assert exercise(GroupIndex(raw)) == 8


# -- dirents ----------------------------------------------------------------------------------


def _dirent_of(path: bytes) -> int:
    parent, _, name = path.rpartition(b"/")
    first = IDX.inode(INO[parent]).data_first
    return first + [n for n, _ in IDX.entries(INO[parent])].index(name)


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"name_length": 0}, "name_length"),
        ({"name_length": 256}, "name_length"),
        ({"name_offset": 100_000}, "string table"),
        ({"inode": 0}, "not a valid child inode"),
        ({"inode": 99}, "not a valid child inode"),
    ],
)
def test_dirent_fields(fields: dict[str, int], what: str) -> None:
    refused(record("dirent", _dirent_of(b"big"), **fields), what)


def _rename(raw: bytes, path: bytes, new: bytes) -> bytes:
    # Overwrite the name's bytes in the string table (same length).
    off = C.DIRENT.unpack_from(raw, H.dirent_offset + _dirent_of(path) * 12)[0]
    at = H.string_offset + off
    return raw[:at] + new + raw[at + len(new) :]


@pytest.mark.parametrize("bad", [b"/", b"\0", b"."])
def test_dirent_name_content(bad: bytes) -> None:
    refused(_rename(RAW, b"a", bad), "not a valid name")  # 'a' is one byte long


def test_dirent_dotdot() -> None:
    raw = _rename(RAW, b"big", b"..\0")
    raw = record("dirent", _dirent_of(b"big"), raw, name_length=2)
    refused(raw, "not a valid name")


def test_unsorted_names_are_refused_when_listing() -> None:
    raw = _rename(RAW, b"dev", b"zzz")  # between 'big' and 'link': order broken
    index = GroupIndex(raw)
    assert index.lookup(0, b"big") is not None  # lookups still terminate
    with pytest.raises(FormatError, match="not sorted"):
        list(index.entries(0))
    with pytest.raises(FormatError, match="not sorted"):
        list(index.entries(0, start=3))


def test_directory_cycle_is_refused() -> None:
    # a/f now names 'a' itself: a cycle that would make a walk endless.
    raw = record("dirent", _dirent_of(b"a/f"), inode=INO[b"a"])
    with pytest.raises(FormatError, match="more than one path"):
        list(GroupIndex(raw).walk())
    with pytest.raises(FormatError, match="cycle"):
        list(ComposedTree([GroupIndex(raw)]).walk())


def test_shared_directory_is_refused() -> None:
    raw = record("dirent", _dirent_of(b"a/f"), inode=INO[b"sub"])
    with pytest.raises(FormatError, match="more than one path"):
        list(GroupIndex(raw).walk())


@pytest.fixture(params=["native words", "struct"])
def column_reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tree validator's tests run with both ways of reading a table's column."""
    monkeypatch.setattr(columns, "NATIVE_LE", request.param == "native words")


def test_tree_validator_accepts_a_tree(column_reader: None) -> None:
    check_tree(IDX)


@pytest.mark.parametrize(
    ("table", "path", "fields", "what"),
    [
        ("dirent", b"big", {"inode": 0}, "0 is not a valid child inode"),
        ("dirent", b"a/g", {"inode": 99}, "99 is not a valid child inode"),
        ("inode", b"a", {"data_count": 99}, r"inode \d+ data: dirent range \d+\+99 exceeds"),
    ],
)
def test_tree_validator_refuses_bad_entries(
    column_reader: None, table: str, path: bytes, fields: dict[str, int], what: str
) -> None:
    at = _dirent_of(path) if table == "dirent" else INO[path]
    with pytest.raises(FormatError, match=what):
        check_tree(GroupIndex(record(table, at, **fields)))


@pytest.mark.parametrize(("path", "target"), [(b"a/f", b"sub"), (b"a/f", b"a"), (b"sub", b"a")])
def test_tree_validator_refuses_a_directory_reached_twice(
    column_reader: None, path: bytes, target: bytes
) -> None:
    # A directory hardlink (the same directory at /a and /sub), or a cycle: one line, at load.
    raw = record("dirent", _dirent_of(path), inode=INO[target])
    with pytest.raises(FormatError, match="directory inode .* reachable by more than one path"):
        check_tree(GroupIndex(raw))


def test_tree_validator_refuses_overlapping_directories(column_reader: None) -> None:
    # 'sub' claims the root's entries: its children would be reached twice.
    root = IDX.inode(0)
    raw = record("inode", INO[b"sub"], data_first=root.data_first, data_count=root.data_count)
    with pytest.raises(FormatError, match="more than one path|share"):
        check_tree(GroupIndex(raw))


# -- chunks and file data ---------------------------------------------------------------------


def _chunk_of(path: bytes, k: int = 0) -> int:
    return IDX.file_chunks(INO[path])[k]


@pytest.mark.parametrize(
    ("k", "fields", "what"),
    [
        (0, {"flags": 2}, "flags"),
        (0, {"blob": 1}, "not below blob_count"),
        (0, {"ulen": (64 << 20) + 1}, "exceeds"),
        (1, {"blob": 0}, "must not reference a blob"),
        (1, {"offset": 8}, "must not reference a blob"),
        (1, {"clen": 8}, "must not reference a blob"),
        (0, {"ulen": CS - 1}, "length is not"),
        (2, {"ulen": 11}, "length is not"),
        (0, {"offset": 2**64 - 1}, "outside 0..2**63"),
        (0, {"offset": 2**63 - 50}, "outside 0..2**63"),
        (0, {"clen": C.max_frame_size(CS) + 1}, " clen: "),
        (0, {"clen": C.MAX_U32}, f"{C.MAX_U32} exceeds {C.max_frame_size(CS)}"),
        (2, {"clen": C.max_frame_size(10) + 1}, "the most a frame of 10 bytes may take"),
    ],
)
def test_chunk_rules(k: int, fields: dict[str, int], what: str) -> None:
    refused(record("chunk", _chunk_of(b"big", k), **fields), what)


def test_a_frame_at_its_bound_is_accepted() -> None:
    """clen may be anything up to max_frame_size(ulen): the bound refuses only past it."""
    n = _chunk_of(b"big")
    index = GroupIndex(record("chunk", n, clen=C.max_frame_size(CS)))
    assert index.chunk(n).clen == C.max_frame_size(CS)
    assert exercise(index) == 8


def test_zero_chunk_needs_its_incompat_bit() -> None:
    refused(header(feature_incompat=0), "INCOMPAT_ZERO_CHUNKS")


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (b"a/f", {"size": 12}),  # past the end of its (11-byte) batch chunk
        (b"a/g", {"inner_offset": 7}),
        (b"big", {"size": 3 * CS + 1}),
        (b"big", {"inner_offset": 1}),
        (b"big", {"data_count": 0}),
    ],
)
def test_file_layout_rules(path: bytes, fields: dict[str, int]) -> None:
    refused(record("inode", INO[path], **fields), f"inode {INO[path]}")


def test_file_spans_are_exact() -> None:
    spans = file_spans(IDX, INO[b"big"], CS - 1, 2)
    assert [(s.start, s.end) for s in spans] == [(CS - 1, CS), (0, 1)]
    assert file_spans(IDX, INO[b"big"], 3 * CS, 10) == []
    assert [(s.start, s.end) for s in file_spans(IDX, INO[b"a/g"], 1, 100)] == [(7, 11)]
    with pytest.raises(ValueError):
        file_spans(IDX, INO[b"big"], -1, 1)


# -- xattrs and file digests ------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [{"key_length": 0}, {"key_length": 256}, {"value_length": 65537}, {"key_offset": 99_999}],
)
def test_xattr_rules(fields: dict[str, int]) -> None:
    refused(record("xattr", 0, **fields), "xattr")


def test_an_inodes_xattrs_are_bounded_before_any_string_is_copied() -> None:
    """Records may share strings: 8 records naming one 60 KiB value are 480 KiB of xattrs
    from a few hundred bytes of records; the inode is refused, nothing copied."""
    root = Node(DIR)
    root.children[b"big"] = Node(REG, xattrs={b"user.v": b"v" * (60 << 10)})
    root.children[b"many"] = Node(REG, xattrs={b"user.%d" % k: b"x" for k in range(8)})
    raw = encode_index(root, CS)
    index = GroupIndex(raw)
    many, big = index.resolve(b"many"), index.resolve(b"big")
    assert many is not None and big is not None
    first = index.inode(big).xattr_first
    shared = C.XATTR.unpack_from(raw, index.header.xattr_offset + first * C.XATTR.size)
    for n in range(8):
        raw = record("xattr", index.inode(many).xattr_first + n, raw,
                     value_offset=shared[2], value_length=shared[3])
    index = GroupIndex(raw)
    assert len(index.xattrs(big)[0][1]) == 60 << 10
    total = 8 * (len(b"user.0") + (60 << 10))
    with pytest.raises(FormatError, match=f"inode {many} xattrs: {total} bytes exceed"):
        index.xattrs(many)


def test_file_digest_inode_range() -> None:
    raw = record("file_digest", 0, inode=H.inode_count)
    with pytest.raises(FormatError, match="file digest 0 inode"):
        list(GroupIndex(raw).file_digests())
