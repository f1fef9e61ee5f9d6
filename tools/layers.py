"""Image layers as build sources: decompressed, parsed and verified in one streaming pass.

Owns: the layer media types WeEnv accepts (OCI and Docker tar, tar+gzip, tar+zstd) and
`check_media_type`, run on every layer before any work starts; choosing the decompressor
from the data's magic bytes (the media type must agree, except that an uncompressed media
type tolerates compressed data, as Docker does); and `LayerSource`, an `entries.Source` over
one layer that hashes the stored bytes (sha256 against the manifest digest) and the
uncompressed tar (against the config's diff_id) while the tar parser reads them, then checks
the size, the digest and the diff_id once the stream ends. A layer that fails any check
raises one `SourceError` line; since a group is stored only after all of its layers were
read, nothing of a bad layer is ever published.

Must not: apply layer semantics (tree.py, convert_group.py) or fetch blobs (the sources do).
"""

from __future__ import annotations

import gzip
import io
import logging
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import zstandard

from weenvfs.errors import SourceError

from .entries import Entry
from .image_source import Layer
from .oci_docs import hasher
from .source_tar import TarSource

log = logging.getLogger(__name__)

_OCI = "application/vnd.oci.image.layer.v1.tar"
_OCI_ND = "application/vnd.oci.image.layer.nondistributable.v1.tar"
_DOCKER = "application/vnd.docker.image.rootfs.diff.tar"
FOREIGN = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
#: Accepted layer media types -> the compression they declare.
LAYER_TYPES = {
    _OCI: "none",
    _OCI + "+gzip": "gzip",
    _OCI + "+zstd": "zstd",
    _OCI_ND: "none",
    _OCI_ND + "+gzip": "gzip",
    _OCI_ND + "+zstd": "zstd",
    _DOCKER: "none",
    _DOCKER + ".gzip": "gzip",
    _DOCKER + ".zstd": "zstd",
}
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_READ = 1 << 20
_STREAM_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError)


def check_media_type(layer: Layer) -> str:
    """The compression `layer`'s media type declares; SourceError if it is not a layer
    WeEnv can apply (foreign layers, artifacts, unknown compressions)."""
    if layer.media_type == FOREIGN:
        raise SourceError(f"{layer.label}: foreign layers (fetched from URLs) are not supported")
    compression = LAYER_TYPES.get(layer.media_type)
    if compression is None:
        raise SourceError(f"{layer.label}: unsupported layer media type {layer.media_type!r:.100}")
    return compression


def sniff(head: bytes) -> str:
    """'gzip', 'zstd' or 'none' from the first bytes of a blob."""
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return "none"


class _Hashing(io.RawIOBase):
    """Reads `inner`, hashing and counting what passes; `on_bytes` sees each read's size."""

    def __init__(
        self, inner: Any, digest: str | None, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        self._inner = inner
        self._hash = hasher(digest) if digest else None
        self._algorithm = digest.partition(":")[0] if digest else ""
        self._on_bytes = on_bytes
        self.count = 0
        self.eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        data = self._inner.read(len(buf))
        n = len(data)
        if not n:
            self.eof = True
            return 0
        buf[:n] = data
        if self._hash is not None:
            self._hash.update(data)
        self.count += n
        if self._on_bytes is not None:
            self._on_bytes(n)
        return n

    def hexdigest(self) -> str:
        assert self._hash is not None
        return f"{self._algorithm}:{self._hash.hexdigest()}"

    def drain(self) -> None:
        """Read (and hash) everything left."""
        while self.read(_READ):
            pass


class LayerSource:
    """The entries of one layer, checked against the image's digests as they stream.

    `on_bytes` is called with the number of stored (compressed) bytes read, for progress.
    """

    def __init__(self, layer: Layer, on_bytes: Callable[[int], None] | None = None) -> None:
        self.layer = layer
        self.label = layer.label
        self.total_bytes: int | None = None
        self._declared = check_media_type(layer)
        if layer.digest is None and layer.diff_id is None:
            raise SourceError(f"{self.label}: neither a digest nor a diff_id to verify it by")
        self._on_bytes = on_bytes
        self._raw: BinaryIO | None = None

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    def entries(self) -> Iterator[Entry]:
        """Every entry of the layer; the checks run when the tar ends (and before the last
        entry is handed out, the data of which the caller has read by then)."""
        layer = self.layer
        self._raw = layer.open()
        check = None if layer.verified else layer.digest
        stored = _Hashing(self._raw, check, self._on_bytes)
        buffered = io.BufferedReader(stored, _READ)
        compression = self._compression(buffered.peek(4)[:4])
        plain = _Hashing(_decompressor(buffered, compression), layer.diff_id)
        try:
            tar = TarSource(self.label, fileobj=io.BufferedReader(plain, _READ))
            yield from tar.entries()
            plain.drain()  # tar end padding: part of the diff_id
            stored.drain()
        except SourceError as e:
            raise self._truncated(stored) or e from None
        except _STREAM_ERRORS as e:
            raise self._truncated(stored) or SourceError(
                f"{self.label}: corrupt {compression} data: {e}"
            ) from None
        finally:
            self.close()
        self._verify(stored, plain, check)

    def _compression(self, head: bytes) -> str:
        actual = sniff(head)
        declared = self._declared
        if actual != declared and declared != "none":
            raise SourceError(
                f"{self.label}: media type {self.layer.media_type} says {declared}, "
                f"but the data is {'uncompressed' if actual == 'none' else actual}"
            )
        if actual != declared:
            log.debug("%s: %s data under media type %s", self.label, actual, self.layer.media_type)
        return actual

    def _truncated(self, stored: _Hashing) -> SourceError | None:
        size = self.layer.size
        if size is not None and stored.eof and stored.count < size:
            return SourceError(f"{self.label}: truncated: {stored.count} of {size} bytes")
        return None

    def _verify(self, stored: _Hashing, plain: _Hashing, check: str | None) -> None:
        layer = self.layer
        if layer.size is not None and stored.count != layer.size:
            raise SourceError(
                f"{self.label}: size mismatch: {stored.count} bytes, the manifest says {layer.size}"
            )
        if check is not None and stored.hexdigest() != check:
            raise SourceError(
                f"{self.label}: digest mismatch: expected {check}, got {stored.hexdigest()}"
            )
        if layer.diff_id is not None and plain.hexdigest() != layer.diff_id:
            raise SourceError(
                f"{self.label}: diff_id mismatch: the config says {layer.diff_id}, "
                f"the uncompressed layer is {plain.hexdigest()}"
            )
        log.debug(
            "%s: verified, %d bytes stored, %d uncompressed", self.label, stored.count, plain.count
        )


def _decompressor(stream: BinaryIO, compression: str) -> Any:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if compression == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(
            stream, read_size=_READ, read_across_frames=True
        )
    return stream
