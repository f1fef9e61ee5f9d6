"""Declarative file trees for tests: build them on disk, snapshot them, compare two of them.

Owns: the entry constructors (`dir`, `file`, `sparse`, `symlink`, `hardlink`, `fifo`,
`chardev`, `blockdev`, in the style of estargz's `tarOf`), `make_tree` that creates entries
with exact owners, modes, xattrs and nanosecond mtimes (so it must run as root), the
`hostile_tree` preset, and `snapshot`/`compare_trees`, the single definition of "these two
trees are the same" used by every test that checks a mounted or converted tree.

Must not: know about WeEnv's format, tar (see layers.py) or layer composition (oci_apply.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import stat
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: Default mtime of entries: a fixed instant with a non-zero nanosecond part.
DEFAULT_MTIME = 1_600_000_000_123_456_789

PathLike = bytes | str


@dataclass(frozen=True)
class Spec:
    """One declared entry. `kind` is one of 'dir', 'reg', 'sparse', 'lnk', 'hard', 'fifo',
    'chr', 'blk'; `path` is relative bytes (b'.' is the root); `mtime` is in nanoseconds."""

    kind: str
    path: bytes
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = DEFAULT_MTIME
    xattrs: tuple[tuple[bytes, bytes], ...] = ()
    data: bytes = b""  # 'reg' content
    size: int = 0  # 'sparse' apparent size
    extents: tuple[tuple[int, bytes], ...] = ()  # 'sparse' data at offsets
    target: bytes = b""  # 'lnk' target, 'hard' path of the linked entry
    rdev: int = 0  # 'chr', 'blk'

    def content(self) -> bytes:
        """The bytes a reader sees: `data`, or a sparse file's holes filled with zeros."""
        if self.kind != "sparse":
            return self.data
        buf = bytearray(self.size)
        for offset, chunk in self.extents:
            buf[offset : offset + len(chunk)] = chunk
        return bytes(buf)


def _b(path: PathLike) -> bytes:
    """Normalize to relative bytes: drop leading '/', './' and empty components (keep '..',
    which make_tree refuses and layers.py needs for hostile members)."""
    parts = [p for p in os.fsencode(path).split(b"/") if p not in (b"", b".")]
    return b"/".join(parts) or b"."


def _x(xattrs: dict[PathLike, bytes] | None) -> tuple[tuple[bytes, bytes], ...]:
    return tuple(sorted((os.fsencode(k), bytes(v)) for k, v in (xattrs or {}).items()))


def dir(  # noqa: A001  (the estargz tarOf vocabulary; shadowing is deliberate)
    path: PathLike,
    mode: int = 0o755,
    uid: int = 0,
    gid: int = 0,
    mtime: int = DEFAULT_MTIME,
    xattrs: dict[PathLike, bytes] | None = None,
) -> Spec:
    """A directory (b'.' or '' is the root itself)."""
    return Spec("dir", _b(path), mode, uid, gid, mtime, _x(xattrs))


def file(
    path: PathLike,
    data: bytes = b"",
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: int = DEFAULT_MTIME,
    xattrs: dict[PathLike, bytes] | None = None,
) -> Spec:
    """A regular file holding `data`."""
    return Spec("reg", _b(path), mode, uid, gid, mtime, _x(xattrs), data=bytes(data))


def sparse(
    path: PathLike,
    size: int,
    extents: dict[int, bytes],
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: int = DEFAULT_MTIME,
) -> Spec:
    """A regular file of `size` bytes with real holes, holding `extents` {offset: bytes}."""
    ext = tuple(sorted((o, bytes(d)) for o, d in extents.items()))
    if any(o + len(d) > size for o, d in ext):
        raise ValueError(f"sparse {path!r}: an extent ends beyond size {size}")
    return Spec("sparse", _b(path), mode, uid, gid, mtime, size=size, extents=ext)


def symlink(
    path: PathLike,
    target: PathLike,
    uid: int = 0,
    gid: int = 0,
    mtime: int = DEFAULT_MTIME,
    xattrs: dict[PathLike, bytes] | None = None,
) -> Spec:
    """A symbolic link to `target` (stored verbatim: relative, absolute or dangling)."""
    return Spec("lnk", _b(path), 0o777, uid, gid, mtime, _x(xattrs), target=os.fsencode(target))


def hardlink(path: PathLike, target_path: PathLike) -> Spec:
    """A second name for the entry at `target_path` (declared earlier); it has no own attrs."""
    return Spec("hard", _b(path), target=_b(target_path))


def fifo(
    path: PathLike, mode: int = 0o644, uid: int = 0, gid: int = 0, mtime: int = DEFAULT_MTIME
) -> Spec:
    """A named pipe."""
    return Spec("fifo", _b(path), mode, uid, gid, mtime)


