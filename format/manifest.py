"""Environment manifests: canonical JSON naming an ordered list of group indexes.

A manifest is stored as the canonical JSON (SPEC.md 8.2, `canonical_json`) of its fields; its
digest is the BLAKE3 of exactly those bytes, and a decoder refuses any other encoding of the
same content, so one manifest has one digest. `provenance` is free-form but held to the same
value rules (no floats, integers within +-(2^53 - 1), bounded depth, SPEC.md 8.3):
`check_provenance` lets a writer refuse a bad one before it publishes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import canonical_json
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
    data = canonical_json.encode(_to_json(m), "manifest")
    if len(data) > C.MAX_MANIFEST_SIZE:
        raise FormatError("manifest", f"{len(data)} bytes exceed {C.MAX_MANIFEST_SIZE}")
    return data


def check_provenance(provenance: Mapping[str, Any]) -> None:
    """Refuse (FormatError, naming the place) provenance that no manifest can hold: a float,
    an integer beyond +-(2^53 - 1), a non-JSON value, nesting too deep (SPEC.md 8.3). For
    writers, before they publish anything the manifest will name."""
    canonical_json.encode({"provenance": dict(provenance)}, "manifest")


def _strs(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FormatError(what, "must be a list of strings")
    return tuple(value)


def _field(obj: dict[str, Any], key: str, kind: type, what: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind):
        raise FormatError(f"{what}.{key}", f"must be a {kind.__name__}")
    return value


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate a stored manifest; refuse non-canonical bytes."""
    if len(data) > C.MAX_MANIFEST_SIZE:
        raise FormatError("manifest", f"{len(data)} bytes exceed {C.MAX_MANIFEST_SIZE}")
    obj = canonical_json.decode(data, "manifest")
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
        # Canonical JSON already, so the content differs: a field this schema lacks, or a
        # schemaVersion that does not match groups[].erofs.
        raise FormatError("manifest", "not the canonical encoding of a manifest (an unknown "
                                      "field, or a schemaVersion that groups[].erofs contradicts)")
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
