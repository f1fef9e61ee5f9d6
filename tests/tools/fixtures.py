"""Small stores for the read-side tool tests, encoded directly with the format codec.

Owns: turning a list of `tests.support.trees.Spec` entries (the same declarations the OCI
layer builder in tests/support/layers.py turns into tar members, so one list feeds both this
encoder and the reference applier) into a group index plus one blob, publishing groups and
environments into a store through `Repository`, and helpers to damage stored objects; and
running `weenv` in-process (`run_cli`) or in a subprocess with its own TMPDIR (`run_weenv`).

OCI markers are read as the builder would: a file named `.wh.NAME` becomes a whiteout of NAME
and `.wh..wh..opq` marks its directory opaque. Small files (under `batch_threshold`) share
one batch chunk; larger files are cut into `chunk_size` chunks, all-zero chunks become holes.

Must not: be used outside tests (it is a stand-in for tools/builder.py, not a builder).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.trees import DEFAULT_MTIME, Spec, with_parents

from weenvfs.format.chunk import encode_chunk
from weenvfs.format.digest import digest_bytes, digest_hex
from weenvfs.format.index_writer import ChunkRef, Node, encode_index_object
from weenvfs.format.manifest import GroupRef, Manifest, RuntimeConfig, encode_manifest
from weenvfs.format.refs import object_key
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository

CHUNK_SIZE = 64 << 10
BATCH_THRESHOLD = 4 << 10
WHITEOUT = b".wh."
OPAQUE = b".wh..wh..opq"

_KINDS = {
    "dir": stat.S_IFDIR,
    "reg": stat.S_IFREG,
    "sparse": stat.S_IFREG,
    "lnk": stat.S_IFLNK,
    "fifo": stat.S_IFIFO,
    "chr": stat.S_IFCHR,
    "blk": stat.S_IFBLK,
    "sock": stat.S_IFSOCK,  # not a trees.Spec kind: made with `socket()` below
}


@dataclass
class _Pending:
    """Chunks being collected for one blob; ChunkRefs are made once the blob is named."""

    frames: list[bytes] = field(default_factory=list)
    plains: list[bytes] = field(default_factory=list)
    uses: list[tuple[Node, int]] = field(default_factory=list)  # (node, chunk slot)
    batch: bytearray = field(default_factory=bytearray)
    batch_users: list[Node] = field(default_factory=list)

    def add(self, plain: bytes) -> int:
        self.plains.append(plain)
        self.frames.append(encode_chunk(plain))
        return len(self.plains) - 1


class GroupEncoder:
    """Encodes one group from Spec entries (lowest-level helper; see `publish_group`)."""

    def __init__(self, chunk_size: int = CHUNK_SIZE, batch_threshold: int = BATCH_THRESHOLD):
        self.chunk_size = chunk_size
        self.batch_threshold = batch_threshold
        self.root = Node(stat.S_IFDIR | 0o755, mtime_ns=DEFAULT_MTIME)
        self.nodes: dict[bytes, Node] = {b".": self.root}
        self._pending = _Pending()
        self._chunk_of: dict[tuple[int, int], int] = {}  # (id(node), slot) -> pending chunk
        self._zero: dict[tuple[int, int], int] = {}  # (id(node), slot) -> ulen of a hole

    def add(self, spec: Spec) -> None:
        """Add one entry (its parent must have been added: use `with_parents`)."""
        parent_path, _, name = spec.path.rpartition(b"/")
        parent = self.nodes[parent_path or b"."]
        if spec.path == b".":
            self._set_attrs(self.root, spec)
            return
        if name == OPAQUE:
            parent.opaque = True
            return
        if name.startswith(WHITEOUT):
            parent.children[name[len(WHITEOUT) :]] = Node(stat.S_IFCHR, whiteout=True)
            return
        if spec.kind == "hard":
            node = self.nodes[spec.target]
        else:
            node = Node(_KINDS[spec.kind] | (spec.mode & 0o7777))
            self._set_attrs(node, spec)
            self._fill(node, spec)
        parent.children[name] = node
        self.nodes[spec.path] = node

    def _set_attrs(self, node: Node, spec: Spec) -> None:
        node.mode = stat.S_IFMT(node.mode) | (spec.mode & 0o7777)
        node.uid, node.gid, node.mtime_ns = spec.uid, spec.gid, spec.mtime
        node.xattrs = dict(spec.xattrs)

    def _fill(self, node: Node, spec: Spec) -> None:
        if spec.kind == "lnk":
            node.target = spec.target
        elif spec.kind in ("chr", "blk"):
            node.rdev = spec.rdev
        elif spec.kind in ("reg", "sparse"):
            self._file(node, spec.content())

    def _file(self, node: Node, data: bytes) -> None:
        node.size = len(data)
        if not data:
            return
        pending = self._pending
        if len(data) < self.batch_threshold:
            node.inner_offset = len(pending.batch)
            node.file_digest = digest_bytes(data)
            pending.batch += data
            pending.batch_users.append(node)
            node.chunks = [None]  # type: ignore[list-item]  # filled in by finish()
            return
        slots = []
        for slot, start in enumerate(range(0, len(data), self.chunk_size)):
            piece = data[start : start + self.chunk_size]
            if piece.count(0) == len(piece):
                self._zero[(id(node), slot)] = len(piece)
            else:
                self._chunk_of[(id(node), slot)] = pending.add(piece)
            pending.uses.append((node, slot))
            slots.append(None)
        node.chunks = slots  # type: ignore[assignment]

    def finish(self, repo: Repository) -> tuple[str, str | None]:
        """Store the blob (if any) and the index; return (index digest, blob digest)."""
        pending = self._pending
        batch_chunk = pending.add(bytes(pending.batch)) if pending.batch else None
        blob_bytes = b"".join(pending.frames)
        blob = repo.put_object("blobs", blob_bytes) if blob_bytes else None
        refs, offset = [], 0
        for plain, frame in zip(pending.plains, pending.frames, strict=True):
            refs.append(ChunkRef(digest_bytes(plain), blob, offset, len(frame), len(plain)))
            offset += len(frame)
        for node, slot in pending.uses:
            key = (id(node), slot)
            if key in self._zero:
                ulen = self._zero[key]
                node.chunks[slot] = ChunkRef(digest_bytes(bytes(ulen)), None, 0, 0, ulen)
            else:
                node.chunks[slot] = refs[self._chunk_of[key]]
        for node in pending.batch_users:
            assert batch_chunk is not None
            node.chunks = [refs[batch_chunk]]
        index = repo.put_object("indexes", encode_index_object(self.root, self.chunk_size))
        return index, blob


def socket(path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Spec:
    """A unix socket entry (encoder only: make_tree and layer() cannot create one)."""
    return Spec("sock", path.encode(), mode, uid, gid)


def encode_group(
    repo: Repository, specs: Iterable[Spec], chunk_size: int = CHUNK_SIZE
) -> tuple[str, str | None]:
    """Store a group made of `specs` (parents added as needed); (index, blob) digests."""
    enc = GroupEncoder(chunk_size)
    for spec in with_parents(list(specs)):
        enc.add(spec)
    return enc.finish(repo)


def publish_group(repo: Repository, name: str, specs: Iterable[Spec], tag: str = "latest") -> str:
    """Encode and tag a group; returns its index digest."""
    index, _ = encode_group(repo, specs)
    repo.set_tag("groups", name, tag, index)
    return index


def publish_env(
    repo: Repository,
    name: str,
    groups: Sequence[tuple[str, Iterable[Spec]]],
    *,
    tag: str = "latest",
    config: RuntimeConfig | None = None,
    hints: str | None = None,
    provenance: dict[str, object] | None = None,
) -> str:
    """Publish groups (lowest first), a manifest and the env tag; returns the manifest digest."""
    refs = tuple(GroupRef(gname, publish_group(repo, gname, specs)) for gname, specs in groups)
    return put_manifest(
        repo, name, refs, tag=tag, config=config, hints=hints, provenance=provenance
    )


def put_manifest(
    repo: Repository,
    name: str | None,
    groups: Sequence[GroupRef],
    *,
    tag: str = "latest",
    config: RuntimeConfig | None = None,
    hints: str | None = None,
    provenance: dict[str, object] | None = None,
) -> str:
    """Store a manifest over existing indexes (tagging it `name:tag` unless name is None)."""
    manifest = Manifest(tuple(groups), config or RuntimeConfig(), hints, dict(provenance or {}))
    digest = repo.put_object("manifests", encode_manifest(manifest))
    if name is not None:
        repo.set_tag("envs", name, tag, digest)
    return digest


def object_path(store: LocalStore, kind: str, digest: str) -> Path:
    """The file holding an object of a local store."""
    return store.root / object_key(kind, digest)


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte of a file (the middle one by default)."""
    data = bytearray(path.read_bytes())
    pos = len(data) // 2 if offset is None else offset
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def age(path: Path, seconds: float) -> None:
    """Make a stored object look `seconds` old (for the gc grace period)."""
    st = os.stat(path)
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def all_objects(store: LocalStore) -> set[str]:
    """Every object and tag key in the store."""
    return set(store.list(""))


