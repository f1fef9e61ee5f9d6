"""`weenv pull`: pull a WeEnv image into containerd, passing its layers' annotations.

What CRI (and any client pulling with `WithPullUnpack`) does for every layer, done here for
`ctr` users, as `ctr-remote image rpull` does for stargz: through containerd's own snapshots
service (the namespaced one, so containerd records the snapshots), Prepare each WeEnv layer
with its annotations as labels and `containerd.io/snapshot.ref` = its chain ID; the
snapshotter mounts the group and answers AlreadyExists, and containerd then has the layer
without downloading or unpacking anything. Then the image is recorded: an image of WeEnv
layers only (every layer present now) by image_record.py, through containerd's content and
images APIs (its manifest and config with the labels `ctr images pull` would give them, ~0.13
s faster than that process); any other by `ctr images pull`, which does the rest (ordinary
layers, the garbage-collection labels that keep the snapshots), finding the WeEnv layers'
snapshots present. A lease holds the new snapshots and content until then; it is made and
deleted through containerd's leases API (two `ctr leases` processes cost ~0.1 s).

Owns: the chain IDs, the calls to containerd's snapshots, leases, content and images APIs,
the `ctr` commands.
Must not: mount anything (the snapshotter does), or parse images (tools/ does).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc

from weenvfs.errors import UsageError, WeenvError
from weenvfs.format.errors import FormatError
from weenvfs.format.oci_layer import from_labels
from weenvfs.tools.image_source import Image, Layer, SourceOptions
from weenvfs.tools.image_transports import open_image_source
from weenvfs.tools.oci_docs import Platform
from weenvfs.tools.registry import Reference
from weenvfs.tools.registry_auth import host_name

from . import api, image_record
from .labels import EXPIRE_LABEL, INHERITED_PREFIX, TARGET_LABEL

log = logging.getLogger(__name__)

CTR_TIMEOUT = 600.0  # seconds for `ctr images pull`
CALL_TIMEOUT = 120.0  # seconds for one snapshots call (a Prepare mounts a group)
LEASE_EXPIRES = timedelta(hours=1)  # what is left if we die before deleting the lease


@dataclass
class PullResult:
    """What `pull` did: the image's chain IDs and which layers came from WeEnv groups."""

    chain_ids: list[str] = field(default_factory=list)
    weenv_layers: list[int] = field(default_factory=list)  # prepared through their labels
    present: list[int] = field(default_factory=list)  # already in containerd
    recorded_by: str = ""  # "weenv" (image_record.py) or "ctr" (`ctr images pull`)


def chain_ids(diff_ids: list[str]) -> list[str]:
    """OCI chain IDs: ChainID(L0) = DiffID(L0); ChainID(Ln) = sha256(ChainID(Ln-1) + " " +
    DiffID(Ln))."""
    out: list[str] = []
    for diff_id in diff_ids:
        out.append(diff_id if not out else
                   "sha256:" + hashlib.sha256(f"{out[-1]} {diff_id}".encode()).hexdigest())
    return out


def resolve(ref: str, options: SourceOptions) -> Image:
    """The image `ref` (HOST/REPO[:TAG]) for this machine's platform: manifest and config."""
    with open_image_source("docker://" + ref.removeprefix("docker://"), options) as source:
        return source.resolve(Platform.host())


