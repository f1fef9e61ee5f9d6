"""`weenv push`: publish an environment as an OCI image that any registry stores.

The image (docs/containerd.md): an OCI manifest whose config carries the environment's
runtime config (Env, Entrypoint, Cmd, WorkingDir, User, Labels) and one uncompressed tar
layer per group, lowest first. Each layer names its group (store URL, manifest digest,
position, index digest) in its descriptor's annotations and in its blob, a marker tar of a
few hundred bytes (format/oci_layer.py); the group's data stays in the store. The manifest's
own annotations name the environment (`org.opencontainers.image.ref.name`-style keys are
left to users; we add `containerd.io/snapshot/weenv/manifest`).

Owns: building the image documents (`build_image`, pure) and uploading them in the order a
registry needs (blobs, then the manifest) through the registry client of `weenv convert`
(registry.py: same auth, retries, plain-HTTP policy). Must not: read group data (only the
manifest is read from the store), or write to the store.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from weenvfs.errors import SourceError
from weenvfs.format.manifest import Manifest
from weenvfs.format.oci_layer import KEY_MANIFEST, LayerRef, encode_layer_tar

from .image_source import SourceOptions
from .oci_docs import OCI_CONFIG, OCI_MANIFEST, Platform, sha256_digest
from .registry import Reference, RegistryClient

log = logging.getLogger(__name__)

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"


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
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest,
                               "size": len(self.data)}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out


@dataclass(frozen=True)
class PushImage:
    """An image ready to upload: its config, layers and manifest bytes."""

    config: Blob
    layers: tuple[Blob, ...]
    manifest: bytes

    @property
    def digest(self) -> str:
        return sha256_digest(self.manifest)


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def build_image(manifest: Manifest, digest: str, store_url: str, platform: Platform) -> PushImage:
    """The OCI image of environment `digest` (its `manifest`), its data in `store_url`."""
    layers = []
    for position, group in enumerate(manifest.groups):
        ref = LayerRef(store_url, digest, position, group.index)
        layers.append(Blob(LAYER_TAR, encode_layer_tar(ref), ref.annotations()))
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
        # An uncompressed layer's diff ID is its digest.
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
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


def _upload_blob(client: RegistryClient, blob: Blob) -> bool:
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
    put = client.request("PUT", url, {"Content-Type": "application/octet-stream"}, data=blob.data)
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
