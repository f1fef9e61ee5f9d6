"""`weenv inspect`: what an environment or a group holds, for people and for scripts.

Owns: per-group statistics (entry counts by type, file bytes, chunks, blobs, index size), the
environment report (manifest, groups, runtime config, hints, provenance, total sizes), entry
listings in `ls -l` style, and the one escaping rule for names on a terminal.

Names are arbitrary bytes. On a terminal (`escape_name`) they are shown as UTF-8 where valid and
printable; a backslash is doubled, and any other byte or character is written as an escape
(`\\n`, `\\t`, `\\xHH` for a byte that is not valid UTF-8 or a control character, `\\uHHHH` for a
non-printable character), so output never holds a raw control character and the escaped form
maps back to exactly one name. In JSON (`json_name`) a name is the string decoded from UTF-8
with `surrogateescape` (Python gets the bytes back with
`name.encode("utf-8", "surrogateescape")`), written with ASCII escapes, and when the name is not
valid UTF-8 an extra `<field>_hex` member holds the exact bytes in hex.

Must not: fetch chunk data (inspect reads manifests and indexes only) or change the store.
"""

from __future__ import annotations

import datetime
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from weenvfs.errors import UsageError
from weenvfs.format.compose import ComposedTree, Entry
from weenvfs.format.digest import short
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex, Inode
from weenvfs.store.repository import Repository
from weenvfs.units import format_size

from .reader import LoadedEnv, LoadedGroup, load_env, load_group_ref

log = logging.getLogger(__name__)

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_TYPE_NAMES = {
    stat.S_IFREG: "reg",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "lnk",
    stat.S_IFCHR: "chr",
    stat.S_IFBLK: "blk",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "sock",
}


# -- names --------------------------------------------------------------------------------------