class Containerd:
    """The calls `pull` makes to one containerd: `ctr` and the snapshots API."""

    def __init__(self, socket: Path, namespace: str, snapshotter: str, plain_http: bool,
                 creds: tuple[str, str] | None = None) -> None:
        if shutil.which("ctr") is None:
            raise UsageError("ctr not found (Debian package containerd)")
        if not socket.exists():
            raise UsageError(f"no containerd socket at {socket}")
        self.socket, self.namespace, self.snapshotter = socket, namespace, snapshotter
        self.plain_http, self.creds = plain_http, creds
        self.lease: str | None = None
        self._channel = grpc.insecure_channel(f"unix:{socket}")

    def ctr(self, *args: str, timeout: float = CALL_TIMEOUT) -> str:
        done = subprocess.run(["ctr", "-a", str(self.socket), "-n", self.namespace, *args],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            # Its own error line, without the info lines containerd's client logs before it.
            text = done.stderr or done.stdout
            ours = [line for line in text.splitlines() if line.startswith("ctr: ")]
            detail = " ".join(" ".join(ours or [text]).split())[-500:]
            raise WeenvError(f"ctr {args[0]} {args[1] if len(args) > 1 else ''}: {detail}")
        return done.stdout

    def call(self, method: str, **fields: object) -> object:
        """Snapshots API `method` of containerd, for our snapshotter (and lease, if any)."""
        request, response, _ = api.METHODS[method]
        return self._unary(api.SERVICE, api.PACKAGE, method, request, response, self.lease,
                           snapshotter=self.snapshotter, **fields)

    def create_lease(self) -> str:
        """A new lease that expires by itself after LEASE_EXPIRES (as `ctr leases create
        --expires` makes one); its ID."""
        expire = datetime.now(UTC) + LEASE_EXPIRES
        try:
            response = self._lease_call("Create", id=f"weenv-pull-{uuid.uuid4().hex[:16]}",
                                        labels={EXPIRE_LABEL: expire.strftime(
                                            "%Y-%m-%dT%H:%M:%SZ")})
        except grpc.RpcError as error:
            raise _failed("lease create", "", error) from None
        return str(response.lease.id)  # type: ignore[attr-defined]

    def delete_lease(self, lease: str, sync: bool) -> None:
        """Delete `lease`; with `sync`, after containerd's garbage collection has run."""
        try:
            self._lease_call("Delete", id=lease, sync=sync)
        except grpc.RpcError as error:
            raise _failed("lease delete", lease, error) from None

    def content_call(self, method: str, **fields: object) -> Any:
        """Content API `method` (under the lease, if any)."""
        request, response, _ = api.CONTENT_METHODS[method]
        return self._unary(api.CONTENT_SERVICE, api.CONTENT_PACKAGE, method, request, response,
                           self.lease, **fields)

    def images_call(self, method: str, **fields: object) -> Any:
        """Images API `method`."""
        request, response, _ = api.IMAGES_METHODS[method]
        return self._unary(api.IMAGES_SERVICE, api.IMAGES_PACKAGE, method, request, response,
                           self.lease, **fields)

    def write_content(self, ref: str, data: bytes, expected: str,
                      labels: dict[str, str]) -> None:
        """Commit `data` (digest `expected`) to the content store with `labels`, in one
        message of the Write stream (grpc.RpcError ALREADY_EXISTS if it is there)."""
        request = api.message("WriteContentRequest", api.CONTENT_PACKAGE)
        call = self._channel.stream_stream(
            f"/{api.CONTENT_SERVICE}/Write", request_serializer=request.SerializeToString,
            response_deserializer=api.message("WriteContentResponse",
                                              api.CONTENT_PACKAGE).FromString)
        message = request(action=api.WRITE_ACTIONS["COMMIT"], ref=ref, total=len(data),
                          expected=expected, data=data, labels=labels)
        for _ in call(iter([message]), metadata=self._metadata(self.lease),
                      timeout=CALL_TIMEOUT):
            pass  # one answer: the commit's

    def _lease_call(self, method: str, **fields: object) -> object:
        request, response, _ = api.LEASE_METHODS[method]
        return self._unary(api.LEASES_SERVICE, api.LEASES_PACKAGE, method, request, response,
                           None, **fields)

    def _unary(self, service: str, package: str, method: str, request: str, response: str,
               lease: str | None, **fields: object) -> Any:
        call = self._channel.unary_unary(
            f"/{service}/{method}",
            request_serializer=api.message(request, package).SerializeToString,
            response_deserializer=api.message(response, package).FromString)
        return call(api.message(request, package)(**fields), metadata=self._metadata(lease),
                    timeout=CALL_TIMEOUT)

    def _metadata(self, lease: str | None) -> list[tuple[str, str]]:
        metadata = [("containerd-namespace", self.namespace)]
        if lease:
            metadata.append(("containerd-lease", lease))
        return metadata

    def exists(self, key: str) -> bool:
        try:
            self.call("Stat", key=key)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise _failed("stat", key, error) from None
        return True

    def prepare_remote(self, chain: str, parent: str, labels: dict[str, str]) -> None:
        """Prepare a WeEnv layer: the snapshotter must answer AlreadyExists."""
        key = f"extract-weenv-{uuid.uuid4().hex[:12]} {chain}"
        try:
            self.call("Prepare", key=key, parent=parent, labels=labels)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.ALREADY_EXISTS:
                return
            raise _failed("prepare", chain, error) from None
        self.call("Remove", key=key)
        raise WeenvError(f"snapshotter {self.snapshotter!r} did not take WeEnv layer {chain}: "
                         "is it `weenv snapshotter`?")

    def close(self) -> None:
        self._channel.close()


def _failed(what: str, key: str, error: grpc.RpcError) -> WeenvError:
    return WeenvError(f"containerd {what} {key[:19]}: {error.details()}")  # type: ignore[attr-defined]


def _labels(layer: Layer, chain: str) -> dict[str, str] | None:
    """The snapshot labels of a WeEnv layer (None for another layer)."""
    try:
        if from_labels(layer.annotations) is None:
            return None
    except FormatError as error:
        raise WeenvError(f"layer {layer.index}: {error}") from None
    labels = {k: v for k, v in layer.annotations.items() if k.startswith(INHERITED_PREFIX)}
    labels[TARGET_LABEL] = chain
    return labels


def pull(ref: str, image: Image, containerd: Containerd) -> PullResult:
    """Prepare the image's WeEnv layers through their labels, then `ctr images pull`."""
    diff_ids = [layer.diff_id for layer in image.layers]
    if any(d is None for d in diff_ids):
        raise WeenvError(f"{ref}: the image config lists no diff IDs")
    result = PullResult(chain_ids([d for d in diff_ids if d is not None]))
    containerd.lease = containerd.create_lease()
    done = False
    try:
        parent = ""
        for layer, chain in zip(image.layers, result.chain_ids, strict=True):
            if containerd.exists(chain):
                result.present.append(layer.index)
            else:
                labels = _labels(layer, chain)
                if labels is None:
                    break  # an ordinary layer: `ctr images pull` unpacks it and those above
                containerd.prepare_remote(chain, parent, labels)
                result.weenv_layers.append(layer.index)
            parent = chain
        pulled = _recordable(ref, image, result)
        if pulled is not None:
            image_record.record(containerd, pulled, containerd.snapshotter)
        else:
            args = ["images", "pull", "--snapshotter", containerd.snapshotter]
            if containerd.plain_http:
                args.append("--plain-http")
            if containerd.creds:
                args += ["--user", ":".join(containerd.creds)]
            containerd.ctr(*args, ref.removeprefix("docker://"), timeout=CTR_TIMEOUT)
        result.recorded_by = "weenv" if pulled is not None else "ctr"
        done = True
    finally:
        _end_lease(containerd, done)
    return result


def _recordable(ref: str, image: Image, result: PullResult) -> image_record.Pulled | None:
    """What `image_record` needs when every layer of `image` is present in containerd (a
    WeEnv layer prepared through its labels, or there already) and `ref` names a manifest,
    not an index (whose record, children and platforms `ctr images pull` keeps); else None:
    `ctr images pull` records it."""
    present = len(result.present) + len(result.weenv_layers)
    if (present != len(image.layers) or image.index_digest is not None or not image.layers
            or not image.manifest_bytes or image.manifest_digest is None
            or image.config_digest is None):
        return None
    name = ref.removeprefix("docker://")
    parsed = Reference.parse(name)
    if "@" not in name and ":" not in name.rpartition("/")[2]:
        name = f"{name}:latest"  # what a pull of the bare name resolves
    return image_record.Pulled(
        name=name,
        manifest=image_record.Blob(image.manifest_media_type, image.manifest_digest,
                                   image.manifest_bytes),
        config=image_record.Blob(image.config_media_type, image.config_digest,
                                 image.config_bytes),
        host=host_name(parsed.host), repository=parsed.repository,
        top_chain=result.chain_ids[-1])


def _end_lease(containerd: Containerd, done: bool) -> None:
    """Delete the pull's lease. After a failure, synchronously: containerd's garbage
    collection then removes the layers prepared so far (their group mounts released) before
    the command returns, instead of at its next collection."""
    lease, containerd.lease = containerd.lease, None
    if lease is None:
        return
    try:
        containerd.delete_lease(lease, sync=not done)
    except WeenvError as error:
        log.warning("lease %s not deleted (it expires in %s): %s", lease, LEASE_EXPIRES, error)
