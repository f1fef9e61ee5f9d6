"""SPEC.md and constants.py cannot drift: the spec's tables are parsed and checked against code.

- every `<!-- struct: NAME SIZE -->` table: offsets contiguous from 0, the sum of the sizes is
  the struct size, each type's size is its width, the field types spell the struct's format
  code for code, and the field names are the decoder's (Header, Inode, ChunkRecord,
  HintRecord); every struct.Struct of constants.py has such a table;
- every `<!-- constants -->` table row equals the constant, and every public constant of
  constants.py that is not a struct is in such a table;
- the manifest example equals the `env` vector's manifest; the magic strings appear.
"""

from __future__ import annotations

import ast
import json
import re
import struct
from typing import Any

import pytest
from format_support import SPEC_PATH, VECTORS_DIR

from weenvfs.format import constants as C
from weenvfs.format import erofs_layout as L
from weenvfs.format.hints import HintRecord
from weenvfs.format.index import ChunkRecord, Header, Inode

SPEC = SPEC_PATH.read_text(encoding="utf-8")
_WIDTH = {"u8": ("B", 1), "u16": ("H", 2), "u32": ("I", 4), "u64": ("Q", 8), "i64": ("q", 8)}
_SIZED = re.compile(r"(bytes|pad)\[(\d+)\]")
DECODED_FIELDS = {
    "INDEX_HEADER": Header._fields,
    "INODE": Inode._fields,
    "CHUNK": ChunkRecord._fields,
    "HINT_RECORD": HintRecord._fields,
}


def _table_after(marker_end: int) -> list[list[str]]:
    """The rows (cells stripped) of the first markdown table after position `marker_end`."""
    lines = SPEC[marker_end:].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:  # skip the header row and the separator
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def struct_tables() -> dict[str, tuple[int, list[list[str]]]]:
    """name -> (declared size, rows) of every struct table."""
    found = {}
    for m in re.finditer(r"<!-- struct: (\w+) (\d+) -->", SPEC):
        assert m.group(1) not in found, f"two tables for {m.group(1)}"
        found[m.group(1)] = (int(m.group(2)), _table_after(m.end()))
    return found


def constant_rows() -> dict[str, str]:
    """name -> value cell of every constants table."""
    rows = {}
    for m in re.finditer(r"<!-- constants -->", SPEC):
        for row in _table_after(m.end()):
            rows[row[0].strip("`")] = row[1].strip("`")
    return rows


def _codes(fmt: str) -> list[str]:
    """struct format as a list of one code per field or pad byte ('32s' stays one code)."""
    out = []
    for count, code in re.findall(r"(\d*)([a-zA-Z?])", fmt.lstrip("<>=!@")):
        n = int(count or 1)
        out.extend([f"{n}s"] if code == "s" else [code] * n)
    return out


def _spec_codes(kind: str) -> tuple[list[str], int]:
    if kind in _WIDTH:
        code, width = _WIDTH[kind]
        return [code], width
    m = _SIZED.fullmatch(kind)
    assert m, f"unknown type {kind!r} in SPEC.md"
    n = int(m.group(2))
    return ([f"{n}s"] if m.group(1) == "bytes" else ["x"] * n), n


# constants.py and erofs_layout.py (SPEC.md section 15) are both mirrored by SPEC tables
MIRRORED = {**vars(C), **vars(L)}
STRUCTS = {name: v for name, v in MIRRORED.items() if isinstance(v, struct.Struct)}
# the field offsets the column readers use (`INODE_AT`: name -> byte offset), by struct
OFFSETS = {name.removesuffix("_AT"): v for name, v in MIRRORED.items()
           if name.endswith("_AT") and isinstance(v, dict)}


def test_every_struct_has_a_table() -> None:
    assert set(struct_tables()) == set(STRUCTS)


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_struct_table_matches_code(name: str) -> None:
    size, rows = struct_tables()[name]
    st = STRUCTS[name]
    assert size == st.size, f"{name}: SPEC says {size} bytes, constants.py {st.size}"
    position, codes, fields, offsets = 0, [], [], {}
    for offset, width, kind, field, *_ in rows:
        assert int(offset) == position, f"{name}.{field}: offset {offset}, expected {position}"
        spec_codes, type_width = _spec_codes(kind)
        assert int(width) == type_width, f"{name}.{field}: size {width} but type {kind}"
        position += type_width
        codes += spec_codes
        if not kind.startswith("pad") and field != "reserved":
            fields.append(field)
            offsets[field] = int(offset)
    assert position == st.size, f"{name}: fields sum to {position}, struct is {st.size}"
    assert codes == _codes(st.format), f"{name}: SPEC types do not spell {st.format!r}"
    if name in DECODED_FIELDS:
        assert tuple(fields) == DECODED_FIELDS[name]
    if name in OFFSETS:
        assert OFFSETS[name] == offsets, f"{name}_AT: not the offsets SPEC.md gives"


def test_field_offsets_cover_the_column_readers() -> None:
    assert {"INODE", "DIRENT"} <= set(OFFSETS)
    with pytest.raises(ValueError):
        C.field_offsets(C.DIRENT, "name_offset inode")  # a field left unnamed


def test_table_parser_sees_what_it_should() -> None:
    size, rows = struct_tables()["INDEX_HEADER"]
    assert size == 128 and rows[0][:4] == ["0", "8", "bytes[8]", "magic"]
    assert _codes("<8sHH4x6I") == ["8s", "H", "H", "x", "x", "x", "x"] + ["I"] * 6


def _literal(cell: str) -> Any:
    return ast.literal_eval(cell)  # a set literal compares equal to a frozenset


def test_constants_tables_match_code() -> None:
    rows = constant_rows()
    public = {
        name: value
        for name, value in MIRRORED.items()
        if name.isupper() and not isinstance(value, struct.Struct)
        and name.removesuffix("_AT") not in OFFSETS
    }
    assert set(rows) == set(public), "constants missing from (or unknown to) SPEC.md section 12"
    for name, cell in rows.items():
        expected = public[name]
        if isinstance(expected, bytes):
            expected = expected.decode("ascii")
        assert _literal(cell) == expected, f"{name}: SPEC says {cell}, constants.py {expected!r}"


def test_magics_and_walking_sizes_in_the_text() -> None:
    assert f"`{C.INDEX_MAGIC.decode()}`" in SPEC and f"`{C.HINT_MAGIC.decode()}`" in SPEC
    layout = _table_after(SPEC.index("### 6.1 Layout and walking"))
    sizes = {row[1]: int(row[3]) for row in layout}
    assert sizes == {
        "inodes": C.INODE.size,
        "dirents": C.DIRENT.size,
        "chunks": C.CHUNK.size,
        "xattrs": C.XATTR.size,
        "blobs": C.BLOB.size,
        "file digests": C.FILE_DIGEST.size,
        "strings": 1,
    }


def test_manifest_example_is_the_env_vector() -> None:
    m = re.search(r"<!-- manifest-example: (\w+) -->\s*```json\n(.*?)```", SPEC, re.S)
    assert m is not None
    stored = (VECTORS_DIR / f"{m.group(1)}.manifest.json").read_bytes()
    assert json.loads(m.group(2)) == json.loads(stored)
