"""Container images as a build source: what every transport (registry, OCI layout, docker
archive) resolves an image reference to.

Owns: `Layer` (digest, media type, size, diff_id and an opener of the blob's bytes), `Image`
(manifest and config digests, config, layers, provenance), `ImageSource`, the base class of
the transports, whose `resolve` walks index -> manifest -> config the same way for all (the
manifest digest checked when the reference names one, the config and nested manifests always),
and `SourceOptions`. Documents are parsed by oci_docs.py; image_transports.py picks a
transport.

Must not: decompress or check layers (layers.py), talk HTTP (registry.py), or read layout
files (oci_layout.py, docker_archive.py).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, BinaryIO

from weenvfs.errors import SourceError

from .oci_docs import (
    MANIFEST_TYPES,
    MAX_CONFIG_BYTES,
    MAX_INDEX_DEPTH,
    MAX_MANIFEST_BYTES,
    Descriptor,
    ImageConfig,
    Platform,
    config_descriptor,
    document_type,
    load_json,
    parse_config,
    select_manifest,
    sha256_digest,
    short_digest,
    verify_bytes,
)
from .progress import Progress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layer:
    """One layer of an image, lowest first. `digest` is that of the blob as stored (None
    when the source has none: a legacy `docker save` archive, checked by `diff_id` only);
    `open` returns a fresh stream of the blob's bytes. `verified` means the source already
    checked the bytes `open` returns against `digest` (a registry download)."""

    index: int
    media_type: str
    digest: str | None
    size: int | None
    diff_id: str | None
    open: Callable[[], BinaryIO] = field(repr=False, compare=False)
    verified: bool = False
    annotations: dict[str, str] = field(default_factory=dict, compare=False)  # descriptor's

    @property
    def label(self) -> str:
        return f"layer {self.index} ({short_digest(self.digest or self.diff_id)})"


@dataclass(frozen=True)
class Image:
    """A resolved image: manifest, config and layers (lowest first)."""

    source: str
    manifest_digest: str | None
    manifest_media_type: str
    config_digest: str | None
    config: ImageConfig
    layers: tuple[Layer, ...]
    index_digest: str | None = None  # the image index the manifest was selected from
    # The manifest and config as the source sent them (verified), for a client that records
    # the image elsewhere (`weenv pull` writes them into containerd); empty where unknown.
    manifest_bytes: bytes = field(default=b"", repr=False, compare=False)
    config_media_type: str = ""
    config_bytes: bytes = field(default=b"", repr=False, compare=False)

    @property
    def platform(self) -> str:
        c = self.config
        return "/".join(p for p in (c.os, c.architecture, c.variant) if p)

    def provenance(self) -> dict[str, Any]:
        """Where the image came from, for the environment manifest: strings, nulls (a digest
        a source does not have) and integers (byte sizes) only, never a float, as canonical
        JSON requires (SPEC.md 8.3). A size beyond 2^53 - 1 bytes is refused when the
        manifest is checked, before anything is converted."""
        out: dict[str, Any] = {
            "source": self.source,
            "manifest": self.manifest_digest,
            "manifest_media_type": self.manifest_media_type,
            "config": self.config_digest,
            "platform": self.platform,
            "layers": [
                {
                    "digest": la.digest,
                    "media_type": la.media_type,
                    "size": la.size,
                    "diff_id": la.diff_id,
                }
                for la in self.layers
            ],
        }
        if self.index_digest is not None:
            out["index"] = self.index_digest
        return out


# -- sources ------------------------------------------------------------------------------------


class ImageSource(ABC):
    """A place images come from. Subclasses implement `fetch_root`, `fetch_blob` and
    `open_blob`; `resolve` walks index -> manifest -> config the same way for all."""

    transport = ""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bytes_downloaded = 0

    @abstractmethod
    def fetch_root(self) -> tuple[bytes, str | None, str | None]:
        """The top document: (bytes, declared media type or None, expected digest or None)."""

    @abstractmethod
    def fetch_blob(self, desc: Descriptor, limit: int) -> bytes:
        """A small blob (manifest, config) by descriptor, at most `limit` bytes, verified."""

    @abstractmethod
    def layer_opener(self, desc: Descriptor) -> Callable[[], BinaryIO]:
        """An opener of a layer blob's bytes (not verified here)."""

    layers_verified = False  # whether layer_opener's bytes are checked by the source

    def prefetch(self, layers: Sequence[Layer]) -> None:  # noqa: B027 - optional hook
        """Start fetching these layers in the background (registry); default: nothing."""

    def wait_for(self, layer: Layer, progress: Progress) -> None:  # noqa: B027 - optional hook
        """Return once `layer` can be opened without waiting, showing the wait on
        `progress` (registry downloads); default: at once."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files, connections and temporary downloads."""

    def __enter__(self) -> ImageSource:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def resolve(self, plat: Platform) -> Image:
        """Follow the root document (through image indexes) to one image for `plat`."""
        data, declared, expected = self.fetch_root()
        if expected is not None:
            verify_bytes(data, expected, f"{self.label} manifest")
        digest = expected or sha256_digest(data)
        index_digest = None
        for _ in range(MAX_INDEX_DEPTH + 1):
            obj = load_json(data, f"{self.label} manifest {short_digest(digest)}")
            kind = document_type(obj, declared, f"{self.label} manifest {short_digest(digest)}")
            if kind in MANIFEST_TYPES:
                return self._image(obj, data, kind, digest, index_digest, plat)
            index_digest = index_digest or digest
            desc = select_manifest(obj, plat, f"{self.label} index {short_digest(digest)}")
            data = self.fetch_blob(desc, MAX_MANIFEST_BYTES)
            declared, digest = desc.media_type, desc.digest
        raise SourceError(f"{self.label}: image indexes nested deeper than {MAX_INDEX_DEPTH}")

    def _image(
        self,
        manifest: dict[str, Any],
        manifest_bytes: bytes,
        kind: str,
        digest: str,
        index_digest: str | None,
        plat: Platform,
    ) -> Image:
        what = f"{self.label} manifest {short_digest(digest)}"
        config_desc = config_descriptor(manifest, what)
        config_bytes = self.fetch_blob(config_desc, MAX_CONFIG_BYTES)
        config = parse_config(config_bytes, f"{self.label} config")
        descs = [
            Descriptor.from_json(d, f"{what} layers[{n}]") for n, d in enumerate(manifest["layers"])
        ]
        if config.diff_ids and len(config.diff_ids) != len(descs):
            raise SourceError(
                f"{what}: {len(descs)} layers but the config lists {len(config.diff_ids)} diff_ids"
            )
        if config.os and config.os != plat.os:
            log.info("%s: image is for %s, not %s", self.label, config.os, plat)
        layers = tuple(
            Layer(
                n,
                d.media_type,
                d.digest,
                d.size,
                config.diff_ids[n] if config.diff_ids else None,
                self.layer_opener(d),
                self.layers_verified,
                dict(d.annotations),
            )
            for n, d in enumerate(descs)
        )
        return Image(self.label, digest, kind, config_desc.digest, config, layers, index_digest,
                     manifest_bytes, config_desc.media_type, config_bytes)


@dataclass(frozen=True)
class SourceOptions:
    """How to reach an image: credentials and transport security (registries only)."""

    creds: tuple[str, str] | None = None
    insecure: bool = False
    insecure_remote: bool = False
    tmp_dir: str | None = None
