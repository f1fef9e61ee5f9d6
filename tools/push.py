"""`weenv push`: publish an environment as an OCI image that any registry stores.

The image (docs/containerd.md): an OCI manifest whose config carries the environment's
runtime config (Env, Entrypoint, Cmd, WorkingDir, User, Labels) and one layer per group,
lowest first. Each layer names its group (store URL, manifest digest, position, index
digest) in its descriptor's annotations. Its blob is either
- a marker (`marker_layers`, the default): an uncompressed tar of a few hundred bytes naming
  the group again (format/oci_layer.py); the group's data stays in the store, or
- the group's whole content (`full_layers`, `--layers full`): a gzip tar layer any client
  can unpack and run (group_layer.py), spooled to a temporary folder; a WeEnv node still
  mounts the group lazily when the annotations reach it (CRI, `weenv pull`).
The manifest's own annotations name the environment (`containerd.io/snapshot/weenv/manifest`).

Owns: building the image documents (`build_image`, pure over its layers) and uploading them
in the order a registry needs (blobs, then the manifest) through the registry client of
`weenv convert` (registry.py: same auth, retries, plain-HTTP policy). Must not: write to the
store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from weenvfs.errors import SourceError
from weenvfs.format.manifest import Manifest
from weenvfs.format.oci_layer import KEY_MANIFEST, LayerRef, encode_layer_tar
from weenvfs.store.repository import Repository

from .group_layer import write_group_layer
from .image_source import SourceOptions
from .oci_docs import OCI_CONFIG, OCI_MANIFEST, Platform, sha256_digest
from .reader import ChunkReader, load_group
from .registry import Reference, RegistryClient

log = logging.getLogger(__name__)

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_TAR_GZIP = LAYER_TAR + "+gzip"
LAYER_KINDS = ("marker", "full")


def _descriptor(media_type: str, digest: str, size: int,
                annotations: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"mediaType": media_type, "digest": digest, "size": size}
    if annotations:
        out["annotations"] = dict(annotations)
    return out


@dataclass(frozen=True)
class Blob:
    """One blob of the image: its media type, bytes and descriptor annotations."""

    media_type: str
    data: bytes
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return sha256_digest(self.data)

    def descriptor(self) -> dict[str, Any]:
        return _descriptor(self.media_type, self.digest, len(self.data), self.annotations)

    @contextlib.contextmanager
    def body(self) -> Iterator[bytes]:
        yield self.data


@dataclass(frozen=True)
class FileBlob:
    """A blob spooled to a file (a full layer): uploaded from `path`."""

    media_type: str
    path: Path
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)

    def descriptor(self) -> dict[str, Any]:
        return _descriptor(self.media_type, self.digest, self.size, self.annotations)

    @contextlib.contextmanager
    def body(self) -> Iterator[BinaryIO]:
        with open(self.path, "rb") as data:
            yield data


Layer = tuple[Blob | FileBlob, str]  # a layer's blob and its diff ID


@dataclass(frozen=True)
class PushImage:
    """An image ready to upload: its config, layers and manifest bytes."""

    config: Blob
    layers: tuple[Blob | FileBlob, ...]
    manifest: bytes

    @property
    def digest(self) -> str:
        return sha256_digest(self.manifest)


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def marker_layers(manifest: Manifest, digest: str, store_url: str) -> list[Layer]:
    """One marker layer per group of environment `digest`, its data in `store_url`."""
    layers: list[Layer] = []
    for position, group in enumerate(manifest.groups):
        ref = LayerRef(store_url, digest, position, group.index)
        blob = Blob(LAYER_TAR, encode_layer_tar(ref), ref.annotations())
        layers.append((blob, blob.digest))  # an uncompressed layer's diff ID is its digest
    return layers


def full_layers(manifest: Manifest, digest: str, store_url: str, repo: Repository,
                folder: Path) -> list[Layer]:
    """One full layer per group (its whole content, gzip tar), spooled into `folder`; the
    annotations name the group as a marker layer's do."""
    reader = ChunkReader(repo.store)
    layers: list[Layer] = []
    for position, group in enumerate(manifest.groups):
        ref = LayerRef(store_url, digest, position, group.index)
        index = load_group(repo, group.index, group.name).index
        spooled = write_group_layer(index, reader, folder / f"layer-{position}.tar.gz")
        log.info("group %s: layer of %d bytes", group.name or group.index[:12], spooled.size)
        layers.append((FileBlob(LAYER_TAR_GZIP, spooled.path, spooled.digest, spooled.size,
                                ref.annotations()), spooled.diff_id))
    return layers


