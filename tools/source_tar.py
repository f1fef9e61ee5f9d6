"""A tar stream as a build source: one OCI layer (or any rootfs tarball), read once.

Owns: opening a tar file or stdin ('-') in streaming mode (`r|*`, so pipes work) with the
compression detected from its magic (plain, gzip, bzip2 and xz through tarfile, zstd through
zstandard), and turning members into `Entry`s: PAX headers with nanosecond mtimes and
SCHILY.xattr.* (also LIBARCHIVE.xattr.*), GNU long names and sparse maps, hardlinks, devices,
fifos, and OCI whiteouts (`.wh.NAME` -> a WHITEOUT entry for NAME, `.wh..wh..opq` -> OPAQUE
for its directory). Any tar or decompression failure becomes one `SourceError` line.

Must not: apply layer semantics (duplicates, whiteouts, implied directories: tree.py) or
seek: a member's data is readable only until the next member is requested.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import sys
import tarfile
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import zstandard

from weenvfs.errors import SourceError

from .entries import DataStream, Entry, Kind, check_entry, normalize_path, refuse, split_whiteout
from .regular_file import open_regular

log = logging.getLogger(__name__)

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_KINDS = {
    tarfile.REGTYPE: Kind.REG,
    tarfile.AREGTYPE: Kind.REG,
    tarfile.CONTTYPE: Kind.REG,
    tarfile.GNUTYPE_SPARSE: Kind.REG,
    tarfile.LNKTYPE: Kind.HARDLINK,
    tarfile.SYMTYPE: Kind.SYMLINK,
    tarfile.CHRTYPE: Kind.CHR,
    tarfile.BLKTYPE: Kind.BLK,
    tarfile.DIRTYPE: Kind.DIR,
    tarfile.FIFOTYPE: Kind.FIFO,
}
# What a corrupt, truncated or mis-compressed stream raises from tarfile and the codecs.
_STREAM_ERRORS = (tarfile.TarError, EOFError, zlib.error, zstandard.ZstdError, OSError)


def _b(text: str) -> bytes:
    """A str from tarfile back to its exact bytes (it decodes with surrogateescape)."""
    return text.encode("utf-8", "surrogateescape")


class _Prefixed(io.RawIOBase):
    """`head` followed by the rest of `stream`: lets us sniff magic bytes from a pipe."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        self._head = head
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        if self._head:
            n = min(len(buf), len(self._head))
            buf[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._stream.read(len(buf))
        buf[: len(data)] = data
        return len(data)


class _MemberReader(io.RawIOBase):
    """A member's data with stream failures turned into SourceError."""

    def __init__(self, inner: BinaryIO, path: bytes) -> None:
        self._inner = inner
        self._path = path

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        try:
            data = self._inner.read(len(buf))
        except _STREAM_ERRORS as e:
            raise refuse(self._path, f"cannot read data: {e}") from None
        buf[: len(data)] = data
        return len(data)


class TarSource:
    """The members of the tar at `path` ('-' for stdin), in stream order. With `fileobj`,
    the tar is read from that open stream (never closed here) and `path` is only its label."""

    def __init__(self, path: str | Path, *, fileobj: BinaryIO | None = None) -> None:
        self.label = "stdin" if str(path) == "-" and fileobj is None else str(path)
        self.total_bytes: int | None = None
        self._owned: BinaryIO | None = None
        if fileobj is not None:
            raw: BinaryIO = fileobj
        elif str(path) == "-":
            raw = sys.stdin.buffer
        else:
            try:
                raw = self._owned = open_regular(path, follow=True)
            except OSError as e:
                raise SourceError(f"cannot open source {self.label}: {e.strerror}") from None
        self._stream = _decompressed(raw, self.label)
        try:
            self._tar = tarfile.open(  # noqa: SIM115 - a stream kept open across entries()
                fileobj=self._stream, mode="r|*", encoding="utf-8", errors="surrogateescape"
            )
        except _STREAM_ERRORS as e:
            self.close()
            raise SourceError(f"source {self.label} is not a readable tar: {e}") from None

    def close(self) -> None:
        """Close the file this source opened (never stdin)."""
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def entries(self) -> Iterator[Entry]:
        """Entries in member order. Each REG entry's data must be read before the next one
        is requested (the stream moves on)."""
        while True:
            try:
                member = self._tar.next()
            except _STREAM_ERRORS as e:
                raise SourceError(f"source {self.label}: corrupt tar: {e}") from None
            if member is None:
                return
            self._tar.members.clear()  # streaming: never keep every TarInfo in memory
            entry = self._entry(member)
            if entry is not None:
                yield entry

    def _entry(self, m: tarfile.TarInfo) -> Entry | None:
        raw = _b(m.name)
        path = normalize_path(raw)
        kind = _KINDS.get(m.type)
        whiteout = split_whiteout(path) if path else None
        if whiteout is not None:
            return check_entry(Entry(whiteout[1], whiteout[0]))
        if kind is None:
            raise refuse(raw, f"unsupported tar member type {m.type!r}")
        entry = Entry(
            path,
            kind,
            mode=m.mode & 0o7777,
            uid=m.uid,
            gid=m.gid,
            mtime_ns=_mtime_ns(m),
            xattrs=_xattrs(m, raw),
        )
        if kind is Kind.REG:
            entry.size = m.size
            entry.open_data = self._opener(m, path)
        elif kind is Kind.SYMLINK:
            entry.target = _b(m.linkname)
        elif kind is Kind.HARDLINK:
            entry.target = normalize_path(_b(m.linkname), what=raw)
        elif kind in (Kind.CHR, Kind.BLK):
            entry.rdev = os.makedev(m.devmajor, m.devminor)
        return check_entry(entry)

    def _opener(self, m: tarfile.TarInfo, path: bytes) -> Callable[[], DataStream]:
        def open_data() -> DataStream:
            try:
                inner = self._tar.extractfile(m)
            except _STREAM_ERRORS as e:
                raise refuse(path, f"cannot read data: {e}") from None
            if inner is None:
                raise refuse(path, "tar member has no data")
            extents = None
            if m.sparse is not None:
                extents = [(off, off + size) for off, size in m.sparse if size]
            reader = io.BufferedReader(_MemberReader(inner, path), 1 << 20)
            return DataStream(reader, extents)

        return open_data


def _decompressed(raw: BinaryIO, label: str) -> BinaryIO:
    """`raw` with zstd undone if it starts with the zstd magic; tarfile handles the rest."""
    try:
        head = raw.read(len(ZSTD_MAGIC))
    except OSError as e:
        raise SourceError(f"cannot read source {label}: {e.strerror}") from None
    stream: BinaryIO = io.BufferedReader(_Prefixed(head, raw), 1 << 20)
    if head == ZSTD_MAGIC:
        reader = zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)
        stream = io.BufferedReader(_ZstdRaw(reader), 1 << 20)
    return stream