def chardev(
    path: PathLike,
    major: int,
    minor: int,
    mode: int = 0o666,
    uid: int = 0,
    gid: int = 0,
    mtime: int = DEFAULT_MTIME,
) -> Spec:
    """A character device node."""
    return Spec("chr", _b(path), mode, uid, gid, mtime, rdev=os.makedev(major, minor))


def blockdev(
    path: PathLike,
    major: int,
    minor: int,
    mode: int = 0o660,
    uid: int = 0,
    gid: int = 0,
    mtime: int = DEFAULT_MTIME,
) -> Spec:
    """A block device node."""
    return Spec("blk", _b(path), mode, uid, gid, mtime, rdev=os.makedev(major, minor))


def with_parents(entries: Iterable[Spec]) -> list[Spec]:
    """`entries` with a default `dir` inserted before the first use of each undeclared parent,
    so a tree (or a layer built from the same list) has no implicitly created directories."""
    declared = {e.path for e in entries if e.kind == "dir"}
    out: list[Spec] = []
    for e in entries:
        parts = e.path.split(b"/")[:-1] if e.path != b"." else []
        for i in range(1, len(parts) + 1):
            parent = b"/".join(parts[:i])
            if parent not in declared:
                declared.add(parent)
                out.append(dir(parent))
        out.append(e)
    return out


def make_tree(root: Path, *entries: Spec) -> Path:
    """Create `entries` under `root` (created if missing) with their exact metadata.

    Everything is created first; then owners, modes and xattrs are applied (chown before
    chmod and xattrs: chown clears set-id bits and security.capability), and mtimes last,
    deepest first, so creating a child never disturbs a directory's declared mtime."""
    top = os.fsencode(root)
    os.makedirs(top, exist_ok=True)
    specs = with_parents(entries)
    for e in specs:
        if e.path == b"." or b".." in e.path.split(b"/"):
            if e.path != b".":
                raise ValueError(f"path escapes the tree: {e.path!r}")
            continue
        _create(top, e)
    owned = [e for e in specs if e.kind != "hard"]
    for e in owned:
        _set_attrs(os.path.join(top, e.path), e)
    for e in sorted(owned, key=lambda e: -e.path.count(b"/") - (e.path != b".")):
        os.utime(os.path.join(top, e.path), ns=(e.mtime, e.mtime), follow_symlinks=False)
    return root


def _create(top: bytes, e: Spec) -> None:
    path = os.path.join(top, e.path)
    if e.kind == "dir":
        os.makedirs(path, exist_ok=True)
    elif e.kind in ("reg", "sparse"):
        with open(path, "wb") as f:
            f.write(e.data)
            if e.kind == "sparse":
                f.truncate(e.size)  # holes everywhere, then data at the extents
                for offset, chunk in e.extents:
                    f.seek(offset)
                    f.write(chunk)
    elif e.kind == "lnk":
        os.symlink(e.target, path)
    elif e.kind == "hard":
        os.link(os.path.join(top, e.target), path, follow_symlinks=False)
    elif e.kind == "fifo":
        os.mkfifo(path)
    elif e.kind in ("chr", "blk"):
        kind = stat.S_IFCHR if e.kind == "chr" else stat.S_IFBLK
        os.mknod(path, kind | 0o600, e.rdev)
    else:
        raise ValueError(f"unknown entry kind {e.kind!r}")


def _set_attrs(path: bytes, e: Spec) -> None:
    os.chown(path, e.uid, e.gid, follow_symlinks=False)
    if e.kind != "lnk":
        os.chmod(path, e.mode)
    for name, value in e.xattrs:
        os.setxattr(path, name, value, follow_symlinks=False)


# --- the hostile preset ---------------------------------------------------------------------

#: A valid vfs_cap_data (revision 2, effective): CAP_NET_BIND_SERVICE permitted.
CAP_NET_BIND_SERVICE = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


