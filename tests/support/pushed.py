"""Images built by hand for the containerd tests and uploaded with `weenv push`'s own uploader
(tools/push.py) to a real registry: WeEnv layers next to ordinary gzip tar layers (a mixed
image), and layers whose annotations or marker a test chose (hostile ones included).

Owns: `weenv_layers` (the marker layers `weenv push` writes for an environment), `tar_layer` (an
ordinary layer from `support.layers` entries), `marker_layer` (any annotations, any marker
JSON), `assemble` (config and manifest over a list of layers) and `push`.
Must not: validate anything (hostile layers are the point); the registry checks digests.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

from weenvfs.format.oci_layer import MARKER_DIR
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.image_source import SourceOptions
from weenvfs.tools.oci_docs import OCI_CONFIG, OCI_MANIFEST, Platform
from weenvfs.tools.push import (
    LAYER_TAR,
    LAYER_TAR_GZIP,
    Blob,
    Layer,
    PushImage,
    marker_layers,
    parse_target,
    push_image,
)

from . import layers


def weenv_layers(store: Path, env: str) -> list[Layer]:
    """The layers `weenv push` writes for `env` (NAME:TAG) of `store`, lowest first."""
    with open_store(str(store)) as opened:
        digest, manifest = Repository(opened).resolve_env(env)
        return marker_layers(manifest, digest, opened.url)


def tar_layer(*members: layers.Spec) -> Layer:
    """An ordinary gzip tar layer of `members` (support.layers entries, whiteouts too)."""
    raw = layers.layer(*members)
    return Blob(LAYER_TAR_GZIP, layers.gzip(raw)), "sha256:" + hashlib.sha256(raw).hexdigest()


def marker_layer(annotations: dict[str, str], marker: dict[str, Any] | bytes | None = None,
                 name: str = "layer-0.json") -> Layer:
    """An uncompressed layer with `annotations` whose blob holds `.weenv/<name>` with
    `marker` (a dict: as JSON; none: an empty folder `.weenv/`)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folder = tarfile.TarInfo(MARKER_DIR)
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        if marker is not None:
            data = marker if isinstance(marker, bytes) else json.dumps(marker).encode()
            entry = tarfile.TarInfo(f"{MARKER_DIR}/{name}")
            entry.size, entry.mode = len(data), 0o644
            tar.addfile(entry, io.BytesIO(data))
    blob = Blob(LAYER_TAR, out.getvalue(), annotations)
    return blob, blob.digest


def assemble(image_layers: list[Layer], run: dict[str, Any] | None = None,
             annotations: dict[str, str] | None = None) -> PushImage:
    """An image of `image_layers` (lowest first) whose config runs `run` (OCI config's
    `config`: Env, Cmd, WorkingDir, ...)."""
    platform = Platform.host()
    config_doc = {"architecture": platform.architecture, "os": platform.os,
                  "config": run or {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
                  "rootfs": {"type": "layers", "diff_ids": [d for _, d in image_layers]}}
    config = Blob(OCI_CONFIG, json.dumps(config_doc, sort_keys=True).encode())
    doc: dict[str, Any] = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                           "config": config.descriptor(),
                           "layers": [blob.descriptor() for blob, _ in image_layers]}
    if annotations:
        doc["annotations"] = annotations
    return PushImage(config, tuple(b for b, _ in image_layers), json.dumps(doc).encode())


def push(image: PushImage, ref: str, creds: tuple[str, str] | None = None) -> str:
    """Upload `image` as `ref` (HOST/REPO:TAG, plain HTTP on loopback); `ref`."""
    push_image(image, parse_target(ref), SourceOptions(creds=creds, insecure=True))
    return ref
