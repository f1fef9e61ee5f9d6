"""Golden vectors of canonical JSON (SPEC.md 8.2, 8.3, 13): the files of
`format/vectors/canonical-json/`, which `generate.py` writes and checks with the others.

Plain files another language's tests can load, listed in `canonical-json/cases.json`:

- `valid/<name>.json`: canonical bytes. The expected bytes of every generic case are written
  out by hand below (not produced by the codec under test), and the generator refuses to write
  them unless `canonical_json.encode` agrees. Each has `valid/<name>.in.json`, the same value
  spelled as ordinary JSON (indented, keys in reverse order, non-ASCII escaped) for an encoder
  to read with any JSON parser and re-encode;
- `valid/compat-convert.json`, `valid/compat-compose.json`: manifests exactly as `weenv
  convert` and `weenv compose` wrote them before SPEC.md 8.2 was written (not generated here:
  kept as found, and checked to decode to the same bytes);
- `invalid/<name>.json`: bytes a reader must refuse, each breaking one rule;
- manifest cases (`"kind": "manifest"`): a manifest reader must accept the valid ones and
  re-encode them byte for byte, and refuse the invalid ones (whose defects are all canonical
  JSON defects, so a plain canonical JSON reader refuses them too).

Must not: import anything but the stdlib and `weenvfs.format` (generate.py imports it by
path). Changing these bytes changes what readers accept: note it in SPEC.md's changelog.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from weenvfs.format import canonical_json
from weenvfs.format import constants as C
from weenvfs.format.digest import digest_hex
from weenvfs.format.errors import FormatError
from weenvfs.format.manifest import (
    GroupRef,
    Manifest,
    RuntimeConfig,
    decode_manifest,
    encode_manifest,
)

HERE = Path(__file__).resolve().parent / "canonical-json"
D1 = "01772a0749a901d2957bcb688f39faf821f531a7312a4b09b1be953014760c6d"  # any digests will do
D2 = "8943039342f481b2c246caa4dc19859b67a6218aaeb67d1886a2be81bbfc2642"

# name -> (value, its canonical bytes written out by hand, what it exercises)
VALID: dict[str, tuple[Any, bytes, str]] = {
    "controls": (
        ["".join(chr(c) for c in range(0x20))],
        b'["\\u0000\\u0001\\u0002\\u0003\\u0004\\u0005\\u0006\\u0007\\b\\t\\n\\u000b\\f\\r'
        b"\\u000e\\u000f\\u0010\\u0011\\u0012\\u0013\\u0014\\u0015\\u0016\\u0017\\u0018\\u0019"
        b'\\u001a\\u001b\\u001c\\u001d\\u001e\\u001f"]',
        "U+0000-U+001F: the five short escapes, the rest as lowercase \\u00xx",
    ),
    "quote-backslash-solidus": (
        ['"', "\\", "/", 'a"b\\c/d'],
        b'["\\"","\\\\","/","a\\"b\\\\c/d"]',
        "quote and backslash escaped; the solidus is not",
    ),
    "raw-non-ascii": (
        ["\x7f", "\x80", "é", "\u2028", "\u2029", "\ufeff", "\uffff", "𝄞", "\U0010ffff", "☃"],
        b'["\x7f","\xc2\x80","\xc3\xa9","\xe2\x80\xa8","\xe2\x80\xa9","\xef\xbb\xbf",'
        b'"\xef\xbf\xbf","\xf0\x9d\x84\x9e","\xf4\x8f\xbf\xbf","\xe2\x98\x83"]',
        "DEL, U+2028, U+2029, U+FEFF inside a string and all non-ASCII: raw UTF-8",
    ),
    "key-order": (
        {"b": 1, "a": 2, "": 3, "A": 4, "aa": 5, "a\x00": 6, "ab": 7, "é": 8, "z": 9,
         "ｚ": 10, "𝄞": 11, "\U0010ffff": 12, "~": 13, "\x7f": 14},
        b'{"":3,"A":4,"a":2,"a\\u0000":6,"aa":5,"ab":7,"b":1,"z":9,"~":13,"\x7f":14,'
        b'"\xc3\xa9":8,"\xef\xbd\x9a":10,"\xf0\x9d\x84\x9e":11,"\xf4\x8f\xbf\xbf":12}',
        "keys by code point (= UTF-8 bytes), a prefix first; U+FF5A before U+1D11E, unlike "
        "UTF-16 order",
    ),
    "nested-order": (
        {"z": {"b": [{"d": 1, "c": 2}], "a": None}, "a": {}},
        b'{"a":{},"z":{"a":null,"b":[{"c":2,"d":1}]}}',
        "every object sorted, at every level; arrays keep their order",
    ),
    "integers": (
        [0, 1, -1, 10, -10, 1234567890, C.MAX_SAFE_INTEGER, -C.MAX_SAFE_INTEGER],
        b"[0,1,-1,10,-10,1234567890,9007199254740991,-9007199254740991]",
        "integers in decimal, up to +-(2^53 - 1)",
    ),
    "literals": (
        [True, False, None, "", [], {}, [[]], [{}]],
        b'[true,false,null,"",[],{},[[]],[{}]]',
        "true, false, null, empty string, array and object",
    ),
    "depth-16": (
        [[[[[[[[[[[[[[[{"a": 1}]]]]]]]]]]]]]]],
        b'[[[[[[[[[[[[[[[{"a":1}]]]]]]]]]]]]]]]',
        "MAX_JSON_DEPTH levels: 15 arrays around an object",
    ),
    "top-level-string": (
        "é\u2028",
        b'"\xc3\xa9\xe2\x80\xa8"',
        "a value need not be an object",
    ),
}

# name -> what it is (the files are kept as found)
COMPAT = {
    "compat-convert": "a manifest `weenv convert` wrote before SPEC.md 8.2 existed (image config "
                      "with non-ASCII, controls, quotes, U+2028/U+2029, DEL, keys U+FFFF and "
                      "U+1D11E)",
    "compat-compose": "a manifest `weenv compose` wrote before SPEC.md 8.2 existed (schema 2, "
                      "non-ASCII env, labels and cwd)",
}

# name -> (bytes, rule broken, what)
INVALID: dict[str, tuple[bytes, str, str]] = {
    "float-fraction": (b'{"a":1.5}', "numbers", "a fraction"),
    "float-exponent": (b'{"a":1e-05}', "numbers", "an exponent (what Python writes for 0.00001)"),
    "float-integral": (b'{"a":1.0}', "numbers", "an integral value spelled as a float"),
    "integer-exponent": (b'{"a":1E2}', "numbers", "an integer spelled with an exponent"),
    "integer-2^53": (b'{"a":9007199254740992}', "numbers", "2^53, one beyond the range"),
    "integer-2^53+1": (b'{"a":9007199254740993}', "numbers", "2^53 + 1"),
    "integer-minus-2^53": (b'{"a":-9007199254740992}', "numbers", "-2^53"),
    "integer-huge": (b'{"a":' + b"9" * 400 + b"}", "numbers", "a 400-digit integer"),
    "minus-zero": (b'{"a":-0}', "numbers", "-0"),
    "leading-zero": (b'{"a":01}', "numbers", "a leading zero"),
    "plus-sign": (b'{"a":+1}', "numbers", "a plus sign"),
    "nan": (b'{"a":NaN}', "numbers", "NaN"),
    "infinity": (b'{"a":-Infinity}', "numbers", "-Infinity"),
    "duplicate-key": (b'{"a":1,"a":1}', "duplicate keys", "the same key twice, same value"),
    "duplicate-key-escaped": (
        b'{"a":1,"\\u0061":2}', "duplicate keys", "the same key, once escaped"),
    "space-after-colon": (b'{"a": 1}', "whitespace", "a space after ':'"),
    "space-after-comma": (b"[1, 2]", "whitespace", "a space after ','"),
    "leading-space": (b' {"a":1}', "whitespace", "a space before the value"),
    "trailing-newline": (b'{"a":1}\n', "whitespace", "a line feed after the value"),
    "indented": (b'{\n "a":1\n}', "whitespace", "indentation"),
    "byte-order-mark": (b'\xef\xbb\xbf{"a":1}', "encoding", "a UTF-8 byte order mark"),
    "key-order": (b'{"b":1,"a":2}', "key order", "members not sorted"),
    "key-order-utf16": (
        b'{"\xf0\x9d\x84\x9e":1,"\xef\xbd\x9a":2}', "key order",
        "U+1D11E before U+FF5A: UTF-16 order, not code point order"),
    "key-order-prefix": (b'{"aa":1,"a":2}', "key order", "a prefix after the longer key"),
    "escape-solidus": (b'["a\\/b"]', "escapes", "an escaped solidus"),
    "escape-ascii": (b'["\\u0041"]', "escapes", "a printable ASCII character escaped"),
    "escape-long-newline": (b'["\\u000a"]', "escapes", "\\u000a where \\n is canonical"),
    "escape-uppercase-hex": (b'["\\u001F"]', "escapes", "uppercase hex digits"),
    "escape-non-ascii": (b'["\\u00e9"]', "escapes", "a non-ASCII character escaped"),
    "escape-u2028": (b'["\\u2028"]', "escapes", "U+2028 escaped"),
    "escape-del": (b'["\\u007f"]', "escapes", "DEL escaped"),
    "escape-surrogate-pair": (b'["\\ud834\\udd1e"]', "escapes", "U+1D11E as a surrogate pair"),
    "lone-high-surrogate": (b'["\\ud800"]', "strings", "an escaped lone high surrogate"),
    "lone-low-surrogate": (b'["\\udc00"]', "strings", "an escaped lone low surrogate"),
    "reversed-surrogates": (b'["\\udd1e\\ud834"]', "strings", "a low then a high surrogate"),
    "lone-surrogate-key": (b'{"\\ud800":1}', "strings", "a lone surrogate in a key"),
    "utf8-encoded-surrogate": (b'["\xed\xa0\x80"]', "encoding", "U+D800 encoded in UTF-8"),
    "utf8-overlong": (b'["\xc0\xaf"]', "encoding", "an overlong encoding of '/'"),
    "utf8-truncated": (b'["\xc3"]', "encoding", "a truncated sequence"),
    "latin-1": (b'["\xe9"]', "encoding", "a Latin-1 byte, not UTF-8"),
    "raw-control": (b'["a\x01b"]', "strings", "a raw control character in a string"),
    "raw-tab": (b'["a\tb"]', "strings", "a raw tab in a string"),
    "depth-17": (b"[" * 16 + b'{"a":1}' + b"]" * 16, "depth", "17 levels of nesting"),
    "trailing-comma": (b"[1,]", "syntax", "a trailing comma"),
    "single-quotes": (b"{'a':1}", "syntax", "single quotes"),
    "two-values": (b"{}{}", "syntax", "two values"),
    "empty": (b"", "syntax", "no value"),
}


def manifest_base() -> bytes:
    """A small canonical manifest whose provenance the invalid manifest cases replace."""
    config = RuntimeConfig(("LANG=C.UTF-8",), "/work", "", ("/bin/sh",), (), {"k": "v"})
    return encode_manifest(Manifest((GroupRef("base", D1), GroupRef("top", D2)), config))


def _with_provenance(body: bytes) -> bytes:
    base = manifest_base()
    assert base.count(b'"provenance":{}') == 1
    return base.replace(b'"provenance":{}', b'"provenance":' + body)


def manifest_cases() -> tuple[dict[str, tuple[bytes, str]], dict[str, tuple[bytes, str, str]]]:
    """(valid manifests by name, invalid manifests by name), all built from `manifest_base`."""
    deepest = b'{"p":' + b"[" * 13 + b"1" + b"]" * 13 + b"}"  # provenance at level 2 -> 16
    rich = (b'{"at":"2026-12-01T00:00:00Z","bytes":9007199254740991,"deep":' + deepest
            + b',"n":-9007199254740991,"s":"\\"\\\\\\b\\t\\n\\f\\r\\u0000\\u001f'
            b'\xe2\x80\xa8\xf0\x9d\x84\x9e","\x7f":1,"\xc3\xa9":true,"\xef\xbd\x9a":null,'
            b'"\xf0\x9d\x84\x9e":[]}')
    valid = {"manifest-provenance-limits": (
        _with_provenance(rich),
        "provenance with every escape, non-ASCII keys, integers at the limits and nesting "
        "to level 16")}
    invalid = {
        "manifest-provenance-float": (
            _with_provenance(b'{"built_at":1764547200.5}'), "numbers", "a float in provenance"),
        "manifest-provenance-exponent": (
            _with_provenance(b'{"ratio":1e-05}'), "numbers", "1e-05 in provenance"),
        "manifest-provenance-integer": (
            _with_provenance(b'{"size":9007199254740992}'), "numbers", "2^53 in provenance"),
        "manifest-provenance-depth": (
            _with_provenance(b'{"p":' + b"[" * 15 + b"1" + b"]" * 15 + b"}"), "depth",
            "provenance nested to level 17"),
        "manifest-escaped-non-ascii": (
            manifest_base().replace(b'"base"', b'"b\\u00e4se"'), "escapes",
            "a non-ASCII name escaped (an ASCII-only writer's output)"),
        "manifest-duplicate-key": (
            manifest_base().replace(b'"hints":null', b'"hints":null,"hints":null'),
            "duplicate keys", "a field twice"),
    }
    return valid, invalid


def _reordered(value: Any) -> Any:
    """`value` with every object's keys in reverse order (an encoder must sort them)."""
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


