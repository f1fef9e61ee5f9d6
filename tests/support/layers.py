"""OCI/Docker layer tarballs built in memory from the same entry constructors as trees.py.

Owns: turning `trees.Spec` entries into a PAX tar (`layer`), the OCI union markers
(`whiteout`, `opaque`), compression helpers (`gzip`, `zstd`) and `hostile_layers()`, layers
that a safe applier or converter must refuse.

Exactness: names, link targets and xattr values may be arbitrary bytes (PAX
`hdrcharset=BINARY`); xattrs travel as `SCHILY.xattr.<name>`; an mtime with a fractional
second travels as a PAX `mtime` record with all nine digits. Python's `tarfile` turns that
record into a float when reading (losing nanoseconds): readers must parse
`member.pax_headers["mtime"]` themselves (see oci_apply.py).

Must not: validate member names (hostile layers need `..` and absolute names).
"""

from __future__ import annotations

import dataclasses
import gzip as _gzip
import io
import os
import tarfile
from pathlib import Path

import zstandard

# Re-exported: a layer is declared with the same constructors as a tree.
from .trees import (  # noqa: F401
    PathLike,
    Spec,
    blockdev,
    chardev,
    dir,  # noqa: A004
    fifo,
    file,
    hardlink,
    sparse,
    symlink,
    with_parents,
)

WHITEOUT_PREFIX = b".wh."
OPAQUE_NAME = b".wh..wh..opq"
_ENCODING = "utf-8"
_ERRORS = "surrogateescape"


def whiteout(path: PathLike) -> Spec:
    """The marker that removes `path` from lower layers: `dir/.wh.name`."""
    parent, _, name = os.fsencode(path).strip(b"/").rpartition(b"/")
    marker = WHITEOUT_PREFIX + name
    return file(parent + b"/" + marker if parent else marker, b"")


def opaque(dirpath: PathLike) -> Spec:
    """The marker that hides every lower-layer child of `dirpath`: `dirpath/.wh..wh..opq`."""
    parent = os.fsencode(dirpath).strip(b"/")
    return file(parent + b"/" + OPAQUE_NAME if parent not in (b"", b".") else OPAQUE_NAME, b"")


def layer(*members: Spec) -> bytes:
    """An uncompressed PAX tar holding `members` in the given order, names exactly as given
    (relative names get no './' prefix; the root is './')."""
    buf = io.BytesIO()
    with tarfile.open(
        fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, encoding=_ENCODING, errors=_ERRORS
    ) as tar:
        for m in members:
            info, data = _tarinfo(m)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def layer_file(path: Path, *members: Spec) -> Path:
    """`layer(*members)` written to `path`; returns `path`."""
    path.write_bytes(layer(*members))
    return path


def union_layers() -> list[list[Spec]]:
    """Three layers exercising every union rule (all directories declared explicitly)."""
    low = with_parents([
        dir(".", mtime=1_000), file("etc/a", b"low a"), file("etc/b", b"low b"),
        file("keep/x", b"x"), file("opq/old", b"old"), file("gone/deep/y", b"y"),
        file("dir2file/z", b"z"), file("file2dir", b"f"), symlink("etc/link", "a"),
        file("usr/lib/libfoo.so", b"\x7fELF" * 3000, mode=0o755),
        file("hl/one", b"hard"), hardlink("hl/two", "hl/one"),
    ])
    mid = with_parents([
        dir(".", mtime=2_000), dir("etc", mode=0o750), file("etc/a", b"mid a"),
        whiteout("etc/b"), whiteout("gone"),
        file("dir2file", b"now a file"), dir("file2dir"), file("file2dir/inner", b"i"),
        dir("opq", mode=0o700), opaque("opq"), file("opq/new", b"new"),
        dir("usr"), dir("usr/lib"), file("usr/lib/libbar.so", b"bar", mode=0o755),
    ])
    top = with_parents([
        dir(".", mtime=3_000), dir("etc", mode=0o755), file("etc/c", b"top c"),
        whiteout("etc/link"), dir("keep", mode=0o711, uid=5),
        file("gone", b"back as a file"), dir("usr"), dir("usr/lib"),
        whiteout("usr/lib/libfoo.so"),
    ])
    return [low, mid, top]


