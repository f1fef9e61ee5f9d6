"""OCI and Docker image documents: media types, descriptors, platforms, manifests, indexes
and configs, parsed and checked. Pure: bytes in, values or one-line `SourceError`s out.

Owns: the media types and size limits; digest checks (sha256, sha512); `Platform` (parsed
`os/arch[/variant]`, the host's by default) and selection from an image index (attestation
manifests skipped); `Descriptor`; `document_type`, which refuses Docker schema 1, non-image
types and a document whose `mediaType` contradicts the descriptor (or Content-Type) that led
to it; `config_descriptor`, which refuses artifacts (a config that is not an image config);
`parse_config` into `ImageConfig`, the parts of the config WeEnv keeps.

Must not: do I/O (the transports fetch, image_source.py walks).
"""

from __future__ import annotations

import hashlib
import json
import platform as _platform
import re
from dataclasses import dataclass, field
from typing import Any

from weenvfs.errors import SourceError, UsageError
from weenvfs.format.manifest import RuntimeConfig

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_SCHEMA1 = (
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
CONFIG_TYPES = (OCI_CONFIG, DOCKER_CONFIG)
#: Every manifest type a registry may answer with, for the Accept header.
ACCEPT_MANIFESTS = (OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST)

MAX_MANIFEST_BYTES = 4 << 20  # the distribution spec's limit for manifests
MAX_CONFIG_BYTES = 64 << 20
MAX_INDEX_DEPTH = 4  # nested image indexes followed at most
_DIGEST = re.compile(r"(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})")
_ARCHES = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm",
    "armv6l": "arm",
    "i386": "386",
    "i686": "386",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
}


def check_digest(text: object, what: str) -> str:
    """`text` if it is a sha256 or sha512 digest in OCI form, else SourceError."""
    if not isinstance(text, str) or not _DIGEST.fullmatch(text):
        raise SourceError(f"{what}: invalid digest {str(text)[:80]!r}")
    return text


def hasher(digest: str) -> Any:
    """A new hashlib object of the digest's algorithm."""
    return hashlib.new(digest.partition(":")[0])


def verify_bytes(data: bytes, digest: str, what: str) -> bytes:
    """`data` if it hashes to `digest`, else SourceError."""
    h = hasher(digest)
    h.update(data)
    actual = f"{digest.partition(':')[0]}:{h.hexdigest()}"
    if actual != digest:
        raise SourceError(f"{what}: digest mismatch: expected {digest}, got {actual}")
    return data


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def short_digest(digest: str | None) -> str:
    """'sha256:0123456789ab' for messages."""
    return "?" if digest is None else digest[: digest.index(":") + 13]


# -- platforms ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Platform:
    """An `os/arch[/variant]` to select from an image index."""

    os: str
    architecture: str
    variant: str = ""

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.strip().split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise UsageError(f"invalid platform {text!r} (expected OS/ARCH[/VARIANT])")
        return cls(parts[0].lower(), parts[1].lower(), parts[2].lower() if len(parts) > 2 else "")

    @classmethod
    def host(cls) -> Platform:
        """The machine's platform: linux/<GOARCH of this CPU>."""
        machine = _platform.machine().lower()
        arch = _ARCHES.get(machine, machine)
        variant = {"armv7l": "v7", "armv6l": "v6"}.get(machine, "")
        return cls("linux", arch, variant)

    def matches(self, obj: dict[str, Any]) -> bool:
        """Whether an index entry's `platform` object is this platform. A requested
        variant must match; without one any variant does (arm64 entries say 'v8')."""
        if obj.get("os") != self.os or obj.get("architecture") != self.architecture:
            return False
        return not self.variant or obj.get("variant", "") == self.variant

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


