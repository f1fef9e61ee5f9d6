"""Canonical JSON (SPEC.md 8.2): the one spelling of a JSON value, and a reader that accepts
only that spelling.

A manifest is named by the BLAKE3 of its bytes, so every writer, in any language, must spell a
value the same way. The rules are SPEC.md's (value types, escape table, key order, integer
range, nesting depth) and are written out here rather than left to `json.dumps`, whose output
the spec must not depend on. For every value the rules allow, the bytes are the ones
`json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)` gives, which
wrote every manifest before the rules were written down (tests/format/test_canonical_json.py
checks both), so no stored manifest changed its digest.

Owns: `encode` (value -> canonical bytes; refuses what the rules exclude, naming where),
`decode` (bytes -> value; refuses anything but the canonical bytes of an allowed value) and
`parse` (the same value rules, any JSON spelling: for a document no digest depends on).
Must not: know any document's fields (manifest.py does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .constants import MAX_JSON_DEPTH, MAX_SAFE_INTEGER
from .errors import FormatError

# SPEC.md 8.2's escape table: the quote, the backslash and U+0000..U+001F, nothing else.
_SHORT_ESCAPES = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}
ESCAPES: dict[str, str] = {
    chr(c): _SHORT_ESCAPES.get(c, f"\\u{c:04x}") for c in range(0x20)
} | {'"': '\\"', "\\": "\\\\"}
_NEEDS_ESCAPE = re.compile('["\\\\\x00-\x1f]')
_SURROGATE = re.compile("[\ud800-\udfff]")
_SPECIAL = re.compile('["\\\\\x00-\x1f\ud800-\udfff]')  # either of the two above
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")

# A JSON path while encoding: object keys and array positions, outermost first.
_Path = list[str | int]


def encode(value: Any, what: str = "JSON") -> bytes:
    """The canonical bytes of `value`: dicts with str keys, lists or tuples, str, int, bool,
    None. Raises FormatError naming the offending place (`what` and the path below it)."""
    out: list[str] = []
    _write(value, out, [], what)
    return "".join(out).encode("utf-8")


def decode(data: bytes, what: str = "JSON") -> Any:
    """The value whose canonical bytes are `data`; FormatError for anything else."""
    value = _load(data, what)
    canonical = encode(value, what)  # also the rules the parser cannot see (see parse)
    if canonical != data:
        pairs = zip(canonical, data, strict=False)  # stop at the shorter
        at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(canonical), len(data)))
        raise FormatError(what, f"not canonical JSON from byte {at} (whitespace, key order, "
                                "escapes or number spelling differ from SPEC.md 8.2)")
    return value


def parse(data: bytes, what: str = "JSON") -> Any:
    """A JSON value of any spelling, held to the value rules of canonical JSON (no floats,
    integers within +-MAX_SAFE_INTEGER, no duplicate keys, no lone surrogates, bounded
    depth); FormatError otherwise."""
    value = _load(data, what)
    encode(value, what)  # the rules json.loads cannot check: depth, lone surrogates
    return value


def _load(data: bytes, what: str) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(what, f"not UTF-8 at byte {exc.start}") from None
    try:
        return json.loads(text, object_pairs_hook=_object, parse_float=_no_float,
                           parse_int=_integer, parse_constant=_no_constant)
    except _Refused as exc:
        raise FormatError(what, str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise FormatError(what, f"not JSON: {exc}") from None


# -- writing ------------------------------------------------------------------------------------


def _write(value: Any, out: list[str], path: _Path, what: str) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            raise _error(what, path, f"integer {_show_int(value)} is outside +-(2^53 - 1) "
                                     "(SPEC.md 8.2)")
        out.append(str(int(value)))  # int(): an IntEnum's str() is its name
    elif isinstance(value, str):
        out.append(_string(value, what, path))
    elif isinstance(value, (list, tuple)):
        _write_array(value, out, path, what)
    elif isinstance(value, dict):
        _write_object(value, out, path, what)
    elif isinstance(value, float):
        raise _error(what, path, f"a float ({value!r}), and canonical JSON has integers only "
                                 "(SPEC.md 8.2): write a string or an integer")
    else:
        raise _error(what, path, f"a {type(value).__name__} is not a JSON value")


def _write_array(value: Sequence[Any], out: list[str], path: _Path, what: str) -> None:
    _check_depth(path, what)
    out.append("[")
    for i, item in enumerate(value):
        if i:
            out.append(",")
        path.append(i)
        _write(item, out, path, what)
        path.pop()
    out.append("]")


def _write_object(value: dict[Any, Any], out: list[str], path: _Path, what: str) -> None:
    _check_depth(path, what)
    for key in value:
        if not isinstance(key, str):
            raise _error(what, path, f"object key {key!r:.40} is not a string")
    out.append("{")
    # Code point order, which is the order of the keys' UTF-8 bytes (no surrogates here:
    # _string refuses them before any byte is written).
    for i, key in enumerate(sorted(value)):
        if i:
            out.append(",")
        out.append(_string(key, what, path))
        out.append(":")
        path.append(key)
        _write(value[key], out, path, what)
        path.pop()
    out.append("}")


def _string(text: str, what: str, path: _Path) -> str:
    if _SPECIAL.search(text) is None:  # most strings: one scan
        return f'"{text}"'
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise _error(what, path, f"lone surrogate U+{ord(bad.group()):04X} in a string "
                                 "(not a Unicode scalar value)")
    return '"' + _NEEDS_ESCAPE.sub(lambda m: ESCAPES[m.group()], text) + '"'


def _check_depth(path: _Path, what: str) -> None:
    # `path` holds the steps to this container, so it sits at level len(path) + 1.
    if len(path) >= MAX_JSON_DEPTH:
        raise _error(what, path, f"nested deeper than {MAX_JSON_DEPTH} levels")


def _show_int(value: int) -> str:
    # str() of a huge int is slow and, past 4300 digits, refused by Python itself.
    return str(value) if value.bit_length() <= 256 else f"of {value.bit_length()} bits"


def _error(what: str, path: _Path, detail: str) -> FormatError:
    where = what
    for step in path:
        if isinstance(step, int):
            where += f"[{step}]"
        elif _PLAIN_KEY.fullmatch(step):
            where += f".{step}"
        else:
            where += f"[{step!r:.40}]"
    return FormatError(where, detail)


# -- reading: json.loads hooks ------------------------------------------------------------------


class _Refused(ValueError):
    """A value canonical JSON does not allow, found while parsing."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate object key {key!r:.40}")
        out[key] = value
    return out


def _no_float(text: str) -> Any:
    raise _Refused(f"number {text[:40]} has a fraction or an exponent: integers only")


def _no_constant(text: str) -> Any:
    raise _Refused(f"{text} is not JSON")


def _integer(text: str) -> int:
    if text == "-0":
        raise _Refused("-0 is not canonical (write 0)")
    # 2^53 - 1 has 16 digits: a longer spelling is out of range (and never converted, so a
    # huge number costs nothing).
    if len(text.lstrip("-")) > 16 or not -MAX_SAFE_INTEGER <= int(text) <= MAX_SAFE_INTEGER:
        shown = text if len(text) <= 24 else f"{text[:20]}... ({len(text)} characters)"
        raise _Refused(f"integer {shown} is outside +-(2^53 - 1)")
    return int(text)
