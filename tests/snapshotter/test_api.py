"""snapshotter/api.py states containerd's snapshots API v1 as a table: check it against the
.proto files Debian's golang-github-containerd-containerd-dev installs (containerd 1.6)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from weenvfs.snapshotter import api

PROTO_ROOT = Path("/usr/share/gocode/src/github.com/containerd/containerd/api")
SNAPSHOTS = PROTO_ROOT / "services/snapshots/v1/snapshots.proto"
MOUNT = PROTO_ROOT / "types/mount.proto"
LEASES = PROTO_ROOT / "services/leases/v1/leases.proto"
_FIELD = re.compile(r"^\s*(repeated\s+)?(map<string,\s*string>|[\w.]+)\s+(\w+)\s*=\s*(\d+)",
                    re.M)
_TYPES = {"string": api.STRING, "int64": api.INT64, "bool": api.BOOL, "Kind": api.ENUM}


@pytest.fixture(autouse=True)
def _protos(require_or_skip: Callable[[object, str], None]) -> None:
    require_or_skip(SNAPSHOTS.exists() and MOUNT.exists() and LEASES.exists(),
                    "containerd's .proto files missing (Debian package "
                    "golang-github-containerd-containerd-dev)")


def _messages(text: str) -> dict[str, list[tuple[str, int, str, bool]]]:
    out = {}
    for name, body in re.findall(r"^message (\w+)\s*\{(.*?)^\}", text, re.M | re.S):
        fields = []
        for repeated, kind, field, number in _FIELD.findall(body):
            is_map = kind.startswith("map<")
            fields.append((field, int(number), _TYPES.get(kind, api.MESSAGE),
                           bool(repeated) or is_map))
        out[name] = fields
    return out


def _table(table: dict[str, list[api.Field]]) -> dict[str, list[tuple[str, int, str, bool]]]:
    return {name: [(f[0], f[1], f[2], f[3]) for f in fields] for name, fields in table.items()}


def test_messages_match_the_proto() -> None:
    assert _table(api.MESSAGES) == _messages(SNAPSHOTS.read_text())
    assert _table(api.MOUNT) == _messages(MOUNT.read_text())


def _rpcs(text: str) -> dict[str, tuple[str, str, bool]]:
    rpcs = re.findall(r"rpc (\w+)\((\w+)\) returns \((stream )?([\w.]+)\)", text)
    return {name: (req, resp, bool(stream)) for name, req, stream, resp in rpcs}


def test_methods_and_kinds_match_the_proto() -> None:
    text = SNAPSHOTS.read_text()
    assert _rpcs(text) == api.METHODS
    kinds = dict(re.findall(r"^\s*(UNKNOWN|VIEW|ACTIVE|COMMITTED) = (\d+)", text, re.M))
    assert {k: int(v) for k, v in kinds.items()} == api.KINDS


def test_the_leases_part_matches_the_proto() -> None:
    """Only the leases calls `weenv pull` makes are in the table: each as the .proto has it."""
    text = LEASES.read_text()
    rpcs = _rpcs(text)
    assert {name: rpcs[name] for name in api.LEASE_METHODS} == api.LEASE_METHODS
    messages = _messages(text)
    assert _table(api.LEASE_MESSAGES) == {name: messages[name] for name in api.LEASE_MESSAGES}


def test_lease_messages_round_trip() -> None:
    request = api.message(f"{api.LEASES_PACKAGE}.DeleteRequest")(id="l", sync=True)
    decoded = api.message(f"{api.LEASES_PACKAGE}.DeleteRequest").FromString(
        request.SerializeToString())
    assert (decoded.id, decoded.sync) == ("l", True)


def test_messages_round_trip() -> None:
    request = api.message("PrepareSnapshotRequest")(key="k", parent="p", labels={"a": "b"})
    decoded = api.message("PrepareSnapshotRequest").FromString(request.SerializeToString())
    assert (decoded.key, decoded.parent, dict(decoded.labels)) == ("k", "p", {"a": "b"})
