"""Manifests (SPEC.md 8), hints (9), tags, names and keys (3, 10).

- manifests: canonical round trip; refusal of every non-canonical spelling (whitespace, key
  order, escaped non-ASCII, duplicate keys, extra or missing fields, NaN), bad digests, bad
  types, wrong schema (unsupported), hostile JSON (deep nesting, lone surrogates), truncation
  at every offset; all as FormatError;
- hints: round trip, truncation at every offset, wrong magic/version/length, writer checks;
- refs: names and tags grammar including hostile ones, keys, tag contents.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from weenvfs.format import constants as C
from weenvfs.format.chunk import compress_object, decompress_object
from weenvfs.format.digest import digest_hex
from weenvfs.format.errors import FormatError, UnsupportedFormat
from weenvfs.format.hints import (
    Hint,
    HintFile,
    HintPack,
    HintRecord,
    decode_hint,
    encode_hint,
)
from weenvfs.format.manifest import (
    GroupRef,
    Manifest,
    RuntimeConfig,
    decode_manifest,
    encode_manifest,
)
from weenvfs.format.refs import (
    check_name,
    check_tag,
    decode_tag,
    encode_tag,
    object_key,
    parse_name_tag,
    parse_tag_key,
    tag_key,
)

D1, D2 = digest_hex(b"one"), digest_hex(b"two")
MANIFEST = Manifest(
    (GroupRef("base-os", D1), GroupRef("python/3.11", D2)),
    RuntimeConfig(
        ("PATH=/bin", "LANG=é"), "/work", "1000:1000", ("/bin/sh",), ("-c", "x"), {"k": "ünï"}
    ),
    D2,
    {"source": "docker.io/x@sha256:00", "n": 3, "nested": {"list": [1, "two", None, True]}},
)
DATA = encode_manifest(MANIFEST)


def test_manifest_round_trip() -> None:
    assert decode_manifest(DATA) == MANIFEST
    assert encode_manifest(decode_manifest(DATA)) == DATA
    assert "ü".encode() in DATA and b"\\u" not in DATA  # UTF-8, not escaped
    assert (
        json.dumps(
            json.loads(DATA), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()
        == DATA
    )


def _edit(**changes: Any) -> bytes:
    obj = json.loads(DATA)
    for key, value in changes.items():
        if value is ...:
            del obj[key]
        else:
            obj[key] = value
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


NON_CANONICAL = {
    "trailing newline": DATA + b"\n",
    "spaces": json.dumps(json.loads(DATA), sort_keys=True, ensure_ascii=False).encode(),
    "indented": json.dumps(json.loads(DATA), sort_keys=True, indent=1, ensure_ascii=False).encode(),
    "key order": json.dumps(
        dict(reversed(json.loads(DATA).items())), separators=(",", ":"), ensure_ascii=False
    ).encode(),
    "escaped non-ASCII": json.dumps(
        json.loads(DATA), sort_keys=True, separators=(",", ":")
    ).encode(),
    "duplicate key": DATA.replace(b'"hints":', b'"hints":null,"hints":', 1),
    "extra field": _edit(extra=1),
    "extra config field": DATA.replace(b'"config":{', b'"config":{"aaa":1,', 1),
    "BOM": b"\xef\xbb\xbf" + DATA,
}


@pytest.mark.parametrize("name", sorted(NON_CANONICAL))
def test_non_canonical_manifests_are_refused(name: str) -> None:
    data = NON_CANONICAL[name]
    assert data != DATA
    with pytest.raises(FormatError):
        decode_manifest(data)


BAD = {
    "missing groups": _edit(groups=...),
    "no groups": _edit(groups=[]),
    "too many groups": _edit(groups=[{"index": D1, "name": "g"}] * 129),
    "uppercase digest": _edit(groups=[{"index": D1.upper(), "name": "g"}]),
    "short digest": _edit(groups=[{"index": D1[:63], "name": "g"}]),
    "prefixed digest": _edit(groups=[{"index": "blake3:" + D1, "name": "g"}]),
    "bad hints digest": _edit(hints="x" * 64),
    "hints type": _edit(hints=1),
    "group type": _edit(groups=["x"]),
    "group name type": _edit(groups=[{"index": D1, "name": 1}]),
    "provenance type": _edit(provenance=[]),
    "missing config": _edit(config=...),
    "relative cwd": DATA.replace(b'"cwd":"/work"', b'"cwd":"work"'),
    "env type": DATA.replace(b'"env":["PATH=/bin","LANG=\xc3\xa9"]', b'"env":[1]'),
    "labels type": DATA.replace('"k":"ünï"'.encode(), b'"k":1'),
    "media type": DATA.replace(b"v1+json", b"v2+json"),
    "not an object": b"[]",
    "not JSON": b"{",
    "not UTF-8": DATA.replace(b"\xc3\xa9", b"\xe9"),
    "NaN": DATA.replace(b'"n":3', b'"n":NaN'),
    "Infinity": DATA.replace(b'"n":3', b'"n":Infinity'),
    "huge float": DATA.replace(b'"n":3', b'"n":1e999'),
    "lone surrogate": DATA.replace(b'"user":"1000:1000"', b'"user":"\\ud800"'),
    "deep nesting": DATA.replace(b'"n":3', b'"n":' + b"[" * 100_000 + b"]" * 100_000),
    "too large": b" " * (C.MAX_MANIFEST_SIZE + 1),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_manifests_are_refused(name: str) -> None:
    assert BAD[name] != DATA
    with pytest.raises(FormatError):
        decode_manifest(BAD[name])


def test_unknown_schema_is_unsupported() -> None:
    with pytest.raises(UnsupportedFormat):
        decode_manifest(_edit(schemaVersion=3))
    with pytest.raises(FormatError, match="canonical"):  # schema 2 means "names an image"
        decode_manifest(_edit(schemaVersion=2))


def test_a_published_erofs_image_makes_schema_2() -> None:
    manifest = decode_manifest(DATA)
    image = "ab" * 32
    groups = (GroupRef(manifest.groups[0].name, manifest.groups[0].index, image),
              *manifest.groups[1:])
    data = encode_manifest(Manifest(groups, manifest.config, manifest.hints,
                                    manifest.provenance))
    obj = json.loads(data)
    assert obj["schemaVersion"] == 2 and obj["groups"][0]["erofs"] == image
    assert "erofs" not in obj["groups"][1]
    assert decode_manifest(data).groups[0].erofs == image
    obj["schemaVersion"] = 1  # an image in a schema 1 manifest is an unknown field
    with pytest.raises(FormatError, match="canonical"):
        decode_manifest(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(FormatError, match="erofs"):
        encode_manifest(Manifest((GroupRef("g", manifest.groups[0].index, "nope"),)))


def test_manifest_truncated_at_every_offset() -> None:
    for cut in range(len(DATA)):
        with pytest.raises(FormatError):
            decode_manifest(DATA[:cut])


@pytest.mark.parametrize(
    "manifest",
    [
        Manifest(()),
        Manifest((GroupRef("g", "x"),)),
        Manifest((GroupRef("g", D1),), RuntimeConfig(cwd="rel")),
        Manifest((GroupRef("g", D1),), hints="nope"),
        Manifest((GroupRef("g", D1),), provenance={"x": float("nan")}),
        Manifest((GroupRef("g", D1),), provenance={"x": object()}),
        Manifest((GroupRef("g", D1),), RuntimeConfig(user="\udc80")),
    ],
)
def test_encoder_refuses_invalid_manifests(manifest: Manifest) -> None:
    with pytest.raises(FormatError):
        encode_manifest(manifest)


# -- hints ------------------------------------------------------------------------------------

HINT = Hint(D1, (HintRecord(0, 5, 0), HintRecord(2, 0xFFFFFFFF, 17), HintRecord(127, 0, 2**32 - 1)))


def test_hint_round_trip() -> None:
    stored = encode_hint(HINT)
    assert decode_hint(stored) == HINT
    assert decode_hint(encode_hint(Hint(D2, ()))) == Hint(D2, ())


def _raw_hint(**fields: Any) -> bytes:
    head = (
        dict(
            magic=C.HINT_MAGIC,
            version=C.HINT_VERSION,
            reserved=0,
            manifest=bytes.fromhex(D1),
            count=1,
        )
        | fields
    )
    return compress_object(C.HINT_HEADER.pack(*head.values()) + C.HINT_RECORD.pack(1, 0, 2, 3))


def test_hint_header_rules() -> None:
    assert decode_hint(_raw_hint()) == Hint(D1, (HintRecord(1, 2, 3),))
    assert decode_hint(_raw_hint(reserved=7)).records  # reserved is ignored
    with pytest.raises(FormatError, match="hint magic"):
        decode_hint(_raw_hint(magic=b"WEENVIDX"))
    with pytest.raises(UnsupportedFormat):
        decode_hint(_raw_hint(version=4))
    for version in (2, 3):
        with pytest.raises(FormatError, match="hint file table"):
            decode_hint(_raw_hint(version=version))  # without its file table
    for count in (0, 2, 0xFFFFFFFF):
        with pytest.raises(FormatError, match="hint records"):
            decode_hint(_raw_hint(count=count))
    with pytest.raises(FormatError, match="hint header"):
        decode_hint(compress_object(b"WEENVHNT"))


FILES_HINT = HINT._replace(files=(HintFile(0, 7, 1), HintFile(2, 0xFFFFFFFF, 9),
                                  HintFile(127, 0, 2**32 - 1)))


def test_a_hint_without_files_is_version_1_and_with_files_version_2() -> None:
    raw = decompress_object(encode_hint(HINT), "hint", C.MAX_HINT_SIZE)
    assert C.HINT_HEADER.unpack_from(raw)[1] == C.HINT_VERSION == 1
    assert len(raw) == 48 + 12 * 3  # as before version 2 existed
    raw = decompress_object(encode_hint(FILES_HINT), "hint", C.MAX_HINT_SIZE)
    assert C.HINT_HEADER.unpack_from(raw)[1] == C.HINT_FILES_VERSION == 2
    assert len(raw) == 48 + 12 * 3 + 8 + 12 * 3
    at = 48 + 12 * 3
    assert C.HINT_FILES_HEAD.unpack_from(raw, at) == (3, 0)
    assert C.HINT_FILE.unpack_from(raw, at + 8 + 12) == (2, 0, 0xFFFFFFFF, 9)
    assert decode_hint(encode_hint(FILES_HINT)) == FILES_HINT


def test_hint_file_table_rules() -> None:
    head = C.HINT_HEADER.pack(C.HINT_MAGIC, 2, 0, bytes.fromhex(D1), 1)
    head += C.HINT_RECORD.pack(1, 0, 2, 3)

    def files(count: int, records: int, reserved: int = 0) -> bytes:
        table = C.HINT_FILES_HEAD.pack(count, reserved)
        table += b"".join(C.HINT_FILE.pack(0, 5, n, n) for n in range(records))
        return compress_object(head + table)

    assert decode_hint(files(2, 2, reserved=9)).files == (HintFile(0, 0, 0), HintFile(0, 1, 1))
    for count, records in ((3, 2), (1, 2), (0xFFFFFFFF, 0)):
        with pytest.raises(FormatError, match="hint file records"):
            decode_hint(files(count, records))
    with pytest.raises(FormatError, match="hint file record"):
        encode_hint(HINT._replace(files=(HintFile(0x10000, 0, 0),)))
    with pytest.raises(FormatError, match="file records exceed"):
        encode_hint(HINT._replace(files=(HintFile(0, 0, 0),) * (C.MAX_HINT_FILES + 1)))


D2 = "b" * 64
PACKED_HINT = FILES_HINT._replace(pack=HintPack(D2, 30, (10, 0, 20)))


def test_a_hint_with_a_pack_is_version_3() -> None:
    raw = decompress_object(encode_hint(PACKED_HINT), "hint", C.MAX_HINT_SIZE)
    assert C.HINT_HEADER.unpack_from(raw)[1] == C.HINT_PACK_VERSION == 3
    at = 48 + 12 * 3 + 8 + 12 * 3
    assert len(raw) == at + 48 + 4 * 3
    assert C.HINT_PACK_HEAD.unpack_from(raw, at) == (bytes.fromhex(D2), 30, 3, 0)
    assert C.HINT_PACK_ENTRY.unpack_from(raw, at + 48 + 8) == (20,)
    assert decode_hint(encode_hint(PACKED_HINT)) == PACKED_HINT
    assert PACKED_HINT.pack.offsets() == [0, 10, 10]
    no_files = HINT._replace(pack=PACKED_HINT.pack)  # version 3 keeps an empty file table
    raw = decompress_object(encode_hint(no_files), "hint", C.MAX_HINT_SIZE)
    assert C.HINT_FILES_HEAD.unpack_from(raw, 48 + 12 * 3) == (0, 0)
    assert decode_hint(encode_hint(no_files)) == no_files


def test_hint_pack_table_rules() -> None:
    head = C.HINT_HEADER.pack(C.HINT_MAGIC, 3, 0, bytes.fromhex(D1), 2)
    head += C.HINT_RECORD.pack(1, 0, 2, 3) + C.HINT_RECORD.pack(1, 0, 4, 5)
    head += C.HINT_FILES_HEAD.pack(0, 0)

    def packed(size: int, count: int, lengths: list[int], reserved: int = 0) -> bytes:
        table = C.HINT_PACK_HEAD.pack(bytes.fromhex(D2), size, count, reserved)
        return compress_object(head + table + b"".join(C.HINT_PACK_ENTRY.pack(n) for n in lengths))

    assert decode_hint(packed(7, 2, [3, 4], reserved=1)).pack == HintPack(D2, 7, (3, 4))
    for size, count, lengths in ((8, 2, [3, 4]), (7, 3, [3, 4]), (7, 2, [7]), (7, 2, [3, 4, 0]),
                                 (0, 2, [0, 0])):
        with pytest.raises(FormatError, match="hint pack"):
            decode_hint(packed(size, count, lengths))
    for pack in (HintPack(D2, 3, (3,)), HintPack("zz", 3, (3, 0)), HintPack(D2, 4, (3, 0)),
                 HintPack(D2, 0, (0, 0)), HintPack(D2, 1 << 32, (1 << 32, 0))):
        with pytest.raises(FormatError):
            encode_hint(HINT._replace(records=HINT.records[:2], pack=pack))


def test_hint_truncated_at_every_offset() -> None:
    stored = encode_hint(HINT)
    for cut in range(len(stored)):
        with pytest.raises(FormatError):
            decode_hint(stored[:cut])
    raw = C.HINT_HEADER.pack(C.HINT_MAGIC, 1, 0, bytes.fromhex(D1), 3)
    raw += b"".join(C.HINT_RECORD.pack(r.group, 0, r.chunk, r.time_ms) for r in HINT.records)
    for cut in range(len(raw)):
        with pytest.raises(FormatError):
            decode_hint(compress_object(raw[:cut]))
    for hint in (FILES_HINT, PACKED_HINT):
        raw = decompress_object(encode_hint(hint), "hint", C.MAX_HINT_SIZE)
        for cut in range(len(raw)):
            with pytest.raises(FormatError):
                decode_hint(compress_object(raw[:cut]))


@pytest.mark.parametrize(
    "hint",
    [
        Hint("ab", ()),
        Hint(D1.upper(), ()),
        Hint(D1, (HintRecord(1 << 16, 0, 0),)),
        Hint(D1, (HintRecord(0, -1, 0),)),
        Hint(D1, (HintRecord(0, 0, 1 << 32),)),
    ],
)
def test_hint_writer_refuses(hint: Hint) -> None:
    with pytest.raises(FormatError):
        encode_hint(hint)


def test_hint_record_limit_is_in_the_decompression_limit() -> None:
    head = C.HINT_HEADER.pack(C.HINT_MAGIC, 2, 0, bytes.fromhex(D1), C.MAX_HINT_RECORDS + 1)
    frame = compress_object(head + bytes(12 * (C.MAX_HINT_RECORDS + 1) + 8))
    with pytest.raises(FormatError, match="hint records"):  # fits the raw limit: counted
        decode_hint(frame)
    frame = compress_object(head + bytes(C.MAX_HINT_SIZE + 1 - len(head)))
    with pytest.raises(FormatError, match="exceeds the limit"):
        decode_hint(frame)
    assert struct.calcsize("<8sHH32sI") == 48


# -- names, tags and keys ---------------------------------------------------------------------

GOOD_NAMES = ["a", "base-os", "python/3.11", "team.a/task_1", "a" * 255, "0", "a-b_c.d/e"]
BAD_NAMES = [
    "",
    "..",
    ".",
    "Base",
    "/x",
    "x/",
    "a//b",
    "a..b",
    "a--b",
    "-a",
    "a-",
    "a b",
    "a:b",
    "a~b",
    "é",
    "a" * 256,
    "a/../b",
    "\0",
]
GOOD_TAGS = ["latest", "v1.2.3", "2024-01-01_a", "_", "A" * 128, "V1"]
BAD_TAGS = ["", ".x", "-x", "a/b", "a:b", "A" * 129, "a b", "é", "..", "a\n"]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names(name: str) -> None:
    with pytest.raises(FormatError):
        check_name(name)


@pytest.mark.parametrize("tag", GOOD_TAGS)
def test_good_tags(tag: str) -> None:
    assert check_tag(tag) == tag


@pytest.mark.parametrize("tag", BAD_TAGS)
def test_bad_tags(tag: str) -> None:
    with pytest.raises(FormatError):
        check_tag(tag)


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("base-os", ("base-os", "latest")),
        ("base-os:v1", ("base-os", "v1")),
        ("python/3.11:slim", ("python/3.11", "slim")),
        ("python/3.11", ("python/3.11", "latest")),
    ],
)
def test_parse_name_tag(ref: str, expected: tuple[str, str]) -> None:
    assert parse_name_tag(ref) == expected


@pytest.mark.parametrize(
    "ref", ["", ":", "a:", ":b", "A:b", "a:b:c", "host:5000/x", "a:.b", "../x"]
)
def test_parse_name_tag_refuses(ref: str) -> None:
    with pytest.raises(FormatError):
        parse_name_tag(ref)


def test_a_refused_reference_is_named_whole() -> None:
    with pytest.raises(FormatError, match="'a:b:c' is not NAME"):
        parse_name_tag("a:b:c")


def test_keys() -> None:
    assert object_key("blobs", D1) == f"blobs/{D1}"
    assert tag_key("groups", "python/3.11", "latest") == "tags/groups/python~3.11/latest"
    assert parse_tag_key("tags/groups/python~3.11/latest") == ("groups", "python/3.11", "latest")
    assert tag_key("hints", D1, "run-1") == f"tags/hints/{D1}/run-1"
    for kind, name, tag in [("envs", "A", "x"), ("hints", "base", "x"), ("envs", "a", "a/b")]:
        with pytest.raises(FormatError):
            tag_key(kind, name, tag)
    with pytest.raises(ValueError):
        object_key("tags", D1)
    with pytest.raises(FormatError):
        object_key("blobs", D1[:-1])
    for key in ["tags/groups/a", "tags/other/a/b", "blobs/x/y/z", "tags/groups/a/b/c"]:
        with pytest.raises(FormatError):
            parse_tag_key(key)


def test_tag_content() -> None:
    assert encode_tag(D1) == (D1 + "\n").encode() and len(encode_tag(D1)) == 65
    assert decode_tag(encode_tag(D1)) == D1
    for bad in [
        D1.encode(),
        (D1 + "\r\n").encode(),
        (D1 + "\n\n").encode(),
        b" " + encode_tag(D1),
        D1.upper().encode() + b"\n",
        b"\xff" * 65,
        b"",
    ]:
        with pytest.raises(FormatError):
            decode_tag(bad)
