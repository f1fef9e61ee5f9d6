"""`weenv pull`'s record of an image whose layers are all WeEnv layers: what `ctr images pull`
would leave in containerd, written through containerd's content and images APIs without a
`ctr` process (~0.13 s of a cold pull: its start, its progress display, its downloads).

What containerd's own client leaves after pulling and unpacking such an image, and so what is
written here (containerd 1.6, `client.Fetch` + `image.Unpack`):
- the manifest in the content store, labelled with its children (`containerd.io/gc.ref.
  content.config` and `...content.l.N`, so that the image keeps them) and its source
  (`containerd.io/distribution.source.HOST` = the repository, merged into a sorted list
  when the blob is there already);
- the config, labelled with its source and with the snapshot of the top layer's chain ID
  (`containerd.io/gc.ref.snapshot.SNAPSHOTTER`: what keeps the snapshots);
- the image record, NAME -> the manifest, made or, if the name exists, pointed at it.
The layer blobs are not fetched: each layer's snapshot is present (prepared through its
labels), which is what a lazy pull through CRI leaves too (`ctr images check` then lists
the layers as missing; `ctr run` needs only the manifest and config).

Owns: the labels and the order of the writes. Must not: resolve images (pull.py does) or
prepare snapshots.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from weenvfs.errors import WeenvError

from . import api

CONTENT_REF = "containerd.io/gc.ref.content"
SNAPSHOT_REF = "containerd.io/gc.ref.snapshot"
SOURCE_LABEL = "containerd.io/distribution.source"


class Calls(Protocol):
    """The containerd calls a record makes (pull.Containerd, under its lease)."""

    def content_call(self, method: str, **fields: object) -> Any: ...
    def images_call(self, method: str, **fields: object) -> Any: ...
    def write_content(self, ref: str, data: bytes, expected: str,
                      labels: dict[str, str]) -> None: ...


@dataclass(frozen=True)
class Blob:
    """A document of the image: its bytes as the registry sent them (digest verified)."""

    media_type: str
    digest: str
    data: bytes


@dataclass(frozen=True)
class Pulled:
    """What the record needs: the image's name, its manifest and config, where it came from
    (registry host name without port, repository) and its top chain ID."""

    name: str
    manifest: Blob
    config: Blob
    host: str
    repository: str
    top_chain: str


def manifest_labels(manifest: Blob) -> dict[str, str]:
    """The garbage-collection labels of a manifest: its config and each layer, by position."""
    doc = json.loads(manifest.data)
    labels = {f"{CONTENT_REF}.config": str(doc["config"]["digest"])}
    for n, layer in enumerate(doc.get("layers") or []):
        labels[f"{CONTENT_REF}.l.{n}"] = str(layer["digest"])
    return labels


def merged_sources(current: str, repository: str) -> str:
    """A distribution-source label's value with `repository` added: sorted, no repeats (as
    containerd's client keeps it)."""
    repos = {r for r in current.split(",") if r} | {repository}
    return ",".join(sorted(repos))


def record(calls: Calls, pulled: Pulled, snapshotter: str) -> None:
    """Write the config, then the manifest, then the image record (see the module's text)
    through `calls` (pull.Containerd: its lease holds the content until the image does)."""
    source_key = f"{SOURCE_LABEL}.{pulled.host}"
    _put(calls, pulled.config, {f"{SNAPSHOT_REF}.{snapshotter}": pulled.top_chain},
         source_key, pulled.repository)
    _put(calls, pulled.manifest, manifest_labels(pulled.manifest), source_key,
         pulled.repository)
    target = api.message(f"{api.TYPES_PACKAGE}.Descriptor")(
        media_type=pulled.manifest.media_type, digest=pulled.manifest.digest,
        size=len(pulled.manifest.data))
    image = api.message("Image", api.IMAGES_PACKAGE)(name=pulled.name, target=target)
    try:
        calls.images_call("Create", image=image)
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise _failed("image create", pulled.name, error) from None
        try:  # no field mask: target and labels replaced, as containerd's client does
            calls.images_call("Update", image=image)
        except grpc.RpcError as again:
            raise _failed("image update", pulled.name, again) from None


def _put(calls: Calls, blob: Blob, labels: dict[str, str], source_key: str,
         repository: str) -> None:
    """Commit `blob` with `labels` and its source; if containerd has it already, add them."""
    try:
        calls.write_content(ref=f"weenv-pull-{uuid.uuid4().hex[:12]}-{blob.digest}",
                            data=blob.data, expected=blob.digest,
                            labels={**labels, source_key: repository})
        return
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise _failed("content write", blob.digest, error) from None
    try:
        info = calls.content_call("Info", digest=blob.digest).info
        wanted = {**labels, source_key: merged_sources(info.labels.get(source_key, ""),
                                                        repository)}
        info = api.message("Info", api.CONTENT_PACKAGE)(digest=blob.digest, labels=wanted)
        mask = api.message("google.protobuf.FieldMask")(
            paths=[f"labels.{key}" for key in sorted(wanted)])
        calls.content_call("Update", info=info, update_mask=mask)
    except grpc.RpcError as error:
        raise _failed("content update", blob.digest, error) from None


def _failed(what: str, key: str, error: grpc.RpcError) -> WeenvError:
    return WeenvError(f"containerd {what} {key[:19]}: {error.details()}")  # type: ignore[attr-defined]
