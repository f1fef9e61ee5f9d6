"""An independent reference applier of OCI image layers, to check WeEnv's composition against.

Owns: applying layer tarballs (plain, gzip or zstd) to a directory with the layer semantics of
the OCI image spec (layer.md, "Applying Changesets" and "Whiteouts"):

- `.wh.NAME` removes NAME, and `.wh..wh..opq` removes every child of its directory, from
  LOWER layers only: all markers of a layer are applied before any of its entries, so an
  entry of the same layer survives whatever its position in the tar. Markers never appear
  in the result. Any name starting with `.wh.` is a marker, whatever its tar type.
- A marker's directory belongs to its layer, as an entry's parents do (Docker's and
  containerd's appliers create it before applying the marker): once every marker has
  removed what it hides, the missing directories on each marker's path are created like
  unlisted parents, unless a non-directory stands on the way (nothing to mark there). So
  `d/.wh..wh..opq` with `d/c/.wh.x` leaves an empty, fresh `d/c`, in either tar order.
- An entry over an existing path: two directories merge (the entry's attributes win); in
  every other case the old path (a whole subtree, if a directory) is removed and recreated.
- Hardlinks (tar type '1') name a path already in the tree, from this or a lower layer.
- Exact metadata: numeric uid/gid (uname/gname ignored), mode including set-id and sticky
  bits, `SCHILY.xattr.*` xattrs, nanosecond mtimes parsed from the PAX record, device
  numbers. Directory mtimes are set after the layer's last change inside them.
- Deterministic where tar leaves it open: a directory the layer changes but does not list
  keeps its previous mtime; a parent the layer never lists is created 0o755, root:root,
  mtime 0 (the epoch). A path listed twice: the later member wins.

Refuses (LayerRefused, naming the member), rather than sanitizing like some runtimes do:
absolute names, `..` components, any path (entry, marker or hardlink target) whose parent
is a symlink, hardlinks to directories, and markers `.wh.`, `.wh..`, `.wh...`.

Must not: be clever or fast. This is the oracle; WeEnv's code must never import it.
Not supported: `LIBARCHIVE.xattr.*` records, tar types other than the seven OCI file types.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path

import zstandard

WHITEOUT_PREFIX = b".wh."
OPAQUE_NAME = b".wh..wh..opq"
_XATTR = "SCHILY.xattr."
_ENC, _ERR = "utf-8", "surrogateescape"


class LayerError(Exception):
    """The layer cannot be applied."""


class LayerRefused(LayerError):
    """The layer would reach outside the root."""


@dataclass
class _Member:
    path: bytes  # normalized relative path; b"." is the root
    info: tarfile.TarInfo
    data: bytes
    mtime_ns: int
    xattrs: list[tuple[bytes, bytes]]
    link: bytes  # normalized hardlink target, or the verbatim symlink target


def apply_layers(root: Path, layers: Iterable[bytes | Path]) -> Path:
    """Apply `layers` (tar bytes, or paths to tar files), lowest first, onto `root`."""
    os.makedirs(root, exist_ok=True)
    for data in layers:
        apply_layer(root, data if isinstance(data, bytes) else Path(data).read_bytes())
    return root


def apply_layer(root: Path, data: bytes) -> None:
    """Apply one layer (plain, gzip or zstd tar) onto `root` with OCI semantics."""
    _Applier(os.fsencode(root)).run(_read(_decompress(data)))


def _decompress(data: bytes) -> bytes:
    if data[:2] == b"\x1f\x8b":
        import gzip

        return gzip.decompress(data)
    if data[:4] == b"\x28\xb5\x2f\xfd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


def _normalize(name: bytes, what: str) -> bytes:
    """A member name as a relative path; refuse what could leave the root."""
    if name.startswith(b"/"):
        raise LayerRefused(f"{what} {name!r} is absolute")
    parts = [p for p in name.split(b"/") if p not in (b"", b".")]
    if b".." in parts:
        raise LayerRefused(f"{what} {name!r} has a '..' component")
    return b"/".join(parts) or b"."


def _mtime_ns(info: tarfile.TarInfo) -> int:
    raw = info.pax_headers.get("mtime")
    if raw is None:
        return int(info.mtime) * 1_000_000_000
    # tarfile's own float loses the last digits; parse the decimal string exactly.
    return int((Decimal(raw) * 1_000_000_000).to_integral_value(rounding=ROUND_FLOOR))


def _read(tar_bytes: bytes) -> list[_Member]:
    members = []
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:", encoding=_ENC, errors=_ERR) as tar:
        for info in tar:
            path = _normalize(info.name.encode(_ENC, _ERR), "member")
            link = info.linkname.encode(_ENC, _ERR)
            if info.islnk():
                link = _normalize(link, f"hardlink {path!r} -> target")
            data = tar.extractfile(info).read() if info.isreg() else b""  # type: ignore[union-attr]
            xattrs = sorted(
                (k[len(_XATTR) :].encode(_ENC, _ERR), v.encode(_ENC, _ERR))
                for k, v in info.pax_headers.items()
                if k.startswith(_XATTR)
            )
            members.append(_Member(path, info, data, _mtime_ns(info), xattrs, link))
    return members


def _split(path: bytes) -> tuple[bytes, bytes]:
    parent, _, base = path.rpartition(b"/")
    return parent or b".", base


def _marker(m: _Member) -> bytes | None:
    """For a whiteout marker, the name it removes (b"" for opaque); None for an entry."""
    base = _split(m.path)[1]
    if base == OPAQUE_NAME:
        return b""
    if not base.startswith(WHITEOUT_PREFIX):
        return None
    victim = base[len(WHITEOUT_PREFIX) :]
    if victim in (b"", b".", b".."):
        raise LayerRefused(f"whiteout {m.path!r} names {victim!r}")
    return victim


class _Applier:
    """Applies one layer: markers, then entries in tar order, then directory mtimes."""

    def __init__(self, top: bytes) -> None:
        self.top = top
        self.saved: dict[bytes, int] = {}  # existing dir -> mtime before this layer touched it
        self.implicit: set[bytes] = set()  # parents this layer created without listing them
        self.dirs: dict[bytes, _Member] = {}  # directories this layer lists (last one wins)

    def run(self, members: list[_Member]) -> None:
        markers = [(m, v) for m in members if (v := _marker(m)) is not None]
        for m, victim in markers:
            self._whiteout(m, victim)
        for m, _ in markers:
            self._marker_dir(m)
        for m in members:
            if _marker(m) is None:
                self._entry(m)
        self._finish_dirs()

    def _abs(self, rel: bytes) -> bytes:
        return self.top if rel == b"." else os.path.join(self.top, rel)

    def _dir(self, rel: bytes, create: bool, member: bytes) -> bytes | None:
        """The directory `rel`, walked one component at a time so that no symlink is ever
        followed. Missing parts are created when `create`; otherwise None is returned."""
        done = b"."
        for part in [] if rel == b"." else rel.split(b"/"):
            path = os.path.join(done, part) if done != b"." else part
            try:
                st = os.lstat(self._abs(path))
            except FileNotFoundError:
                if not create:
                    return None
                self._touch(done)
                os.mkdir(self._abs(path), 0o755)
                os.chown(self._abs(path), 0, 0)
                self.implicit.add(path)
            else:
                if stat.S_ISLNK(st.st_mode):
                    raise LayerRefused(f"{member!r}: parent {path!r} is a symlink")
                if not stat.S_ISDIR(st.st_mode):
                    if not create:
                        return None
                    raise LayerError(f"{member!r}: parent {path!r} is not a directory")
            done = path
        return self._abs(rel)

    def _touch(self, rel_dir: bytes) -> None:
        """Remember a directory's mtime before this layer first changes its contents."""
        if rel_dir not in self.saved and rel_dir not in self.implicit:
            self.saved[rel_dir] = os.lstat(self._abs(rel_dir)).st_mtime_ns

    def _remove(self, rel: bytes) -> None:
        path = self._abs(rel)
        self._touch(_split(rel)[0])
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)  # does not follow symlinks inside
        else:
            os.unlink(path)

    def _whiteout(self, m: _Member, victim: bytes) -> None:
        parent = _split(m.path)[0]
        if self._dir(parent, create=False, member=m.path) is None:
            return  # nothing below to hide
        names = os.listdir(self._abs(parent)) if victim == b"" else [victim]
        for name in names:
            rel = os.path.join(parent, name) if parent != b"." else name
            if os.path.lexists(self._abs(rel)):
                self._remove(rel)

    def _marker_dir(self, m: _Member) -> None:
        """Create the missing directories on marker `m`'s path, like unlisted parents; none
        when a non-directory is on the way (a symlink there is refused by `_dir`)."""
        parent = _split(m.path)[0]
        parts = [] if parent == b"." else parent.split(b"/")
        for i in range(1, len(parts) + 1):
            try:
                st = os.lstat(self._abs(b"/".join(parts[:i])))
            except FileNotFoundError:
                break
            if not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
                return
        self._dir(parent, create=True, member=m.path)

    def _entry(self, m: _Member) -> None:
        if m.path == b".":
            if not m.info.isdir():
                raise LayerError(f"the root entry is not a directory (type {m.info.type!r})")
            self._attrs(self.top, m)
            self.dirs[m.path] = m
            return
        parent = _split(m.path)[0]
        self._dir(parent, create=True, member=m.path)
        path = self._abs(m.path)
        try:
            old = os.lstat(path)
        except FileNotFoundError:
            old = None
        if m.info.isdir() and old is not None and stat.S_ISDIR(old.st_mode):
            self.implicit.discard(m.path)
        else:
            source = self._link_source(m) if m.info.islnk() else b""
            if old is not None:
                self._remove(m.path)
            self._touch(parent)
            self._create(path, m, source)
        if m.info.islnk():
            return  # a hardlink shares its target's inode and attributes
        self._attrs(path, m)
        if m.info.isdir():
            self.dirs[m.path] = m
        else:
            os.utime(path, ns=(m.mtime_ns, m.mtime_ns), follow_symlinks=False)

    def _link_source(self, m: _Member) -> bytes:
        parent = _split(m.link)[0]
        if m.link == b"." or self._dir(parent, create=False, member=m.path) is None:
            raise LayerError(f"hardlink {m.path!r}: target {m.link!r} does not exist")
        source = self._abs(m.link)
        try:
            st = os.lstat(source)
        except FileNotFoundError:
            raise LayerError(f"hardlink {m.path!r}: target {m.link!r} does not exist") from None
        if stat.S_ISDIR(st.st_mode):
            raise LayerRefused(f"hardlink {m.path!r}: target {m.link!r} is a directory")
        return source

    def _create(self, path: bytes, m: _Member, source: bytes) -> None:
        info = m.info
        if info.isreg():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(m.data)
        elif info.isdir():
            os.mkdir(path, 0o700)
        elif info.issym():
            os.symlink(m.link, path)
        elif info.islnk():
            os.link(source, path, follow_symlinks=False)
        elif info.isfifo():
            os.mkfifo(path, 0o600)
        elif info.ischr() or info.isblk():
            kind = stat.S_IFCHR if info.ischr() else stat.S_IFBLK
            os.mknod(path, kind | 0o600, os.makedev(info.devmajor, info.devminor))
        else:
            raise LayerError(f"{m.path!r}: unsupported tar type {info.type!r}")

    def _attrs(self, path: bytes, m: _Member) -> None:
        # chown first: it clears set-id bits and security.capability.
        os.chown(path, m.info.uid, m.info.gid, follow_symlinks=False)
        if not m.info.issym():
            os.chmod(path, m.info.mode & 0o7777)
        for name, value in m.xattrs:
            os.setxattr(path, name, value, follow_symlinks=False)

    def _is_dir(self, rel: bytes) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(self._abs(rel)).st_mode)
        except FileNotFoundError:
            return False

    def _finish_dirs(self) -> None:
        """Directory mtimes, now that nothing will change inside them any more."""
        for rel, mtime in self.saved.items():
            if rel not in self.dirs and self._is_dir(rel):
                os.utime(self._abs(rel), ns=(mtime, mtime), follow_symlinks=False)
        for rel in self.implicit - self.dirs.keys():
            if self._is_dir(rel):
                os.utime(self._abs(rel), ns=(0, 0), follow_symlinks=False)
        for rel, m in self.dirs.items():
            os.utime(self._abs(rel), ns=(m.mtime_ns, m.mtime_ns), follow_symlinks=False)