def _s(raw: bytes) -> str:
    return raw.decode(_ENCODING, _ERRORS)


def _tarinfo(m: Spec) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(_s(b"./" if m.path == b"." else m.path))
    info.mode, info.uid, info.gid = m.mode, m.uid, m.gid
    seconds, frac = divmod(m.mtime, 1_000_000_000)
    info.mtime = seconds
    if frac:
        # tarfile would write a float (about 7 significant fraction digits); write all nine.
        info.pax_headers["mtime"] = f"{seconds}.{frac:09d}"
    for name, value in m.xattrs:
        info.pax_headers["SCHILY.xattr." + _s(name)] = _s(value)
    data = b""
    if m.kind == "dir":
        info.type = tarfile.DIRTYPE
    elif m.kind in ("reg", "sparse"):
        data = m.content()  # OCI: sparse files SHOULD NOT be used; store the zeros
        info.type, info.size = tarfile.REGTYPE, len(data)
    elif m.kind == "lnk":
        info.type, info.linkname = tarfile.SYMTYPE, _s(m.target)
    elif m.kind == "hard":
        info.type, info.linkname = tarfile.LNKTYPE, _s(m.target)
    elif m.kind == "fifo":
        info.type = tarfile.FIFOTYPE
    elif m.kind in ("chr", "blk"):
        info.type = tarfile.CHRTYPE if m.kind == "chr" else tarfile.BLKTYPE
        info.devmajor, info.devminor = os.major(m.rdev), os.minor(m.rdev)
    else:
        raise ValueError(f"unknown entry kind {m.kind!r}")
    return info, data


def gzip(data: bytes) -> bytes:
    """gzip-compress (media type ...tar+gzip); mtime 0 so equal input gives equal bytes."""
    return _gzip.compress(data, mtime=0)


def zstd(data: bytes) -> bytes:
    """zstd-compress (media type ...tar+zstd), with the content size in the frame header."""
    return zstandard.ZstdCompressor(level=3).compress(data)


def _raw(spec: Spec, path: bytes) -> Spec:
    """`spec` under a name that the constructors would normalize away (absolute, '..')."""
    return dataclasses.replace(spec, path=path)


def _hard(path: bytes, target: bytes) -> Spec:
    """A hardlink whose target is kept verbatim (the constructor would normalize it)."""
    return dataclasses.replace(hardlink(path, "x"), target=target)


def hostile_layers() -> dict[str, list[bytes]]:
    """Named cases, each a list of layers (applied in order) that must be refused because
    applying them naively would write, link or delete outside the root."""
    x = file("x", b"escaped\n")
    return {
        "dotdot": [layer(_raw(x, b"../x"))],
        "dotdot_inside": [layer(dir("a"), _raw(x, b"a/../../x"))],
        "absolute": [layer(_raw(file("p", b"root::0:0::/:/bin/sh\n"), b"/etc/passwd"))],
        "symlink_escape": [layer(symlink("a", "/"), file("a/escape", b"out\n"))],
        "symlink_escape_relative": [layer(symlink("a", ".."), file("a/escape", b"out\n"))],
        "symlink_escape_across_layers": [
            layer(symlink("a", "/")),
            layer(file("a/escape", b"out\n")),
        ],
        "hardlink_outside": [layer(_hard(b"h", b"../outside"))],
        "hardlink_absolute": [layer(_hard(b"h", b"/etc/passwd"))],
        "hardlink_through_symlink": [layer(symlink("a", "/etc"), hardlink("h", "a/passwd"))],
        "whiteout_dotdot": [layer(dir("sub"), _raw(file("w"), b"sub/.wh.."))],
        "whiteout_through_symlink": [
            layer(symlink("a", "/etc")),
            layer(_raw(file("w"), b"a/.wh.passwd")),
        ],
    }
