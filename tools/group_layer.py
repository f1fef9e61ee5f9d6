"""A group as an ordinary OCI image layer: `weenv push --layers full` (docs/containerd.md).

The layer a client without WeEnv unpacks: a gzip PAX tar of every entry of one group's index,
in the index's depth-first name order (parents before children), with the OCI layer
semantics the group was built from:

- a whiteout entry NAME becomes the empty file `.wh.NAME`; an opaque directory is followed by
  `DIR/.wh..wh..opq`;
- an inode met again under another name is a hardlink to its first name; regular files carry
  their data (holes as zeros: OCI layers should not use sparse entries), read and verified
  chunk by chunk (tools/reader.py), never held whole in memory;
- owners are numeric, modes keep set-id and sticky bits, `SCHILY.xattr.*` records carry
  xattrs, mtimes keep their nanoseconds (a PAX `mtime` record);
- directories the group only implies (parents it never listed, the root of a group built from
  a layer without `./`) are left out, so the layer below keeps their attributes, as it did
  when the group was built; sockets are left out (a tar cannot hold them, as Docker's
  cannot).

The tar and its gzip stream are deterministic (gzip mtime 0, no file name), written to a
file while both digests are computed: `diff_id` (sha256 of the tar) and `digest` (of the
gzip stream, the blob).

Owns: the tar members of a group and the spooled blob. Must not: upload (push.py) or decide
which layers are full.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from weenvfs.format.index import ROOT_INODE, GroupIndex, Inode

from .reader import ChunkReader

log = logging.getLogger(__name__)

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
GZIP_LEVEL = 6  # gzip's and Docker's default: the blob is downloaded by clients without WeEnv
_ENCODING, _ERRORS = "utf-8", "surrogateescape"  # names and values are bytes (as layers.py)
_TYPES = {stat.S_IFDIR: tarfile.DIRTYPE, stat.S_IFREG: tarfile.REGTYPE,
          stat.S_IFLNK: tarfile.SYMTYPE, stat.S_IFCHR: tarfile.CHRTYPE,
          stat.S_IFBLK: tarfile.BLKTYPE, stat.S_IFIFO: tarfile.FIFOTYPE}


@dataclass(frozen=True)
class SpooledLayer:
    """A layer blob written to `path`: its sha256 `digest`, `size` and `diff_id`."""

    path: Path
    digest: str
    size: int
    diff_id: str
    skipped_sockets: int


class _HashingWriter(io.RawIOBase):
    """Hashes what is written to it, then passes it on."""

    def __init__(self, out: BinaryIO) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.size += len(data)
        self.out.write(data)
        return len(data)


def write_group_layer(index: GroupIndex, reader: ChunkReader, path: Path) -> SpooledLayer:
    """Write the gzip tar layer of `index` to `path` (replaced)."""
    with open(path, "wb") as out:
        blob = _HashingWriter(out)
        with gzip.GzipFile(filename="", mode="wb", fileobj=blob, compresslevel=GZIP_LEVEL,
                           mtime=0) as compressed:
            raw = _HashingWriter(compressed)  # type: ignore[arg-type]
            with tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT,
                              encoding=_ENCODING, errors=_ERRORS) as tar:
                sockets = _add_members(tar, index, reader)
    if sockets:
        log.warning("group layer: %d sockets left out (a tar cannot hold them)", sockets)
    return SpooledLayer(path, "sha256:" + blob.sha.hexdigest(), blob.size,
                        "sha256:" + raw.sha.hexdigest(), sockets)


def _add_members(tar: tarfile.TarFile, index: GroupIndex, reader: ChunkReader) -> int:
    """Add every member of `index`; the number of sockets left out."""
    first: dict[int, str] = {}  # inode -> the name it was first added under
    sockets = 0
    for raw_path, ino in index.walk():
        name = raw_path.decode(_ENCODING, _ERRORS) if ino != ROOT_INODE else "."
        rec = index.inode(ino)
        if rec.whiteout:
            folder, _, base = name.rpartition("/")
            tar.addfile(_info(f"{folder}/{WHITEOUT}{base}" if folder else WHITEOUT + base))
            continue
        if rec.is_dir and rec.implied:
            continue
        if stat.S_IFMT(rec.mode) == stat.S_IFSOCK:
            sockets += 1
            continue
        if not rec.is_dir and ino in first:
            # With the inode's attributes, as tar writes them: containerd applies a link's
            # header to the inode it shares with its first name.
            link = _attributed(index, name, ino, rec, tarfile.LNKTYPE)
            link.linkname = first[ino]
            tar.addfile(link)
            continue
        first.setdefault(ino, name)
        _add_inode(tar, index, reader, name, ino, rec)
        if rec.is_dir and rec.opaque:
            tar.addfile(_info(f"{name}/{OPAQUE}" if ino != ROOT_INODE else OPAQUE))
    return sockets


def _attributed(index: GroupIndex, name: str, ino: int, rec: Inode,
                kind: bytes) -> tarfile.TarInfo:
    """A member `name` of type `kind` with inode `ino`'s owner, mode, mtime and xattrs."""
    info = _info(name, kind)
    info.mode, info.uid, info.gid = stat.S_IMODE(rec.mode), rec.uid, rec.gid
    info.mtime = rec.mtime_sec
    if rec.mtime_nsec:
        # tarfile would write a float (about 7 significant digits); write all nine.
        info.pax_headers["mtime"] = f"{rec.mtime_sec}.{rec.mtime_nsec:09d}"
    for key, value in index.xattrs(ino):
        info.pax_headers["SCHILY.xattr." + key.decode(_ENCODING, _ERRORS)] = value.decode(
            _ENCODING, _ERRORS)
    return info


def _add_inode(tar: tarfile.TarFile, index: GroupIndex, reader: ChunkReader, name: str,
               ino: int, rec: Inode) -> None:
    info = _attributed(index, "./" if ino == ROOT_INODE else name, ino, rec,
                       _TYPES[stat.S_IFMT(rec.mode)])
    if rec.is_lnk:
        info.linkname = index.readlink(ino).decode(_ENCODING, _ERRORS)
    elif info.type in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = os.major(rec.rdev), os.minor(rec.rdev)
    if rec.is_reg:
        info.size = rec.size
        tar.addfile(info, reader.open_file(index, ino))
    else:
        tar.addfile(info)


def _info(name: str, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    """A member with owner 0:0, mode 0644, mtime 0 (what a whiteout marker carries)."""
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, 0o644, 0
    return info