def _refused(data: bytes, manifest: bool) -> bool:
    try:
        decode_manifest(data) if manifest else canonical_json.decode(data)
    except FormatError:
        return True
    return False


def build_files() -> dict[str, bytes]:
    """Every file of canonical-json/ by path inside it (the COMPAT files as they are)."""
    files: dict[str, bytes] = {}
    cases: list[dict[str, Any]] = []
    for name, (value, expected, what) in VALID.items():
        got = canonical_json.encode(value)
        if got != expected:
            raise SystemExit(f"{name}: the encoder writes {got!r}, the vector says {expected!r}")
        spelled = json.dumps(_reordered(value), indent=1, ensure_ascii=True).encode() + b"\n"
        files[f"valid/{name}.json"] = expected
        files[f"valid/{name}.in.json"] = spelled
        cases.append({"name": name, "kind": "json", "valid": True, "what": what,
                      "file": f"valid/{name}.json", "input": f"valid/{name}.in.json",
                      "digest": digest_hex(expected)})
    for name, what in COMPAT.items():
        data = (HERE / "valid" / f"{name}.json").read_bytes()
        if encode_manifest(decode_manifest(data)) != data:
            raise SystemExit(f"{name}: no longer decodes to the same bytes")
        files[f"valid/{name}.json"] = data
        cases.append({"name": name, "kind": "manifest", "valid": True, "what": what,
                      "file": f"valid/{name}.json", "digest": digest_hex(data)})
    valid_manifests, invalid_manifests = manifest_cases()
    for name, (data, what) in valid_manifests.items():
        if encode_manifest(decode_manifest(data)) != data:
            raise SystemExit(f"{name}: not a canonical manifest")
        files[f"valid/{name}.json"] = data
        cases.append({"name": name, "kind": "manifest", "valid": True, "what": what,
                      "file": f"valid/{name}.json", "digest": digest_hex(data)})
    invalid = [(n, "json", *case) for n, case in INVALID.items()]
    invalid += [(n, "manifest", *case) for n, case in invalid_manifests.items()]
    for name, kind, data, rule, what in invalid:
        if not _refused(data, kind == "manifest") or not _refused(data, False):
            raise SystemExit(f"{name}: the codec accepts it")
        files[f"invalid/{name}.json"] = data
        cases.append({"name": name, "kind": kind, "valid": False, "rule": rule, "what": what,
                      "file": f"invalid/{name}.json"})
    doc = {
        "description": "Canonical JSON golden vectors; see format/SPEC.md sections 8.2, 8.3 "
        "and 13. Valid json cases: a reader decodes `file` to the value a plain JSON parser "
        "reads from `input` (and from `file`); an encoder given that value writes `file` "
        "byte for byte; BLAKE3(file) is `digest`. Valid manifest cases: a manifest reader "
        "accepts `file` and encodes it again to the same bytes. Invalid cases: a canonical "
        "JSON reader refuses `file`, and so does a manifest reader for kind manifest.",
        "max_safe_integer": C.MAX_SAFE_INTEGER,
        "max_json_depth": C.MAX_JSON_DEPTH,
        "cases": cases,
    }
    files["cases.json"] = json.dumps(doc, indent=1, ensure_ascii=True).encode() + b"\n"
    return files