def hostile_entries() -> list[Spec]:
    """Everything a real root filesystem can hold, and the names that break naive code."""
    rng = random.Random(20240601)
    mib = 1 << 20
    e = [
        dir(".", 0o755, mtime=1_700_000_000_000_000_001),
        file("empty", b""),
        sparse(
            "sparse.img",
            10 * mib,
            {0: b"head", 4 * mib + 123: b"middle" * 100, 10 * mib - 5: b"tail!"},
        ),
        # Not a multiple of 1 MiB, so the last chunk of a chunked file is partial.
        file("big.bin", rng.randbytes(3 * mib + 17), mtime=1_650_000_000_999_999_999),
        dir("small", mtime=1_600_000_000_000_000_000),
    ]
    e += [
        file(f"small/f{i:04d}", rng.randbytes(rng.randrange(0, 300)), mtime=DEFAULT_MTIME + i)
        for i in range(200)
    ]
    e += [
        dir(b"\xff\xfe", xattrs={"user.dir": b"x"}),
        file(b"\xff\xfe/\xc3\x28", b"invalid utf-8 name\n"),
        file(b"\xff\xfe/latin1-\xe9", b"latin-1 name\n"),
        dir("names"),
        file("names/with space", b"space"),
        file("names/new\nline", b"newline"),
        file("names/tab\there", b"tab"),
        file("names/-leading-dash", b"dash"),
        file("names/--", b"dashes"),
        file("names/.hidden", b"hidden"),
        file("names/ünïcödé", "ünïcödé".encode()),
        file("names/" + "n" * 255, b"255 ascii bytes"),
        file("names/" + "é" * 127 + "x", b"255 utf-8 bytes"),
        file("/".join(["deep"] + [f"d{i:02d}" for i in range(60)] + ["leaf"]), b"deep"),
        dir("links"),
        symlink("links/rel", "../big.bin"),
        symlink("links/abs", "/etc/passwd"),
        symlink("links/dangling", "does/not/exist"),
        symlink("links/dir", "../small"),
        symlink("links/loop", "loop"),
        symlink("links/binary", b"../\xff\xfe"),
        symlink("links/long", "x/" * 600 + "end", mtime=1_234_567_890_000_000_007),
        dir("hard"),
        file("hard/a", b"three names, one inode\n", mode=0o640, uid=1000, gid=1000),
        hardlink("hard/b", "hard/a"),
        dir("other"),
        hardlink("other/c", "hard/a"),
        dir("dev"),
        chardev("dev/null", 1, 3),
        chardev("dev/zero", 1, 5),
        chardev("dev/bigminor", 511, 1_048_575),
        blockdev("dev/loop0", 7, 0),
        blockdev("dev/nvme", 259, 65_536),
        fifo("dev/fifo", mode=0o600),
        dir("bin"),
        file("bin/suid", b"#!/bin/sh\n", mode=0o4755),
        file("bin/sgid", b"#!/bin/sh\n", mode=0o2755, gid=50),
        file("bin/noperm", b"", mode=0o000),
        file("bin/all", b"", mode=0o777),
        dir("tmp", mode=0o1777),
        dir("shared", mode=0o2775, gid=100),
        dir("owned", uid=1000, gid=1000),
        file("owned/nobody", b"n", uid=65534, gid=65534),
        file("owned/big-ids", b"b", uid=1_234_567, gid=7_654_321),
        file("owned/epoch", b"0", mtime=0),
        file("owned/y2100", b"2100", mtime=4_102_444_800_000_000_001),
        dir("xattr"),
        file(
            "xattr/f",
            b"x",
            xattrs={
                "user.comment": b"hello",
                "user.empty": b"",
                "user.binary": bytes(range(256)),
                "trusted.hidden": b"\x00\x01\x02",
            },
        ),
        file(
            "xattr/cap",
            b"\x7fELF",
            mode=0o755,
            xattrs={"security.capability": CAP_NET_BIND_SERVICE},
        ),
        dir("empty_dir"),
        dir("private", mode=0o700, uid=1000),
        file("private/secret", b"s", mode=0o600, uid=1000),
    ]
    return e


def hostile_tree(root: Path) -> Path:
    """Create the hostile preset (`hostile_entries()`) under `root`."""
    return make_tree(root, *hostile_entries())


# --- snapshots and comparison ---------------------------------------------------------------

#: An `Entry.kind` by the file type bits of a mode (`stat.S_IFMT`), for every snapshot.
KIND_OF_MODE = {
    stat.S_IFREG: "reg",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "lnk",
    stat.S_IFCHR: "chr",
    stat.S_IFBLK: "blk",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "sock",
}

#: What `ignore=` accepts besides Entry field names.
IGNORE_EXTRA = frozenset({"mtime_of_dirs", "mtime_of_symlinks", "root"})


@dataclass(frozen=True)
class Entry:
    """One path of a snapshot; a field is None where it does not apply or is ignored.
    `links` is the sorted tuple of every path sharing the inode (non-directories with
    nlink > 1), so it compares equal across trees. Not hashable (xattrs is a dict)."""

    type: str
    mode: int | None
    uid: int | None
    gid: int | None
    mtime_ns: int | None
    size: int | None = None
    sha256: str | None = None
    target: bytes | None = None
    rdev: int | None = None
    xattrs: dict[bytes, bytes] | None = field(default_factory=dict)
    links: tuple[bytes, ...] | None = None


