"""image_record.py's labels, as containerd's client computes them (the end-to-end comparison
with `ctr images pull` is in test_containerd.py)."""

from __future__ import annotations

import json

import pytest

from weenvfs.snapshotter.image_record import Blob, manifest_labels, merged_sources
from weenvfs.tools.registry_auth import host_name


def test_a_manifest_names_its_config_and_layers_by_position() -> None:
    doc = {"config": {"digest": "sha256:c"}, "layers": [{"digest": "sha256:a"},
                                                         {"digest": "sha256:b"}]}
    blob = Blob("application/vnd.oci.image.manifest.v1+json", "sha256:m",
                json.dumps(doc).encode())
    assert manifest_labels(blob) == {"containerd.io/gc.ref.content.config": "sha256:c",
                                     "containerd.io/gc.ref.content.l.0": "sha256:a",
                                     "containerd.io/gc.ref.content.l.1": "sha256:b"}


@pytest.mark.parametrize(("current", "repo", "merged"), [
    ("", "team/env", "team/env"),
    ("team/env", "team/env", "team/env"),
    ("z/last,a/first", "m/middle", "a/first,m/middle,z/last"),
])
def test_sources_are_a_sorted_list_without_repeats(current: str, repo: str, merged: str) -> None:
    assert merged_sources(current, repo) == merged


@pytest.mark.parametrize(("host", "name"), [
    ("127.0.0.1:5000", "127.0.0.1"), ("registry.example.com", "registry.example.com"),
    ("[::1]:5000", "::1"), ("localhost:443", "localhost"),
])
def test_the_source_label_names_the_host_without_its_port(host: str, name: str) -> None:
    assert host_name(host) == name
