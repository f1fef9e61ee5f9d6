"""The pieces of `weenv convert` on their own: references, auth challenges and credentials,
platforms, group specs and keys, and legacy `docker save` archives built by hand."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
from pathlib import Path

import oci_images as O
import pytest
from support import layers as L

from weenvfs.errors import SourceError, UsageError
from weenvfs.tools.convert import GroupSpec, chain_ids, group_key, plan_groups
from weenvfs.tools.docker_archive import DockerArchiveSource
from weenvfs.tools.image_source import Layer, SourceOptions
from weenvfs.tools.layers import LayerSource
from weenvfs.tools.oci_docs import Platform, document_type
from weenvfs.tools.oci_layout import OciLayoutSource
from weenvfs.tools.registry import Reference
from weenvfs.tools.registry_auth import Challenge, config_creds, is_loopback


@pytest.mark.parametrize(
    "text, host, repo, tag, digest",
    [
        ("127.0.0.1:5000/task:1234", "127.0.0.1:5000", "task", "1234", None),
        ("localhost/a/b", "localhost", "a/b", "latest", None),
        ("debian", "docker.io", "library/debian", "latest", None),
        ("user/app:v1", "docker.io", "user/app", "v1", None),
        ("ghcr.io/o/r@sha256:" + "a" * 64, "ghcr.io", "o/r", None, "sha256:" + "a" * 64),
        (
            "reg.example:443/x/y:t@sha256:" + "b" * 64,
            "reg.example:443",
            "x/y",
            "t",
            "sha256:" + "b" * 64,
        ),
    ],
)
def test_reference_parse(text, host, repo, tag, digest):
    ref = Reference.parse(text)
    assert (ref.host, ref.repository, ref.tag, ref.digest) == (host, repo, tag, digest)


@pytest.mark.parametrize("text", ["Upper/Case", "host/repo:bad tag", "a//b", "x@sha256:12"])
def test_reference_parse_refuses(text):
    with pytest.raises((UsageError, SourceError)):
        Reference.parse(text)


def test_challenge_parse():
    c = Challenge.parse(
        'Bearer realm="https://auth.example/token",service="registry.example",'
        'scope="repository:a/b:pull,push"'
    )
    assert c.scheme == "bearer"
    assert c.params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:a/b:pull,push",
    }
    assert Challenge.parse('Basic realm="x"').scheme == "basic"


def test_loopback():
    assert is_loopback("127.0.0.1:5000") and is_loopback("localhost") and is_loopback("[::1]:80")
    assert not is_loopback("registry.example.com") and not is_loopback("10.0.0.1:5000")


def test_config_creds(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    auth = base64.b64encode(b"bob:pa:ss").decode()
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": auth},
                    "reg.example:5000": {"username": "u", "password": "p"},
                }
            }
        )
    )
    assert config_creds("docker.io") == ("bob", "pa:ss")
    assert config_creds("reg.example:5000") == ("u", "p")
    assert config_creds("other.example") is None


def test_platforms():
    assert Platform.parse("linux/arm64/v8") == Platform("linux", "arm64", "v8")
    assert Platform.host().os == "linux"
    assert Platform.parse("linux/arm64").matches(
        {"os": "linux", "architecture": "arm64", "variant": "v8"}
    )
    assert not Platform.parse("linux/arm/v7").matches(
        {"os": "linux", "architecture": "arm", "variant": "v6"}
    )
    with pytest.raises(UsageError):
        Platform.parse("linux")


def test_document_type_infers_and_refuses():
    assert document_type({"schemaVersion": 2, "manifests": []}, None, "x") == O.OCI_INDEX
    assert document_type({"schemaVersion": 2, "layers": []}, None, "x") == O.OCI_MANIFEST
    with pytest.raises(SourceError, match="unsupported manifest media type"):
        document_type({"schemaVersion": 2, "layers": []}, "application/json+other", "x")


def test_group_specs():
    assert GroupSpec.parse("base=0-3") == GroupSpec("base", None, 0, 3)
    assert GroupSpec.parse("task:v2=6-") == GroupSpec("task", "v2", 6, None)
    assert GroupSpec.parse("one=4") == GroupSpec("one", None, 4, 4)
    for bad in ("base", "base=", "Base=0", "a=3-1", "a=x-y", "a:b c=1"):
        with pytest.raises(Exception):  # noqa: B017 - UsageError or FormatError
            GroupSpec.parse(bad)


def _layers(*diff_ids: str) -> list[Layer]:
    return [
        Layer(n, O.LAYER_GZIP, None, None, d, lambda: io.BytesIO()) for n, d in enumerate(diff_ids)
    ]


def test_chain_ids_and_keys():
    a, b, c = ("sha256:" + ch * 64 for ch in "abc")
    chains = chain_ids(_layers(a, b, c))
    assert chains[0] == a
    assert chains[1] == "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()
    # A layer's key depends on what lies below it, not only on its own content.
    assert group_key(chain_ids(_layers(a, c)), 1, 1) != group_key(chain_ids(_layers(b, c)), 1, 1)
    # The same layers grouped differently give different keys.
    assert group_key(chains, 0, 2) != group_key(chains, 1, 2)
    plans = plan_groups([], _layers(a, b, c))
    assert [p.name for p in plans] == [f"layer-{group_key(chains, n, n)}" for n in range(3)]
    assert all(p.tag == "latest" and not p.explicit_tag for p in plans)
    named = plan_groups(
        [GroupSpec("base", None, 0, 1), GroupSpec("top", "v1", 2, None)], _layers(a, b, c)
    )
    assert [(p.ref, p.explicit_tag) for p in named] == [
        (f"base:{group_key(chains, 0, 1)}", False),
        ("top:v1", True),
    ]


def _legacy_archive(path: Path, images: dict[str, list[bytes]]) -> Path:
    """A `docker save` archive as Docker before 25 wrote it: <id>/layer.tar files."""
    entries, files = [], {}
    for tag, tars in images.items():
        diff_ids = ["sha256:" + hashlib.sha256(t).hexdigest() for t in tars]
        config = json.dumps(
            {
                "os": "linux",
                "architecture": "amd64",
                "config": {"Env": [f"TAG={tag}"]},
                "rootfs": {"type": "layers", "diff_ids": diff_ids},
            }
        ).encode()
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        files[config_name] = config
        layer_paths = []
        for n, tar in enumerate(tars):
            layer_id = hashlib.sha256(f"{tag}{n}".encode()).hexdigest()
            files[f"{layer_id}/layer.tar"] = tar
            files[f"{layer_id}/VERSION"] = b"1.0"
            layer_paths.append(f"{layer_id}/layer.tar")
        entries.append({"Config": config_name, "RepoTags": [tag], "Layers": layer_paths})
    files["manifest.json"] = json.dumps(entries).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _entries(source: DockerArchiveSource) -> dict[bytes, bytes]:
    image = source.resolve(Platform.host())
    out = {}
    for layer in image.layers:
        ls = LayerSource(layer)
        for e in ls.entries():
            out[e.path] = e.open_data().read_exact(e.size, e.path) if e.open_data else b""
    return out


def test_legacy_docker_archive(tmp_path):
    one = L.layer(L.file("a", b"one"))
    two = L.layer(L.file("b", b"two"))
    archive = _legacy_archive(tmp_path / "save.tar", {"app:1": [one], "app:2": [one, two]})
    options = SourceOptions()
    with pytest.raises(SourceError, match="holds 2 images; add :REF or @N"):
        DockerArchiveSource.from_spec(str(archive), options).resolve(Platform.host())
    src = DockerArchiveSource.from_spec(f"{archive}:app:2", options)
    image = src.resolve(Platform.host())
    assert image.config.env == ("TAG=app:2",) and image.manifest_digest is None
    assert _entries(src) == {b"a": b"one", b"b": b"two"}
    assert _entries(DockerArchiveSource.from_spec(f"{archive}:@0", options)) == {b"a": b"one"}
    with pytest.raises(SourceError, match="no image tagged 'app:3'"):
        DockerArchiveSource.from_spec(f"{archive}:app:3", options).resolve(Platform.host())


def test_legacy_layer_checked_by_diff_id(tmp_path):
    archive = _legacy_archive(tmp_path / "save.tar", {"app:1": [L.layer(L.file("a", b"one"))]})
    data = bytearray(archive.read_bytes())
    pos = data.index(b"one")
    data[pos : pos + 3] = b"two"
    archive.write_bytes(bytes(data))
    with pytest.raises(SourceError, match="diff_id mismatch"):
        _entries(DockerArchiveSource.from_spec(str(archive), SourceOptions()))


def test_oci_layout_spec(tmp_path):
    image = O.write_layout(tmp_path / "with:colon", [L.layer(L.file("a", b"1"))], tag="t")
    assert OciLayoutSource.from_spec(f"{image.layout}:t").tag == "t"
    assert OciLayoutSource.from_spec(str(image.layout)).tag is None
