"""Environment manifests: canonical JSON naming an ordered list of group indexes.

The canonical encoding (SPEC.md) is `json.dumps(sort_keys=True, separators=(",", ":"),
ensure_ascii=False)` in UTF-8; a manifest's digest is the BLAKE3 of exactly those bytes, and a
decoder refuses any other encoding of the same content, so one manifest has one digest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from . import constants as C
from .digest import check_digest
from .errors import FormatError, UnsupportedFormat


@dataclass(frozen=True)
class GroupRef:
    """One layer group of an environment: its name (informational), its index digest and,
    optionally, the digest of its published EROFS image (SPEC.md 15.9; omitted when None)."""

    name: str
    index: str
    erofs: str | None = None


@dataclass(frozen=True)
class RuntimeConfig:
    """How to run the environment, taken from the OCI image config where there is one."""

    env: tuple[str, ...] = ()
    cwd: str = "/"
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """An environment: groups lowest first, runtime config, optional build hint, provenance."""

    groups: tuple[GroupRef, ...]
    config: RuntimeConfig = field(default_factory=RuntimeConfig)
    hints: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)


def _to_json(m: Manifest) -> dict[str, Any]:
    c = m.config
    return {
        "schemaVersion": C.MANIFEST_SCHEMA_EROFS if any(g.erofs for g in m.groups)
        else C.MANIFEST_SCHEMA,
        "mediaType": C.MANIFEST_MEDIA_TYPE,
        "groups": [_group_json(g) for g in m.groups],
        "config": {
            "env": list(c.env),
            "cwd": c.cwd,
            "user": c.user,
            "entrypoint": list(c.entrypoint),
            "cmd": list(c.cmd),
            "labels": dict(c.labels),
        },
        "hints": m.hints,
        "provenance": m.provenance,
    }


def _group_json(g: GroupRef) -> dict[str, str]:
    out = {"name": g.name, "index": g.index}
    if g.erofs is not None:
        out["erofs"] = g.erofs
    return out


def encode_manifest(m: Manifest) -> bytes:
    """The canonical bytes of `m` (validated first)."""
    _validate(m)
    try:
        data = json.dumps(
            _to_json(m), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
        return data.encode("utf-8")
    except (ValueError, TypeError, RecursionError) as exc:
        # NaN/Infinity, lone surrogates, non-JSON values or absurd nesting in provenance.
        raise FormatError("manifest", f"cannot be encoded as canonical JSON: {exc}") from None


def _strs(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FormatError(what, "must be a list of strings")
    return tuple(value)


def _field(obj: dict[str, Any], key: str, kind: type, what: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind):
        raise FormatError(f"{what}.{key}", f"must be a {kind.__name__}")
    return value


def _refuse_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; standard JSON (and other readers) do not.
    raise ValueError(f"{name} is not JSON")


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate a stored manifest; refuse non-canonical bytes."""
    if len(data) > C.MAX_MANIFEST_SIZE:
        raise FormatError("manifest", f"{len(data)} bytes exceed {C.MAX_MANIFEST_SIZE}")
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise FormatError("manifest", f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FormatError("manifest", "must be a JSON object")
    if obj.get("schemaVersion") not in (C.MANIFEST_SCHEMA, C.MANIFEST_SCHEMA_EROFS):
        raise UnsupportedFormat("manifest schemaVersion", f"{obj.get('schemaVersion')!r}")
    if obj.get("mediaType") != C.MANIFEST_MEDIA_TYPE:
        raise FormatError("manifest mediaType", f"{obj.get('mediaType')!r}")
    groups = []
    for g in _field(obj, "groups", list, "manifest"):
        if not isinstance(g, dict):
            raise FormatError("manifest.groups", "entries must be objects")
        erofs = g.get("erofs")
        if erofs is not None and not isinstance(erofs, str):
            raise FormatError("group.erofs", "must be a digest")
        groups.append(GroupRef(_field(g, "name", str, "group"), _field(g, "index", str, "group"),
                               erofs))
    cfg = _field(obj, "config", dict, "manifest")
    labels = _field(cfg, "labels", dict, "config")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise FormatError("config.labels", "must map strings to strings")
    config = RuntimeConfig(
        env=_strs(cfg.get("env"), "config.env"),
        cwd=_field(cfg, "cwd", str, "config"),
        user=_field(cfg, "user", str, "config"),
        entrypoint=_strs(cfg.get("entrypoint"), "config.entrypoint"),
        cmd=_strs(cfg.get("cmd"), "config.cmd"),
        labels=labels,
    )
    hints = obj.get("hints")
    if hints is not None and not isinstance(hints, str):
        raise FormatError("manifest.hints", "must be a digest or null")
    m = Manifest(tuple(groups), config, hints, _field(obj, "provenance", dict, "manifest"))
    if encode_manifest(m) != data:
        raise FormatError("manifest", "not in canonical encoding (or unknown fields)")
    return m


def _validate(m: Manifest) -> None:
    if not 1 <= len(m.groups) <= C.MAX_GROUPS:
        raise FormatError("manifest.groups", f"need 1..{C.MAX_GROUPS} groups, got {len(m.groups)}")
    for g in m.groups:
        check_digest(g.index, f"manifest group {g.name!r} index")
        if g.erofs is not None:
            check_digest(g.erofs, f"manifest group {g.name!r} erofs")
    if m.hints is not None:
        check_digest(m.hints, "manifest.hints")
    if not m.config.cwd.startswith("/"):
        raise FormatError("manifest.config.cwd", f"must be absolute, got {m.config.cwd!r}")
