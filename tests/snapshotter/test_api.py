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
CONTENT = PROTO_ROOT / "services/content/v1/content.proto"
IMAGES = PROTO_ROOT / "services/images/v1/images.proto"
DESCRIPTOR = PROTO_ROOT / "types/descriptor.proto"
_FIELD = re.compile(r"^\s*(repeated\s+)?(map<string,\s*string>|[\w.]+)\s+(\w+)\s*=\s*(\d+)",
                    re.M)
_TYPES = {"string": api.STRING, "int64": api.INT64, "bool": api.BOOL, "bytes": api.BYTES,
          "Kind": api.ENUM, "WriteAction": api.ENUM}


@pytest.fixture(autouse=True)
def _protos(require_or_skip: Callable[[object, str], None]) -> None:
    require_or_skip(all(p.exists() for p in (SNAPSHOTS, MOUNT, LEASES, CONTENT, IMAGES,
                                              DESCRIPTOR)),
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
    """rpc -> (request, response, whether the response is streamed)."""
    rpcs = re.findall(r"rpc (\w+)\((?:stream )?(\w+)\) returns \((stream )?([\w.]+)\)", text)
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


@pytest.mark.parametrize(("path", "messages", "methods"), [
    (CONTENT, api.CONTENT_MESSAGES, api.CONTENT_METHODS),
    (IMAGES, api.IMAGES_MESSAGES, api.IMAGES_METHODS),
])
def test_the_content_and_images_parts_match_the_proto(
        path: Path, messages: dict[str, list[api.Field]],
        methods: dict[str, tuple[str, str, bool]]) -> None:
    """Only the content and images calls `weenv pull` makes are in the tables: each as the
    .proto has it (content's Write streams both ways)."""
    text = path.read_text()
    rpcs = _rpcs(text)
    assert {name: rpcs[name] for name in methods} == methods
    found = _messages(text)
    assert _table(messages) == {name: found[name] for name in messages}
    assert _table(api.DESCRIPTOR) == _messages(DESCRIPTOR.read_text())
    if path == CONTENT:
        assert "rpc Write(stream WriteContentRequest)" in text
        actions = dict(re.findall(r"^\s*(STAT|WRITE|COMMIT) = (\d+)", text, re.M))
        assert {k: int(v) for k, v in actions.items()} == api.WRITE_ACTIONS


def test_lease_messages_round_trip() -> None:
    request = api.message(f"{api.LEASES_PACKAGE}.DeleteRequest")(id="l", sync=True)
    decoded = api.message(f"{api.LEASES_PACKAGE}.DeleteRequest").FromString(
        request.SerializeToString())
    assert (decoded.id, decoded.sync) == ("l", True)


def test_messages_round_trip() -> None:
    request = api.message("PrepareSnapshotRequest")(key="k", parent="p", labels={"a": "b"})
    decoded = api.message("PrepareSnapshotRequest").FromString(request.SerializeToString())
    assert (decoded.key, decoded.parent, dict(decoded.labels)) == ("k", "p", {"a": "b"})
