"""format/oci_layer.py: a WeEnv group as an OCI layer (annotations, marker tar)."""

from __future__ import annotations

import io
import tarfile

import pytest

from weenvfs.format.errors import FormatError
from weenvfs.format.oci_layer import (
    KEY_INDEX,
    KEY_POSITION,
    LayerRef,
    decode_marker,
    encode_layer_tar,
    from_labels,
)

REF = LayerRef("s3://bucket/weenv?endpoint=http://127.0.0.1:8333", "a" * 64, 3, "b" * 64)


def test_annotations_round_trip_and_other_labels_name_nothing() -> None:
    assert from_labels({**REF.annotations(), "other": "x"}) == REF
    assert from_labels({"containerd.io/snapshot.ref": "sha256:00"}) is None


def test_the_tar_holds_exactly_the_marker_and_is_deterministic() -> None:
    blob = encode_layer_tar(REF)
    assert blob == encode_layer_tar(REF)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        members = tar.getmembers()
        assert [(m.name, m.type, m.mtime, m.uid) for m in members] == [
            (".weenv", tarfile.DIRTYPE, 0, 0), (".weenv/layer-3.json", tarfile.REGTYPE, 0, 0)]
        data = tar.extractfile(members[1]).read()  # type: ignore[union-attr]
    assert decode_marker("layer-3.json", data) == REF


@pytest.mark.parametrize(("labels", "fragment"), [
    ({KEY_INDEX: "b" * 64}, "missing"),
    ({**REF.annotations(), KEY_POSITION: "-1"}, "expected a number"),
    ({**REF.annotations(), KEY_POSITION: "4096"}, "expected 0-4095"),
    ({**REF.annotations(), KEY_INDEX: "../../etc"}, "64 hex digits"),
    ({**REF.annotations(), "containerd.io/snapshot/weenv/store": "file:///x y"}, "spaces"),
    ({**REF.annotations(), "containerd.io/snapshot/weenv/store": ""}, "expected a URL"),
])
def test_bad_labels_are_refused(labels: dict[str, str], fragment: str) -> None:
    with pytest.raises(FormatError, match=fragment):
        from_labels(labels)


@pytest.mark.parametrize(("name", "data", "fragment"), [
    ("layer-3.json", b"{", "not JSON"),
    ("layer-3.json", b'{"version": 2}', "version"),
    ("layer-4.json", REF.marker(), "its name another"),
    ("evil.json", REF.marker(), "unexpected file name"),
    ("layer-3.json", b" " * 5000, "over 4096"),
])
def test_bad_markers_are_refused(name: str, data: bytes, fragment: str) -> None:
    with pytest.raises(FormatError, match=fragment):
        decode_marker(name, data)