def digest_of(data: bytes) -> str:
    """Hex digest (re-exported for tests)."""
    return digest_hex(data)


# -- a standard environment and the CLI ----------------------------------------------------------

BAD_NAME = b"bad\xff\nname\x1b[31m"


def base_specs() -> list[Spec]:
    """A lower group with every kind of entry, a multi-chunk file, holes and odd names."""
    import random

    from support.trees import chardev, dir, fifo, file, hardlink, sparse, symlink

    rng = random.Random(7)
    return [
        dir(".", 0o755, mtime=1_700_000_000_000_000_001),
        dir("etc"),
        file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n"),
        file("etc/motd", b"base motd\n", xattrs={"user.note": b"\x00\xff"}),
        dir("bin"),
        file("bin/tool", rng.randbytes(3 * CHUNK_SIZE + 123), mode=0o4755),
        hardlink("bin/tool-link", "bin/tool"),
        sparse("sparse.img", 5 * CHUNK_SIZE, {0: b"head", 3 * CHUNK_SIZE + 5: b"mid"}),
        symlink("lib", "usr/lib"),
        dir("usr"),
        dir("usr/lib"),
        file("usr/lib/old.so", b"old library"),
        dir("dev"),
        chardev("dev/null", 1, 3),
        fifo("dev/fifo"),
        file(b"names/" + BAD_NAME, b"odd"),
    ]


