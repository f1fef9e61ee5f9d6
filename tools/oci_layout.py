"""`oci:DIR[:TAG]`: an OCI image layout directory as an image source.

Owns: reading `oci-layout` (version check), choosing the image from `index.json` (by the
`org.opencontainers.image.ref.name` annotation when a tag is given; the only image, or a
platform match among unnamed entries, when not), and reading blobs from
`blobs/<algorithm>/<hex>` with their size and digest checked (manifests and configs here,
layers by layers.py as they stream). `LayoutReader` is shared with docker_archive.py, whose
newer archives hold a layout inside a tar.

Must not: write into the layout, or follow a blob path outside it (blob names come from
validated digests only).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from weenvfs.errors import SourceError

from .image_source import ImageSource
from .oci_docs import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    MAX_MANIFEST_BYTES,
    Descriptor,
    load_json,
    verify_bytes,
)
from .regular_file import open_regular

log = logging.getLogger(__name__)

REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"  # what `docker save` (25+) writes


class LayoutReader:
    """File access of a layout: `open(relative path) -> BinaryIO`, `size(path) -> int|None`."""

    def __init__(
        self,
        label: str,
        open_file: Callable[[str], BinaryIO],
        size_of: Callable[[str], int | None],
    ) -> None:
        self.label = label
        self.open_file = open_file
        self.size_of = size_of

    def read(self, path: str, limit: int) -> bytes:
        size = self.size_of(path)
        if size is None:
            raise SourceError(f"{self.label}: {path} is missing")
        if size > limit:
            raise SourceError(f"{self.label}: {path} is {size} bytes, more than {limit}")
        with self.open_file(path) as f:
            return f.read()

    @staticmethod
    def blob_path(desc: Descriptor) -> str:
        algorithm, _, hexpart = desc.digest.partition(":")
        return f"blobs/{algorithm}/{hexpart}"

    def read_blob(self, desc: Descriptor, limit: int) -> bytes:
        path = self.blob_path(desc)
        data = self.read(path, limit)
        if len(data) != desc.size:
            raise SourceError(
                f"{self.label}: blob {desc.digest} is {len(data)} bytes, "
                f"its descriptor says {desc.size}"
            )
        return verify_bytes(data, desc.digest, f"{self.label} blob")

    def open_blob(self, desc: Descriptor) -> Callable[[], BinaryIO]:
        path = self.blob_path(desc)

        def opener() -> BinaryIO:
            size = self.size_of(path)
            if size is None:
                raise SourceError(f"{self.label}: layer blob {desc.digest} is missing")
            if size < desc.size:
                raise SourceError(
                    f"{self.label}: layer blob {desc.digest} is truncated: "
                    f"{size} of {desc.size} bytes"
                )
            if size > desc.size:
                raise SourceError(
                    f"{self.label}: layer blob {desc.digest} is {size} bytes, "
                    f"its descriptor says {desc.size}"
                )
            return self.open_file(path)

        return opener

    def check_version(self) -> None:
        try:
            obj = load_json(self.read("oci-layout", 1 << 16), f"{self.label} oci-layout")
        except SourceError as e:
            raise SourceError(f"{self.label} is not an OCI image layout: {e}") from None
        version = obj.get("imageLayoutVersion")
        if not isinstance(version, str) or not version.startswith("1."):
            raise SourceError(f"{self.label}: unsupported imageLayoutVersion {version!r:.40}")

    def root(self, tag: str | None) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of the image `tag` names in index.json."""
        index = load_json(self.read("index.json", MAX_MANIFEST_BYTES), f"{self.label} index.json")
        entries = index.get("manifests")
        if not isinstance(entries, list):
            raise SourceError(f"{self.label}: index.json has no manifests list")
        descs = [
            Descriptor.from_json(e, f"{self.label} index.json manifests[{n}]")
            for n, e in enumerate(entries)
        ]
        desc = _choose(descs, tag, self.label)
        if desc.media_type not in INDEX_TYPES + MANIFEST_TYPES:
            raise SourceError(
                f"{self.label}: index.json entry has media type {desc.media_type!r:.100}, "
                "not an image manifest or index"
            )
        return self.read_blob(desc, MAX_MANIFEST_BYTES), desc.media_type, desc.digest


def short_image_name(name: str) -> str:
    """'docker.io/library/debian:12' -> 'debian:12' (Docker Hub's implied prefixes)."""
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _choose(descs: list[Descriptor], tag: str | None, label: str) -> Descriptor:
    names = [d.annotations.get(REF_NAME) for d in descs]
    if tag is not None:
        for desc, name in zip(descs, names, strict=True):
            full = desc.annotations.get(CONTAINERD_NAME, "")
            if tag in (name, full) or (full and short_image_name(full) == short_image_name(tag)):
                return desc
        have = ", ".join(sorted({n for n in names if n})) or "none"
        raise SourceError(f"{label}: no image tagged {tag!r} (tags: {have})")
    if len(descs) == 1:
        return descs[0]
    if not descs:
        raise SourceError(f"{label}: the layout holds no image")
    have = ", ".join(sorted({n for n in names if n})) or "untagged images only"
    raise SourceError(f"{label}: the layout holds {len(descs)} images; name one ({have})")


class OciLayoutSource(ImageSource):
    """An image in an OCI image layout directory."""

    transport = "oci"

    def __init__(self, directory: Path, tag: str | None = None) -> None:
        label = f"oci:{directory}" + (f":{tag}" if tag else "")
        super().__init__(label)
        self.directory = directory
        self.tag = tag
        if not directory.is_dir():
            raise SourceError(f"{label}: {directory} is not a directory")
        self.reader = LayoutReader(label, self._open, self._size)
        self.reader.check_version()

    @classmethod
    def from_spec(cls, rest: str) -> OciLayoutSource:
        """`DIR[:TAG]`: the part after the last ':' is a tag unless it holds a '/' or the
        whole string is an existing directory."""
        path, sep, tag = rest.rpartition(":")
        if not sep or "/" in tag or not tag or os.path.isdir(rest):
            return cls(Path(rest))
        return cls(Path(path), tag)

    def _open(self, rel: str) -> BinaryIO:
        try:
            return open_regular(self.directory / rel, follow=False)
        except SourceError as e:
            raise SourceError(f"{self.label}: {e}") from None
        except OSError as e:
            raise SourceError(f"{self.label}: cannot open {rel}: {e.strerror}") from None

    def _size(self, rel: str) -> int | None:
        try:
            st = (self.directory / rel).lstat()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SourceError(f"{self.label}: cannot stat {rel}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise SourceError(f"{self.label}: {self.directory / rel} is not a regular file")
        return st.st_size

    def fetch_root(self) -> tuple[bytes, str | None, str | None]:
        return self.reader.root(self.tag)

    def fetch_blob(self, desc: Descriptor, limit: int) -> bytes:
        return self.reader.read_blob(desc, limit)

    def layer_opener(self, desc: Descriptor) -> Callable[[], BinaryIO]:
        return self.reader.open_blob(desc)
