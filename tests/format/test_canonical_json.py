"""Canonical JSON (SPEC.md 8.2, 8.3) against its golden vectors (format/vectors/canonical-json/).

- `cases.json` lists exactly the files generate.py writes there (canonical_json_vectors.py,
  whose expected bytes are written out by hand, and two manifests kept as today's tools
  wrote them); generate.py --check is test_vectors.py's;
- every valid case decodes to what a plain JSON parser reads, and encodes back byte for byte
  from the plain spelling (`.in.json`, keys unsorted, non-ASCII escaped); digests match;
- every invalid case is refused with one FormatError line (manifest cases by the manifest
  reader too); the manifests `weenv convert` and `compose` wrote before the rules existed
  decode and re-encode unchanged, so their digests hold;
- the escape table of SPEC.md is the codec's, and every other scalar value is written raw;
- for random values the rules allow, the bytes are `json.dumps(sort_keys=True,
  separators=(",", ":"), ensure_ascii=False)`'s (the encoder manifests were written with);
- writers' errors name the place (`manifest.provenance.a[1]`) on one line;
- the layer marker of `weenv push` keeps its bytes and reads markers written before.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from format_support import SPEC_PATH, VECTORS_DIR

from weenvfs.format import canonical_json
from weenvfs.format import constants as C
from weenvfs.format.digest import digest_hex
from weenvfs.format.errors import FormatError
from weenvfs.format.manifest import (
    GroupRef,
    Manifest,
    check_provenance,
    decode_manifest,
    encode_manifest,
)
from weenvfs.format.oci_layer import LayerRef, decode_marker

CASES_DIR = VECTORS_DIR / "canonical-json"
CASES: list[dict[str, Any]] = json.loads((CASES_DIR / "cases.json").read_text())["cases"]
D1 = digest_hex(b"one")


def _cases(kind: str, valid: bool) -> list[dict[str, Any]]:
    return [c for c in CASES if c["kind"] == kind and c["valid"] is valid]


def _ids(cases: list[dict[str, Any]]) -> list[str]:
    return [c["name"] for c in cases]


def _old_encoder(value: Any) -> bytes:
    """How every manifest was written before SPEC.md 8.2 existed."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def test_the_generator_writes_this_folder(generator: ModuleType) -> None:
    files = generator.build_all()  # generate.py --check is test_vectors.py's
    listed = {f"canonical-json/{c[key]}" for c in CASES for key in ("file", "input") if key in c}
    assert listed | {"canonical-json/cases.json"} == {n for n in files if "/" in n}


def test_vectors_cover_the_rules() -> None:
    rules = {c["rule"] for c in CASES if not c["valid"]}
    assert rules == {"numbers", "duplicate keys", "whitespace", "encoding", "key order",
                     "escapes", "strings", "depth", "syntax"}
    names = {c["name"] for c in CASES}
    assert {"controls", "key-order", "integers", "float-exponent", "integer-2^53+1",
            "duplicate-key", "lone-high-surrogate", "escape-u2028", "compat-convert",
            "compat-compose", "manifest-provenance-float"} <= names


@pytest.mark.parametrize("case", _cases("json", True), ids=_ids(_cases("json", True)))
def test_valid_cases_decode_and_encode(case: dict[str, Any]) -> None:
    data = (CASES_DIR / case["file"]).read_bytes()
    plain = json.loads((CASES_DIR / case["input"]).read_bytes())
    assert digest_hex(data) == case["digest"]
    assert canonical_json.decode(data) == plain == json.loads(data)
    assert canonical_json.encode(plain) == data
    assert _old_encoder(plain) == data


@pytest.mark.parametrize("case", _cases("manifest", True), ids=_ids(_cases("manifest", True)))
def test_valid_manifests_keep_their_bytes_and_digest(case: dict[str, Any]) -> None:
    data = (CASES_DIR / case["file"]).read_bytes()
    assert digest_hex(data) == case["digest"]
    assert encode_manifest(decode_manifest(data)) == data
    assert canonical_json.encode(canonical_json.decode(data)) == data