def mid_specs() -> list[Spec]:
    """A middle group: hides /etc/passwd, makes /usr/lib opaque, replaces /etc/motd."""
    from support.layers import opaque, whiteout
    from support.trees import dir, file

    return [
        dir(".", 0o755, mtime=1_700_000_000_000_000_001),
        dir("etc"),
        whiteout("etc/passwd"),
        file("etc/motd", b"mid motd\n"),
        dir("usr"),
        dir("usr/lib"),
        opaque("usr/lib"),
        file("usr/lib/new.so", b"new library"),
    ]


def top_specs() -> list[Spec]:
    """The top group: an application and a whiteout of a whole directory."""
    from support.layers import whiteout
    from support.trees import dir, file

    return [
        dir(".", 0o755, mtime=1_700_000_000_000_000_001),
        dir("app", uid=1000, gid=1000),
        file("app/main.py", b"print('hi')\n", uid=1000, gid=1000),
        whiteout("dev"),
    ]


def standard_env(repo: Repository, name: str = "py-env") -> str:
    """Publish base, mid and top as environment `name`; returns the manifest digest."""
    return publish_env(
        repo,
        name,
        [("base", base_specs()), ("mid", mid_specs()), ("top", top_specs())],
        config=RuntimeConfig(env=("PATH=/usr/bin",), cwd="/app", cmd=("python3", "main.py")),
        provenance={"source": "fixtures"},
    )


def run_cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    """Run `weenv argv` in-process; (exit code, stdout, stderr)."""
    from weenvfs.cli import main

    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_weenv(tmpdir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`weenv ARGV` in a subprocess whose temp folder (TMPDIR) is `tmpdir`, so that what it
    stages (and leaves behind when killed) is the test's to find."""
    return subprocess.run([sys.executable, "-m", "weenvfs", *argv], capture_output=True,
                          text=True, env={**os.environ, "TMPDIR": str(tmpdir)}, timeout=300,
                          stdin=subprocess.DEVNULL)


def assert_one_line_error(code: int, err: str) -> str:
    """A failure printed as exactly one line, with a non-zero exit; returns the line."""
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("weenv: error:"), err
    return lines[0]