def escape_name(name: bytes) -> str:
    """`name` for a terminal: printable UTF-8 as is, everything else backslash-escaped."""
    out = []
    for ch in name.decode("utf-8", "surrogateescape"):
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that is not valid UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        else:
            out.append(f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def json_name(obj: dict[str, Any], field: str, name: bytes) -> None:
    """Store `name` in `obj[field]` (surrogateescape) and, if not UTF-8, `obj[field_hex]`."""
    obj[field] = name.decode("utf-8", "surrogateescape")
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        obj[f"{field}_hex"] = name.hex()


# -- statistics ---------------------------------------------------------------------------------


@dataclass
class GroupStats:
    """Counts and sizes of one group index (hardlinked inodes counted once)."""

    inodes: int = 0
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    other: int = 0  # devices, fifos, sockets
    whiteouts: int = 0
    opaque_dirs: int = 0
    file_bytes: int = 0
    chunks: int = 0
    zero_chunks: int = 0
    chunk_bytes: int = 0  # compressed bytes of the chunk records (frames shared by records once)
    blobs: int = 0
    chunk_size: int = 0
    index_bytes: int = 0  # the stored (compressed) index object
    index_raw_bytes: int = 0


def group_stats(group: LoadedGroup) -> GroupStats:
    """Statistics of a loaded group."""
    index = group.index
    s = GroupStats(
        inodes=index.inode_count,
        blobs=index.header.blob_count,
        chunks=index.header.chunk_count,
        chunk_size=index.chunk_size,
        index_bytes=group.stored_size,
        index_raw_bytes=len(index.raw),
    )
    for ino in range(index.inode_count):
        rec = index.inode(ino)
        kind = stat.S_IFMT(rec.mode)
        if rec.whiteout:
            s.whiteouts += 1
        elif kind == stat.S_IFREG:
            s.files += 1
            s.file_bytes += rec.size
        elif kind == stat.S_IFDIR:
            s.dirs += 1
            s.opaque_dirs += rec.opaque
        elif kind == stat.S_IFLNK:
            s.symlinks += 1
        else:
            s.other += 1
    for _, clen in _frames(index).items():
        s.chunk_bytes += clen
    s.zero_chunks = sum(index.chunk(n).zero for n in range(index.header.chunk_count))
    return s


def _frames(index: GroupIndex) -> dict[tuple[str, int], int]:
    """(blob digest, offset) -> compressed length of every stored frame the index uses."""
    blobs = index.blob_digests()
    frames = {}
    for n in range(index.header.chunk_count):
        rec = index.chunk(n)
        if not rec.zero:
            frames[(blobs[rec.blob], rec.offset)] = rec.clen
    return frames


def composed_file_bytes(tree: ComposedTree) -> tuple[int, int]:
    """(entries, bytes of regular files) of a composed tree, hardlinks counted once."""
    seen: set[tuple[int, int]] = set()
    entries = total = 0
    for _, entry in tree.walk():
        entries += 1
        rec = tree.groups[entry.group].inode(entry.inode)
        if rec.is_reg and (entry.group, entry.inode) not in seen:
            seen.add((entry.group, entry.inode))
            total += rec.size
    return entries, total


# -- reports ------------------------------------------------------------------------------------


def env_report(env: LoadedEnv, ref: str) -> dict[str, Any]:
    """The JSON-able description of an environment."""
    m = env.manifest
    frames: dict[tuple[str, int], int] = {}
    groups = []
    for g in env.groups:
        frames.update(_frames(g.index))
        groups.append({"name": g.name, "index": g.digest, **asdict(group_stats(g))})
    entries, file_bytes = composed_file_bytes(env.tree())
    stored = sum(frames.values()) + sum(g.stored_size for g in env.groups)
    return {
        "ref": ref,
        "manifest": env.digest,
        "groups": groups,
        "config": {
            "env": list(m.config.env),
            "cwd": m.config.cwd,
            "user": m.config.user,
            "entrypoint": list(m.config.entrypoint),
            "cmd": list(m.config.cmd),
            "labels": dict(m.config.labels),
        },
        "hints": m.hints,
        "provenance": m.provenance,
        "size": {"entries": entries, "file_bytes": file_bytes, "stored_bytes": stored},
    }


def group_report(group: LoadedGroup, ref: str) -> dict[str, Any]:
    """The JSON-able description of one group."""
    return {"ref": ref, "index": group.digest, **asdict(group_stats(group))}


def _stats_line(s: dict[str, Any]) -> str:
    return (
        f"files {s['files']}  dirs {s['dirs']}  symlinks {s['symlinks']}  other {s['other']}  "
        f"whiteouts {s['whiteouts']}  bytes {format_size(s['file_bytes'])}  "
        f"chunks {s['chunks']}  blobs {s['blobs']}  index {format_size(s['index_bytes'])}"
    )


def render_env(report: dict[str, Any]) -> Iterator[str]:
    """Human-readable lines of an environment report."""
    yield f"environment  {report['ref']}"
    yield f"manifest     {report['manifest']}"
    yield f"groups       {len(report['groups'])} (lowest first)"
    for g in report["groups"]:
        yield f"  {escape_name(g['name'].encode())}  index {short(g['index'])}"
        yield f"    {_stats_line(g)}"
    c = report["config"]
    yield "config"
    yield f"  cwd         {c['cwd']}"
    yield f"  user        {c['user'] or '(default)'}"
    yield f"  entrypoint  {_argv(c['entrypoint'])}"
    yield f"  cmd         {_argv(c['cmd'])}"
    for line in c["env"]:
        yield f"  env         {escape_name(line.encode())}"
    for key, value in sorted(c["labels"].items()):
        yield f"  label       {escape_name(key.encode())}={escape_name(value.encode())}"
    yield f"hints        {report['hints'] or 'none'}"
    yield "provenance" + ("" if report["provenance"] else "   none")
    for key, value in sorted(report["provenance"].items()):
        yield f"  {escape_name(str(key).encode())}: {escape_name(str(value).encode())}"
    size = report["size"]
    yield (
        f"size         {format_size(size['file_bytes'])} in {size['entries']} entries (composed), "
        f"{format_size(size['stored_bytes'])} stored (chunks and indexes, deduplicated)"
    )


def render_group(report: dict[str, Any]) -> Iterator[str]:
    """Human-readable lines of a group report."""
    yield f"group        {report['ref']}"
    yield f"index        {report['index']}"
    yield f"entries      {_stats_line(report)}"
    yield f"             opaque dirs {report['opaque_dirs']}  zero chunks {report['zero_chunks']}"
    yield (
        f"sizes        chunk size {format_size(report['chunk_size'])}, "
        f"chunk data {format_size(report['chunk_bytes'])} stored, index "
        f"{format_size(report['index_bytes'])} stored / {format_size(report['index_raw_bytes'])}"
    )


def _argv(argv: list[str]) -> str:
    return " ".join(escape_name(a.encode()) for a in argv) if argv else "(none)"


# -- entry listings -----------------------------------------------------------------------------


def _split(path: bytes) -> list[bytes]:
    return [p for p in path.split(b"/") if p not in (b"", b".")]


def env_entries(tree: ComposedTree, top: bytes = b"") -> Iterator[tuple[bytes, int, int]]:
    """(path, group, inode) of every composed entry at and below `top`, depth-first."""
    start = tree.resolve(top)
    if start is None:
        raise UsageError(f"no such path in the environment: /{escape_name(top)}")
    prefix = b"/".join(_split(top))
    stack: list[tuple[bytes, Entry]] = [(prefix, start)]
    seen: set[tuple[int, int]] = set()
    while stack:
        path, entry = stack.pop()
        yield path, entry.group, entry.inode
        if entry.is_dir:
            check_no_cycle(seen, entry)
            children = [(path + b"/" + n if path else n, e) for n, e in tree.entries(entry)]
            stack.extend(reversed(children))


def check_no_cycle(seen: set[tuple[int, int]], entry: Entry) -> None:
    """Refuse a directory layer met twice: a corrupt group whose cycle would never end."""
    if not seen.isdisjoint(entry.layers):
        raise FormatError(f"group {entry.group} inode {entry.inode}", "directory cycle")
    seen.update(entry.layers)


def group_entries(index: GroupIndex, top: bytes = b"") -> Iterator[tuple[bytes, int, int]]:
    """(path, 0, inode) of every entry of one group at and below `top` (whiteouts too)."""
    ino = index.resolve(top)
    if ino is None:
        raise UsageError(f"no such path in the group: /{escape_name(top)}")
    for path, child in index.walk(ino, b"/".join(_split(top))):
        yield path, 0, child


def _mtime(rec: Inode) -> str:
    try:
        when = datetime.datetime.fromtimestamp(rec.mtime_sec, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return f"@{rec.mtime_sec}.{rec.mtime_nsec:09d}"
    return when.strftime("%Y-%m-%d %H:%M:%S") + f".{rec.mtime_nsec:09d}"


def _size_column(rec: Inode) -> str:
    kind = stat.S_IFMT(rec.mode)
    if kind in (stat.S_IFCHR, stat.S_IFBLK) and not rec.whiteout:
        return f"{os.major(rec.rdev)},{os.minor(rec.rdev)}"
    return str(rec.size)


def format_entry(index: GroupIndex, ino: int, path: bytes, markers: bool = True) -> str:
    """One `ls -l` style line: type+mode, links, uid:gid, size, mtime (UTC), path, target;
    with `markers`, whiteouts and opaque directories are flagged (a group's own listing)."""
    rec = index.inode(ino)
    line = (
        f"{stat.filemode(rec.mode)} {rec.nlink:>3} {rec.uid}:{rec.gid} "
        f"{_size_column(rec):>10} {_mtime(rec)} /{escape_name(path)}"
    )
    if rec.is_lnk:
        line += f" -> {escape_name(index.readlink(ino))}"
    if markers and rec.whiteout:
        line += " (whiteout)"
    if markers and rec.opaque:
        line += " (opaque)"
    return line


def entry_json(index: GroupIndex, ino: int, path: bytes, group: int) -> dict[str, Any]:
    """One entry as a JSON-able dict (see the module docstring for how names are written)."""
    rec = index.inode(ino)
    obj: dict[str, Any] = {}
    json_name(obj, "path", b"/" + path)
    obj.update(
        type="whiteout" if rec.whiteout else _TYPE_NAMES[stat.S_IFMT(rec.mode)],
        mode=stat.S_IMODE(rec.mode),
        uid=rec.uid,
        gid=rec.gid,
        size=rec.size,
        mtime_ns=rec.mtime_ns,
        nlink=rec.nlink,
        group=group,
    )
    if rec.is_lnk:
        json_name(obj, "target", index.readlink(ino))
    if stat.S_IFMT(rec.mode) in (stat.S_IFCHR, stat.S_IFBLK) and not rec.whiteout:
        obj["rdev"] = [os.major(rec.rdev), os.minor(rec.rdev)]
    if rec.opaque:
        obj["opaque"] = True
    xattrs = index.xattrs(ino)
    if xattrs:
        obj["xattrs"] = [
            {"key": k.decode("utf-8", "surrogateescape"), "value_hex": v.hex()} for k, v in xattrs
        ]
    return obj


# -- entry points -------------------------------------------------------------------------------


def inspect_env(repo: Repository, ref: str) -> tuple[LoadedEnv, dict[str, Any]]:
    """Load and describe environment `ref`."""
    env = load_env(repo, ref)
    return env, env_report(env, ref)


def inspect_group(repo: Repository, ref: str) -> tuple[LoadedGroup, dict[str, Any]]:
    """Load and describe group `ref`."""
    group = load_group_ref(repo, ref)
    return group, group_report(group, ref)