def test_compat_manifests_are_what_the_tools_wrote() -> None:
    convert = decode_manifest((CASES_DIR / "valid" / "compat-convert.json").read_bytes())
    assert convert.provenance["converted_by"] == "weenv convert"
    assert convert.config.labels["𝄞"] == "above-bmp" and "SEP=line\u2028para\u2029end" in \
        convert.config.env
    compose = decode_manifest((CASES_DIR / "valid" / "compat-compose.json").read_bytes())
    assert compose.provenance["composed_by"] == "weenv compose" and compose.config.cwd == "/wörk"


@pytest.mark.parametrize("case", [c for c in CASES if not c["valid"]],
                         ids=_ids([c for c in CASES if not c["valid"]]))
def test_invalid_cases_are_refused(case: dict[str, Any]) -> None:
    data = (CASES_DIR / case["file"]).read_bytes()
    with pytest.raises(FormatError) as refused:
        canonical_json.decode(data)
    assert "\n" not in str(refused.value)
    if case["kind"] == "manifest":
        with pytest.raises(FormatError):
            decode_manifest(data)


def _spec_escapes() -> dict[str, str]:
    spec = SPEC_PATH.read_text(encoding="utf-8")
    table = spec[spec.index("<!-- json-escapes -->"):]
    rows = re.findall(r"^\| (U\+[^|]*?) \| `([^`]*)`", table[: table.index("\n\n", 200)], re.M)
    out: dict[str, str] = {}
    for cells, written in rows:
        for first, last in re.findall(r"U\+([0-9A-F]{4})(?:-U\+([0-9A-F]{4}))?", cells):
            for c in range(int(first, 16), int(last or first, 16) + 1):
                out[chr(c)] = written if written != "\\u00" else f"\\u{c:04x}"
    return out


def test_the_escape_table_is_the_codecs() -> None:
    table = _spec_escapes()
    assert len(table) == 34
    assert table == canonical_json.ESCAPES
    for char, written in table.items():
        assert canonical_json.encode(char) == b'"' + written.encode() + b'"'


def test_every_other_scalar_value_is_written_raw() -> None:
    text = "".join(chr(c) for c in range(0x110000)
                   if not 0xD800 <= c <= 0xDFFF and chr(c) not in canonical_json.ESCAPES)
    assert canonical_json.encode(text) == b'"' + text.encode() + b'"'
    assert canonical_json.decode(b'"' + text.encode() + b'"') == text