# -- documents ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a blob is, its digest and its size."""

    media_type: str
    digest: str
    size: int
    platform: dict[str, Any] | None = None
    annotations: dict[str, str] = field(default_factory=dict)
    urls: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: object, what: str) -> Descriptor:
        if not isinstance(obj, dict):
            raise SourceError(f"{what}: descriptor is not a JSON object")
        media_type = obj.get("mediaType")
        size = obj.get("size")
        if not isinstance(media_type, str) or not media_type:
            raise SourceError(f"{what}: descriptor has no mediaType")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise SourceError(f"{what}: descriptor has an invalid size {size!r:.40}")
        plat = obj.get("platform")
        annotations = obj.get("annotations") or {}
        urls = obj.get("urls") or []
        if plat is not None and not isinstance(plat, dict):
            raise SourceError(f"{what}: platform is not a JSON object")
        if not isinstance(annotations, dict) or not isinstance(urls, list):
            raise SourceError(f"{what}: invalid annotations or urls")
        digest = check_digest(obj.get("digest"), what)
        return cls(media_type, digest, size, plat, dict(annotations), tuple(map(str, urls)))


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an OCI image config that WeEnv keeps."""

    os: str = ""
    architecture: str = ""
    variant: str = ""
    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    diff_ids: tuple[str, ...] = ()

    def runtime_config(self) -> RuntimeConfig:
        """The environment's runtime config. A relative WorkingDir is taken from '/', as
        Docker does."""
        cwd = self.working_dir or "/"
        return RuntimeConfig(
            env=self.env,
            cwd=cwd if cwd.startswith("/") else "/" + cwd,
            user=self.user,
            entrypoint=self.entrypoint,
            cmd=self.cmd,
            labels=dict(self.labels),
        )


def load_json(data: bytes, what: str, limit: int = MAX_MANIFEST_BYTES) -> dict[str, Any]:
    """Parse a JSON object of at most `limit` bytes."""
    if len(data) > limit:
        raise SourceError(f"{what}: {len(data)} bytes, more than the limit of {limit}")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SourceError(f"{what}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{what}: not a JSON object")
    return obj


def document_type(obj: dict[str, Any], declared: str | None, what: str) -> str:
    """The media type of a manifest or index document, checked against `declared` (the
    descriptor's or the HTTP Content-Type). Refuses schema 1, non-image types and a
    `mediaType` field that contradicts the declaration."""
    inner = obj.get("mediaType")
    if declared in DOCKER_SCHEMA1 or inner in DOCKER_SCHEMA1 or obj.get("schemaVersion") == 1:
        raise SourceError(f"{what}: Docker schema 1 manifests are not supported")
    if inner is not None and not isinstance(inner, str):
        raise SourceError(f"{what}: mediaType is not a string")
    if declared and inner and declared != inner:
        raise SourceError(
            f"{what}: media type mismatch: declared {declared}, document says {inner}"
        )
    kind = inner or declared
    if kind is None:  # OCI 1.0 made the field optional: infer from the structure
        kind = OCI_INDEX if "manifests" in obj else OCI_MANIFEST
    if kind not in INDEX_TYPES + MANIFEST_TYPES:
        raise SourceError(f"{what}: unsupported manifest media type {kind!r:.100}")
    if obj.get("schemaVersion") != 2:
        raise SourceError(f"{what}: unsupported schemaVersion {obj.get('schemaVersion')!r:.20}")
    if kind in INDEX_TYPES and not isinstance(obj.get("manifests"), list):
        raise SourceError(f"{what}: an image index without a manifests list")
    if kind in MANIFEST_TYPES and not isinstance(obj.get("layers"), list):
        raise SourceError(f"{what}: an image manifest without a layers list")
    return kind


def select_manifest(index: dict[str, Any], plat: Platform, what: str) -> Descriptor:
    """The entry of an image index for `plat` (attestations and unknown types skipped)."""
    seen = []
    for n, obj in enumerate(index["manifests"]):
        desc = Descriptor.from_json(obj, f"{what} manifests[{n}]")
        if desc.media_type not in INDEX_TYPES + MANIFEST_TYPES:
            continue
        if desc.annotations.get("vnd.docker.reference.type") == "attestation-manifest":
            continue
        p = desc.platform or {}
        seen.append(
            "/".join(str(p.get(k, "")) for k in ("os", "architecture", "variant") if p.get(k))
            or "unspecified"
        )
        if plat.matches(p):
            return desc
    have = ", ".join(seen) or "none"
    raise SourceError(f"{what}: no image for platform {plat} (available: {have})")


def parse_config(data: bytes, what: str) -> ImageConfig:
    """The ImageConfig of an OCI/Docker image config document."""
    obj = load_json(data, what, MAX_CONFIG_BYTES)
    cfg = obj.get("config") or {}
    rootfs = obj.get("rootfs") or {}
    if not isinstance(cfg, dict) or not isinstance(rootfs, dict):
        raise SourceError(f"{what}: config or rootfs is not a JSON object")
    diff_ids = rootfs.get("diff_ids") or []
    if not isinstance(diff_ids, list):
        raise SourceError(f"{what}: rootfs.diff_ids is not a list")
    labels = cfg.get("Labels") or {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise SourceError(f"{what}: config.Labels must map strings to strings")
    return ImageConfig(
        os=_str(obj, "os", what),
        architecture=_str(obj, "architecture", what),
        variant=_str(obj, "variant", what),
        env=_strs(cfg, "Env", what),
        working_dir=_str(cfg, "WorkingDir", what),
        user=_str(cfg, "User", what),
        entrypoint=_strs(cfg, "Entrypoint", what),
        cmd=_strs(cfg, "Cmd", what),
        labels=dict(labels),
        diff_ids=tuple(check_digest(d, f"{what} rootfs.diff_ids") for d in diff_ids),
    )


def _str(obj: dict[str, Any], key: str, what: str) -> str:
    value = obj.get(key) or ""
    if not isinstance(value, str):
        raise SourceError(f"{what}: {key} is not a string")
    return value


def _strs(obj: dict[str, Any], key: str, what: str) -> tuple[str, ...]:
    value = obj.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SourceError(f"{what}: {key} is not a list of strings")
    return tuple(value)


def config_descriptor(manifest: dict[str, Any], what: str) -> Descriptor:
    """The manifest's config descriptor, which must name a container image config (not an
    artifact's)."""
    config = Descriptor.from_json(manifest.get("config"), f"{what} config")
    if config.media_type not in CONFIG_TYPES:
        raise SourceError(
            f"{what}: not a container image (config media type {config.media_type!r:.100})"
        )
    return config