class _ZstdRaw(io.RawIOBase):
    """zstandard's stream reader as a raw stream (it lacks readinto on older versions)."""

    def __init__(self, reader: zstandard.ZstdDecompressionReader) -> None:
        self._reader = reader

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        data = self._reader.read(len(buf))
        buf[: len(data)] = data
        return len(data)


def _mtime_ns(m: tarfile.TarInfo) -> int:
    """The member's mtime in nanoseconds, exact from a PAX record when there is one
    (tarfile turns it into a float, which loses the nanoseconds); one before 1970 is 1970,
    as Docker applies layers (moby's Chtimes takes such times for the epoch)."""
    text = m.pax_headers.get("mtime")
    if text is None:
        return max(int(m.mtime), 0) * 1_000_000_000
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text.lstrip("+-").partition(".")
    if not whole.isdigit() or (frac and not frac.isdigit()):
        raise refuse(_b(m.name), f"bad PAX mtime {text!r:.40}")
    return max(sign * (int(whole) * 1_000_000_000 + int((frac + "000000000")[:9])), 0)


def _xattrs(m: tarfile.TarInfo, raw: bytes) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for key, value in m.pax_headers.items():
        if key.startswith("SCHILY.xattr."):  # an empty value is an empty xattr (kept)
            out[_b(key[len("SCHILY.xattr.") :])] = _b(value)
        elif key.startswith("LIBARCHIVE.xattr."):
            name = urllib.parse.unquote_to_bytes(key[len("LIBARCHIVE.xattr.") :])
            try:
                out[name] = base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
            except ValueError:
                raise refuse(raw, f"bad base64 in xattr {name[:80]!r}") from None
    return out