_CHARS = ["a", "Z", "0", " ", "/", '"', "\\", "\x00", "\x1f", "\n", "\x7f", "é", "\u2028",
          "\u2029", "\ufeff", "\uffff", "ｚ", "𝄞", "\U0010ffff", "~", "_"]


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(8 if depth < C.MAX_JSON_DEPTH else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, C.MAX_SAFE_INTEGER, -C.MAX_SAFE_INTEGER,
                           rng.randrange(-C.MAX_SAFE_INTEGER, C.MAX_SAFE_INTEGER + 1)])
    if kind in (3, 4, 5):
        return "".join(rng.choice(_CHARS) for _ in range(rng.randrange(6)))
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {"".join(rng.choice(_CHARS) for _ in range(rng.randrange(4))):
            _random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def test_random_values_are_what_the_old_encoder_wrote() -> None:
    rng = random.Random(82)
    for _ in range(3000):
        value = _random_value(rng, 1)
        data = canonical_json.encode(value)
        assert data == _old_encoder(value), value
        assert canonical_json.decode(data) == value


@pytest.mark.parametrize(("value", "where", "fragment"), [
    ({"a": [1, {"b": 1.5}]}, "manifest.provenance.a[1].b", "a float (1.5)"),
    ({"a": 1e-05}, "manifest.provenance.a", "a float (1e-05)"),
    ({"a": float("nan")}, "manifest.provenance.a", "a float (nan)"),
    ({"n": 2**53}, "manifest.provenance.n", "integer 9007199254740992 is outside"),
    ({"n": -(2**53)}, "manifest.provenance.n", "is outside"),
    ({"n": 10**2000}, "manifest.provenance.n", "integer of 6644 bits is outside"),
    ({"k y": b"x"}, "manifest.provenance['k y']", "a bytes is not a JSON value"),
    ({"s": {1, 2}}, "manifest.provenance.s", "a set is not a JSON value"),
    ({1: "x"}, "manifest.provenance", "object key 1 is not a string"),
    ({"s": "a\ud800"}, "manifest.provenance.s", "lone surrogate U+D800"),
    ({"\udfff": 1}, "manifest.provenance", "lone surrogate U+DFFF"),
    ({"d": [[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]}, "manifest.provenance.d" + "[0]" * 14,
     "nested deeper than 16 levels"),
])
def test_bad_provenance_is_one_line_naming_the_place(value: Any, where: str, fragment: str
                                                     ) -> None:
    for call in (lambda: check_provenance(value),
                 lambda: encode_manifest(Manifest((GroupRef("g", D1),), provenance=value))):
        with pytest.raises(FormatError) as refused:
            call()
        message = str(refused.value)
        assert message.startswith(where + ": ") and fragment in message, message
        assert "\n" not in message


def test_provenance_to_the_depth_limit_is_accepted() -> None:
    value = {"d": [[[[[[[[[[[[[[1]]]]]]]]]]]]]]}  # provenance at level 2, the last list at 16
    check_provenance(value)
    m = Manifest((GroupRef("g", D1),), provenance=value)
    assert decode_manifest(encode_manifest(m)) == m


def test_an_oversized_manifest_is_refused_by_the_writer() -> None:
    big = Manifest((GroupRef("g", D1),), provenance={"x": "y" * C.MAX_MANIFEST_SIZE})
    with pytest.raises(FormatError, match="exceed"):
        encode_manifest(big)


def test_parse_takes_any_spelling_but_not_other_values() -> None:
    assert canonical_json.parse(b' { "b" : [1 , "\\u00e9"], "a": null }\n') == {
        "a": None, "b": [1, "é"]}
    for data in (b'{"a":1.0}', b'{"a":1,"a":2}', b'["\\ud800"]', b"[" * 17 + b"]" * 17):
        with pytest.raises(FormatError):
            canonical_json.parse(data)


MARKER_REF = LayerRef("s3://bucket/prefix?endpoint=http://127.0.0.1:8333", "ab" * 32, 3, "cd" * 32)


def test_the_layer_marker_keeps_its_bytes() -> None:
    body = {"version": 1, "store": MARKER_REF.store, "manifest": MARKER_REF.manifest,
            "position": 3, "index": MARKER_REF.index}
    before = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()  # its old writer
    assert MARKER_REF.marker() == before == canonical_json.encode(body)


def test_a_marker_written_before_is_read() -> None:
    ref = LayerRef("/srv/störe", "ab" * 32, 0, "cd" * 32)
    body = {"version": 1, "store": ref.store, "manifest": ref.manifest, "position": 0,
            "index": ref.index}
    old = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()  # escaped ö
    assert b"\\u00f6" in old and old != ref.marker()
    assert decode_marker("layer-0.json", old) == ref == decode_marker("layer-0.json",
                                                                        ref.marker())
    with pytest.raises(FormatError, match="integers only"):
        decode_marker("layer-0.json", old.replace(b'"position":0', b'"position":0.0'))


def test_vector_paths_are_plain_files() -> None:
    for case in CASES:
        for key in ("file", "input"):
            if key in case:
                assert (CASES_DIR / case[key]).is_file()
                assert Path(case[key]).parts[0] in ("valid", "invalid")