def build_image(manifest: Manifest, digest: str, image_layers: Sequence[Layer],
                platform: Platform) -> PushImage:
    """The OCI image of environment `digest` (its `manifest`) over `image_layers`."""
    layers = [blob for blob, _ in image_layers]
    cfg = manifest.config
    run: dict[str, Any] = {"Env": list(cfg.env), "WorkingDir": cfg.cwd or "/"}
    for key, value in (("Entrypoint", cfg.entrypoint), ("Cmd", cfg.cmd)):
        if value:
            run[key] = list(value)
    if cfg.user:
        run["User"] = cfg.user
    if cfg.labels:
        run["Labels"] = dict(cfg.labels)
    config_doc: dict[str, Any] = {
        "architecture": platform.architecture, "os": platform.os, "config": run,
        "rootfs": {"type": "layers", "diff_ids": [diff_id for _, diff_id in image_layers]},
        "history": [{"created_by": f"weenv group {g.name} ({g.index[:12]})"}
                    for g in manifest.groups],
    }
    if platform.variant:
        config_doc["variant"] = platform.variant
    config = Blob(OCI_CONFIG, _canonical(config_doc))
    doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config.descriptor(),
           "layers": [layer.descriptor() for layer in layers],
           "annotations": {KEY_MANIFEST: digest}}
    return PushImage(config, tuple(layers), _canonical(doc))


def parse_target(text: str) -> Reference:
    """`HOST/REPO[:TAG]` (or `docker://HOST/REPO[:TAG]`) to push to."""
    text = text.removeprefix("docker://")
    ref = Reference.parse(text)
    if ref.digest is not None:
        raise SourceError(f"push to a tag, not a digest: {text}")
    return ref


def check_registry(target: Reference, options: SourceOptions) -> None:
    """Fail now, in one line, when the registry cannot be reached or refuses our credentials
    (before full layers take minutes to write): a HEAD of a blob it need not have."""
    client = RegistryClient(target, options)
    try:
        resp = client.request("HEAD", f"{client.base}/blobs/{sha256_digest(b'')}")
        with resp:
            if resp.status_code in (401, 403):
                raise client.fail(resp, "access check")
    finally:
        client.closing.set()


def push_image(image: PushImage, target: Reference, options: SourceOptions) -> str:
    """Upload `image` to `target` (blobs first, then the manifest); its manifest digest."""
    client = RegistryClient(target, options)
    try:
        for blob in (*image.layers, image.config):
            _upload_blob(client, blob)
        url = f"{client.base}/manifests/{target.tag}"
        resp = client.request("PUT", url, {"Content-Type": OCI_MANIFEST}, data=image.manifest)
        with resp:
            if resp.status_code not in (200, 201):
                raise client.fail(resp, f"manifest upload to {target.tag}")
    finally:
        client.closing.set()
    log.info("pushed %s (%d layers) as %s", image.digest[:19], len(image.layers), target)
    return image.digest


def _upload_blob(client: RegistryClient, blob: Blob | FileBlob) -> bool:
    """Upload one blob unless the repository has it (monolithic POST + PUT); whether sent."""
    head = client.request("HEAD", f"{client.base}/blobs/{blob.digest}")
    with head:
        if head.status_code == 200:
            return False
    start = client.request("POST", f"{client.base}/blobs/uploads/")
    with start:
        if start.status_code != 202 or "Location" not in start.headers:
            raise client.fail(start, "blob upload")
        location = urllib.parse.urljoin(start.url, start.headers["Location"])
    _check_same_host(location, start.url, client)
    query = urllib.parse.urlencode({"digest": blob.digest})
    url = location + ("&" if "?" in location else "?") + query
    with blob.body() as body:
        put = client.request("PUT", url, {"Content-Type": "application/octet-stream"},
                             data=body)
    with put:
        if put.status_code != 201:
            raise client.fail(put, f"blob {blob.digest[:19]} upload")
    return True


def _check_same_host(location: str, origin: str, client: RegistryClient) -> None:
    """Refuse an upload location on another host: our credentials would follow it."""
    there, here = urllib.parse.urlsplit(location), urllib.parse.urlsplit(origin)
    if (there.scheme, there.netloc) != (here.scheme, here.netloc):
        raise SourceError(f"registry {client.ref.host} sent an upload location on another "
                          f"host ({there.netloc or '?'}): refused")
