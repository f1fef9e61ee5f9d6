"""`docker-archive:PATH[:REF|@N]`: the tar that `docker save` (or `skopeo copy ...
docker-archive:`) writes, as an image source.

Owns: reading the archive without extracting it: members are indexed once and read in place
by offset (a gzip- or zstd-compressed archive is first decompressed into a temporary file),
symlink members (skopeo links `<id>/layer.tar` to `<diff_id>.tar`) are resolved inside the
archive; both layouts:

- OCI style (Docker 25+): an `index.json` + `oci-layout` + `blobs/` layout inside the tar,
  read like `oci:` (digests and media types from the manifest);
- legacy: `manifest.json` listing `Config` and `Layers` paths. There is no manifest digest
  and layer files are named by path, so each layer is checked against its config diff_id
  (uncompressed sha256), and the config against its file name when that is a digest.

Several images in one archive: REF picks one by `RepoTags` / image name, `@N` by position.

Must not: write anything but the temporary decompressed copy (removed by `close`).
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import posixpath
import re
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from weenvfs.errors import SourceError

from .image_source import Image, ImageSource, Layer, SourceOptions
from .oci_docs import (
    Descriptor,
    Platform,
    check_digest,
    load_json,
    parse_config,
    sha256_digest,
    verify_bytes,
)
from .oci_layout import LayoutReader, short_image_name
from .regular_file import open_regular
from .staging import Staging

log = logging.getLogger(__name__)

LEGACY_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
LEGACY_MANIFEST = "docker-save manifest.json"
_HEX_NAME = re.compile(r"(?:blobs/sha256/)?([0-9a-f]{64})(?:\.json)?")
_MAX_LINK_HOPS = 16


class _Slice(io.RawIOBase):
    """Bytes [start, start + size) of a file, as a read-only stream."""

    def __init__(self, path: str, start: int, size: int) -> None:
        self._f = open_regular(path, follow=True)
        self._f.seek(start)
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        n = min(len(buf), self._left)
        if n <= 0:
            return 0
        got = self._f.readinto(memoryview(buf)[:n])
        self._left -= got
        return got

    def close(self) -> None:
        self._f.close()
        super().close()


class DockerArchiveSource(ImageSource):
    """An image in a `docker save` archive."""

    transport = "docker-archive"

    def __init__(self, path: Path, ref: str | None = None, options: SourceOptions | None = None):
        label = f"docker-archive:{path}" + (f":{ref}" if ref else "")
        super().__init__(label)
        self.ref = ref
        self._staging: Staging | None = None
        self._path = self._plain_tar(path, options or SourceOptions())
        self._members = self._index()
        self.layout = LayoutReader(label, self._open_member, self._member_size)
        self._oci = "index.json" in self._members and "oci-layout" in self._members

    @classmethod
    def from_spec(cls, rest: str, options: SourceOptions) -> DockerArchiveSource:
        """`PATH[:REF]`: the longest prefix up to a ':' that is an existing file is PATH."""
        if os.path.isfile(rest) or ":" not in rest:
            return cls(Path(rest), None, options)
        for pos in [i for i, c in enumerate(rest) if c == ":"][::-1]:
            if os.path.isfile(rest[:pos]):
                return cls(Path(rest[:pos]), rest[pos + 1 :] or None, options)
        return cls(Path(rest), None, options)

    # -- the archive ----------------------------------------------------------------------------

    def _plain_tar(self, path: Path, options: SourceOptions) -> str:
        try:
            with open_regular(path, follow=True) as f:
                head = f.read(4)
        except SourceError as e:
            raise SourceError(f"{self.label}: {e}") from None
        except OSError as e:
            raise SourceError(f"{self.label}: cannot open {path}: {e.strerror}") from None
        if head[:2] != b"\x1f\x8b" and head != b"\x28\xb5\x2f\xfd":
            return str(path)
        # Compressed archives are read by offset, so decompress once into a temporary file,
        # in a staging folder (staging.py) that the next conversion or gc removes if we die.
        self._staging = Staging(options.tmp_dir, "archive")
        out = os.path.join(self._staging.path, "archive.tar")
        log.info("%s: decompressing the archive into %s", self.label, out)
        try:
            with open_regular(path, follow=True) as raw, open(out, "wb") as dst:
                if head[:2] == b"\x1f\x8b":
                    shutil.copyfileobj(gzip.GzipFile(fileobj=raw), dst, 1 << 20)
                else:
                    reader = zstandard.ZstdDecompressor().stream_reader(
                        raw, read_across_frames=True
                    )
                    shutil.copyfileobj(reader, dst, 1 << 20)
        except (OSError, EOFError, zstandard.ZstdError) as e:
            self.close()
            raise SourceError(f"{self.label}: cannot decompress the archive: {e}") from None
        return out

    def _index(self) -> dict[str, tarfile.TarInfo]:
        members: dict[str, tarfile.TarInfo] = {}
        try:
            with tarfile.open(self._path, "r:") as tar:
                for m in tar:
                    name = posixpath.normpath(m.name.lstrip("/")).removeprefix("./")
                    members[name] = m
        except (tarfile.TarError, OSError, EOFError) as e:
            self.close()
            raise SourceError(f"{self.label}: not a readable tar archive: {e}") from None
        return members

    def _member(self, name: str) -> tarfile.TarInfo | None:
        """The regular-file member at `name`, following symlinks inside the archive."""
        name = posixpath.normpath(name).removeprefix("./")
        for _ in range(_MAX_LINK_HOPS):
            m = self._members.get(name)
            if m is None:
                return None
            if m.issym() or m.islnk():
                base = posixpath.dirname(name) if m.issym() else ""
                name = posixpath.normpath(posixpath.join(base, m.linkname)).removeprefix("./")
                if name.startswith("../") or name == "..":
                    raise SourceError(f"{self.label}: member link {m.name!r} leaves the archive")
                continue
            if not m.isreg() or m.sparse is not None:
                raise SourceError(f"{self.label}: member {m.name!r} is not a regular file")
            return m
        raise SourceError(f"{self.label}: too many links resolving {name!r}")

    def _member_size(self, name: str) -> int | None:
        m = self._member(name)
        return None if m is None else m.size

    def _open_member(self, name: str) -> BinaryIO:
        m = self._member(name)
        if m is None:
            raise SourceError(f"{self.label}: {name} is missing from the archive")
        return io.BufferedReader(_Slice(self._path, m.offset_data, m.size), 1 << 20)

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    # -- ImageSource ----------------------------------------------------------------------------

    def fetch_root(self) -> tuple[bytes, str | None, str | None]:
        ref = self.ref
        if ref is not None and ref.startswith("@"):
            raise SourceError(f"{self.label}: @N selects among legacy manifest.json entries only")
        return self.layout.root(ref)

    def fetch_blob(self, desc: Descriptor, limit: int) -> bytes:
        return self.layout.read_blob(desc, limit)

    def layer_opener(self, desc: Descriptor) -> Callable[[], BinaryIO]:
        return self.layout.open_blob(desc)

    def resolve(self, plat: Platform) -> Image:
        if self._oci:
            return super().resolve(plat)
        if "manifest.json" not in self._members:
            raise SourceError(
                f"{self.label}: neither manifest.json nor index.json: not a docker save archive"
            )
        return self._legacy()

    def _legacy(self) -> Image:
        entries = load_json(
            b'{"m": ' + self.layout.read("manifest.json", 16 << 20) + b"}",
            f"{self.label} manifest.json",
            32 << 20,
        )["m"]
        if not isinstance(entries, list) or not entries:
            raise SourceError(f"{self.label}: manifest.json is not a non-empty list")
        entry = self._choose_legacy(entries)
        config_path = entry.get("Config")
        layer_paths = entry.get("Layers")
        if not isinstance(config_path, str) or not isinstance(layer_paths, list):
            raise SourceError(f"{self.label}: manifest.json entry without Config or Layers")
        data = self.layout.read(config_path, 64 << 20)
        named = _HEX_NAME.fullmatch(config_path)
        if named:
            verify_bytes(data, "sha256:" + named.group(1), f"{self.label} config")
        config = parse_config(data, f"{self.label} config")
        if len(config.diff_ids) != len(layer_paths):
            raise SourceError(
                f"{self.label}: {len(layer_paths)} layers but the config lists "
                f"{len(config.diff_ids)} diff_ids (cannot verify the layers)"
            )
        layers = tuple(
            self._legacy_layer(n, path, config.diff_ids[n]) for n, path in enumerate(layer_paths)
        )
        return Image(self.label, None, LEGACY_MANIFEST, sha256_digest(data), config, layers)

    def _legacy_layer(self, n: int, path: object, diff_id: str) -> Layer:
        if not isinstance(path, str):
            raise SourceError(f"{self.label}: manifest.json Layers[{n}] is not a path")
        size = self._member_size(path)
        if size is None:
            raise SourceError(f"{self.label}: layer {n} ({path}) is missing from the archive")
        check_digest(diff_id, f"{self.label} config diff_id {n}")
        return Layer(n, LEGACY_LAYER, None, size, diff_id, lambda: self._open_member(path))

    def _choose_legacy(self, entries: list[Any]) -> dict[str, Any]:
        ref = self.ref
        if ref is not None and ref.startswith("@"):
            if not ref[1:].isdigit() or int(ref[1:]) >= len(entries):
                raise SourceError(
                    f"{self.label}: no image {ref} (the archive holds {len(entries)})"
                )
            chosen = entries[int(ref[1:])]
        elif ref is not None:
            matches = [
                e
                for e in entries
                if isinstance(e, dict)
                and any(
                    short_image_name(str(t)) == short_image_name(ref)
                    for t in e.get("RepoTags") or []
                )
            ]
            if not matches:
                raise SourceError(f"{self.label}: no image tagged {ref!r} in the archive")
            chosen = matches[0]
        elif len(entries) == 1:
            chosen = entries[0]
        else:
            tags = sorted(
                str(t) for e in entries if isinstance(e, dict) for t in e.get("RepoTags") or []
            )
            raise SourceError(
                f"{self.label}: the archive holds {len(entries)} images; add :REF or @N "
                f"({', '.join(tags) or 'untagged'})"
            )
        if not isinstance(chosen, dict):
            raise SourceError(f"{self.label}: manifest.json entry is not an object")
        return chosen