def snapshot(
    root: Path, ignore: Iterable[str] = (), exclude: Iterable[PathLike] = ()
) -> dict[bytes, Entry]:
    """Every path under `root` (relative bytes, b'.' for the root) mapped to its Entry.

    `ignore` names Entry fields to blank out, plus 'mtime_of_dirs', 'mtime_of_symlinks' and
    'root' (blank all of the root's attributes, e.g. for an export folder); `exclude` drops
    those relative paths and everything below them."""
    ignore = set(ignore)
    unknown = ignore - {f.name for f in dataclasses.fields(Entry)} - IGNORE_EXTRA
    if unknown:
        raise ValueError(f"unknown ignore option(s): {sorted(unknown)}")
    top = os.fsencode(root)
    excluded = {_b(p) for p in exclude}
    stats = dict(_walk(top, excluded))
    inodes: dict[tuple[int, int], list[bytes]] = {}
    for rel, st in stats.items():
        if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
            inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
    out = {}
    for rel, st in stats.items():
        links = inodes.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
        entry = _entry(os.path.join(top, rel) if rel != b"." else top, st, links)
        out[rel] = _blank(rel, entry, ignore)
    return out


def _walk(top: bytes, excluded: set[bytes]) -> Iterator[tuple[bytes, os.stat_result]]:
    yield b".", os.lstat(top)
    stack = [b""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(top, rel_dir) if rel_dir else top) as it:
            for d in it:
                rel = os.path.join(rel_dir, d.name) if rel_dir else d.name
                if rel in excluded:
                    continue
                st = d.stat(follow_symlinks=False)
                yield rel, st
                if stat.S_ISDIR(st.st_mode):
                    stack.append(rel)


def _entry(path: bytes, st: os.stat_result, links: list[bytes] | None) -> Entry:
    kind = KIND_OF_MODE[stat.S_IFMT(st.st_mode)]
    e = Entry(
        kind,
        stat.S_IMODE(st.st_mode),
        st.st_uid,
        st.st_gid,
        st.st_mtime_ns,
        xattrs=_xattrs(path),
        links=tuple(sorted(links)) if links else None,
    )
    if kind == "reg":
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        e = dataclasses.replace(e, size=st.st_size, sha256=digest.hexdigest())
    elif kind == "lnk":
        e = dataclasses.replace(e, target=os.readlink(path))
    elif kind in ("chr", "blk"):
        e = dataclasses.replace(e, rdev=st.st_rdev)
    return e


def _xattrs(path: bytes) -> dict[bytes, bytes]:
    names = os.listxattr(path, follow_symlinks=False)
    return {os.fsencode(n): os.getxattr(path, n, follow_symlinks=False) for n in sorted(names)}


def _blank(rel: bytes, e: Entry, ignore: set[str]) -> Entry:
    if rel == b"." and "root" in ignore:
        return Entry("dir", None, None, None, None, xattrs=None)
    blank = {name: None for name in ignore - IGNORE_EXTRA}
    if ("mtime_of_dirs" in ignore and e.type == "dir") or (
        "mtime_of_symlinks" in ignore and e.type == "lnk"
    ):
        blank["mtime_ns"] = None
    return dataclasses.replace(e, **blank) if blank else e


def _show(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value > 7:
        return str(value)
    return repr(value)


def compare_trees(
    a: Path, b: Path, ignore: Iterable[str] = (), exclude: Iterable[PathLike] = ()
) -> list[str]:
    """Human-readable differences between the trees at `a` and `b` (empty when equal)."""
    return compare_snapshots(snapshot(a, ignore, exclude), snapshot(b, ignore, exclude))


def compare_snapshots(sa: dict[bytes, Entry], sb: dict[bytes, Entry]) -> list[str]:
    """Differences between two snapshots: missing/extra paths, then each differing field."""
    diffs = []
    for rel in sorted(sa.keys() | sb.keys()):
        if rel not in sb:
            diffs.append(f"{rel!r}: only in a ({sa[rel].type})")
        elif rel not in sa:
            diffs.append(f"{rel!r}: only in b ({sb[rel].type})")
        elif sa[rel] != sb[rel]:
            for f in dataclasses.fields(Entry):
                va, vb = getattr(sa[rel], f.name), getattr(sb[rel], f.name)
                if va != vb:
                    shown = (
                        (oct(va), oct(vb))
                        if f.name == "mode" and None not in (va, vb)
                        else (_show(va), _show(vb))
                    )
                    diffs.append(f"{rel!r}: {f.name} {shown[0]} != {shown[1]}")
    return diffs


def assert_trees_equal(
    a: Path, b: Path, ignore: Iterable[str] = (), exclude: Iterable[PathLike] = (), limit: int = 50
) -> None:
    """Raise AssertionError listing the first `limit` differences between `a` and `b`."""
    diffs = compare_trees(a, b, ignore, exclude)
    if diffs:
        more = f"\n... and {len(diffs) - limit} more" if len(diffs) > limit else ""
        raise AssertionError(
            f"trees differ: {a} vs {b}, {len(diffs)} difference(s):\n"
            + "\n".join(diffs[:limit])
            + more
        )
