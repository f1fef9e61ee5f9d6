"""containerd's filter syntax for List, the subset snapshotters are asked.

A filter is `FIELD OP VALUE` terms joined by commas (all must hold); a list of filters matches
when any one does. FIELD is `name`, `parent`, `kind` or `labels.KEY` (KEY quoted when it has
dots or slashes, as `labels."containerd.io/snapshot.ref"`); OP is `==`, `!=` or `~=` (a regular
expression); VALUE is bare or double-quoted; a FIELD alone asks that it be present.

containerd filters what a backend returns again (metadata/snapshot.go), so a filter this parser
cannot read matches everything rather than hiding a snapshot.

Owns: parsing and matching. Must not: know how records are stored.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from .state import Record

log = logging.getLogger(__name__)

KIND_NAMES = {1: "view", 2: "active", 3: "committed"}
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_FIELD = re.compile(rf'\s*(name|parent|kind|labels\.(?:{_QUOTED}|[A-Za-z0-9_./-]+))\s*')
_OP = re.compile(r"(==|!=|~=)\s*")
_VALUE = re.compile(rf'({_QUOTED}|[^,]*)\s*')


class _Unreadable(ValueError):
    pass


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        return re.sub(r"\\(.)", r"\1", text[1:-1])
    return text.strip()


def parse(text: str) -> list[tuple[str, str | None, str]]:
    """The terms of one filter: (field, operator or None, value)."""
    terms, pos = [], 0
    while pos < len(text):
        field = _FIELD.match(text, pos)
        if field is None:
            raise _Unreadable(text)
        name, pos = field.group(1), field.end()
        if name.startswith("labels."):
            name = "labels." + _unquote(name.removeprefix("labels."))
        op = _OP.match(text, pos)
        if op is None:
            terms.append((name, None, ""))
        else:
            value = _VALUE.match(text, op.end())
            assert value is not None  # matches the empty string
            terms.append((name, op.group(1), _unquote(value.group(1))))
            pos = value.end()
        if pos < len(text):
            if text[pos] != ",":
                raise _Unreadable(text)
            pos += 1
    return terms


def _value(record: Record, field: str) -> str | None:
    if field == "name":
        return record.key
    if field == "parent":
        return record.parent
    if field == "kind":
        return KIND_NAMES.get(record.kind, "unknown")
    return record.labels.get(field.removeprefix("labels."))


def _holds(record: Record, term: tuple[str, str | None, str]) -> bool:
    field, op, wanted = term
    got = _value(record, field)
    if op is None:
        return got is not None and got != ""
    if op == "==":
        return got == wanted
    if op == "!=":
        return got != wanted
    try:
        return got is not None and re.search(wanted, got) is not None
    except re.error:
        return True


def matches(record: Record, filters: Sequence[str]) -> bool:
    """Whether `record` passes any of `filters` (all when there are none)."""
    if not filters:
        return True
    for text in filters:
        try:
            terms = parse(text)
        except _Unreadable:
            log.debug("unreadable filter %r: matching everything", text)
            return True
        if all(_holds(record, term) for term in terms):
            return True
    return False
