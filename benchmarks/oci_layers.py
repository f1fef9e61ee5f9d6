"""Layer tars in OCI format, made from root trees, and OCI image layouts made of them.

Owns, for the cold-start benchmark (benchmarks/workloads.py builds the trees):
- `tree_diff(old, new)`: what a layer must hold to turn tree `old` into tree `new` (changed or
  new entries with their parent directories, and whiteouts for what `new` removed), found by
  comparing `lstat` results (type, mode, owner, size, mtime, link target, device numbers);
- `write_layer(...)`: that difference as an uncompressed tar with GNU tar (hardlinks, xattrs,
  numeric owners, nanosecond mtimes in PAX headers, no atime/ctime), OCI whiteouts
  (`.wh.NAME`) appended; its sha256 is the layer's diff_id;
- `gzip_layer(...)`: the Docker distribution form of a layer (`gzip -n -6`);
- `write_oci_layout(...)`: an OCI image layout holding several images that share layers, each
  named by an `org.opencontainers.image.ref.name` annotation, ready for
  `skopeo copy oci:DIR:NAME docker://...`.
One layer tar is the single source of both peers: `weenv build LAYER.tar` makes the WeEnv
group and the gzip of the same bytes is the Docker layer, so both serve exactly one tree.

Must not: know the workload (which trees, which images) or talk to a registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
REF_ANNOTATION = "org.opencontainers.image.ref.name"
_BUF = 1 << 20


@dataclass(frozen=True)
class Diff:
    """Paths (relative, no leading '/') a layer holds, and the paths it whites out."""

    paths: tuple[str, ...]
    whiteouts: tuple[str, ...]


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _same(old: Path, new: Path, a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two non-directory entries are the same as far as an image is concerned."""
    if stat.S_IFMT(a.st_mode) != stat.S_IFMT(b.st_mode):
        return False
    if (a.st_mode, a.st_uid, a.st_gid) != (b.st_mode, b.st_uid, b.st_gid):
        return False
    if stat.S_ISLNK(b.st_mode):
        return os.readlink(old) == os.readlink(new)
    if stat.S_ISCHR(b.st_mode) or stat.S_ISBLK(b.st_mode):
        return a.st_rdev == b.st_rdev
    # Regular files: a copy (`cp -a`) keeps size and mtime; apt and dpkg rewrite a file they
    # change, so a changed file has a new mtime.
    return a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns


def _dir_meta(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns


def tree_diff(old: Path, new: Path) -> Diff:
    """The layer that turns `old` into `new` (see the module docstring); the root itself is
    never part of it."""
    paths: set[str] = set()
    whiteouts: list[str] = []

    def add_subtree(rel: str) -> None:
        paths.add(rel)
        full = new / rel
        if full.is_dir() and not full.is_symlink():
            for dirpath, dirs, files in os.walk(full):
                base = os.path.relpath(dirpath, new)
                paths.update(_join(base, n) for n in dirs + files)

    def walk(rel: str) -> None:
        new_names = sorted(os.listdir(new / rel))
        old_names = set(os.listdir(old / rel))
        whiteouts.extend(_join(rel, n) for n in sorted(old_names - set(new_names)))
        for name in new_names:
            r = _join(rel, name)
            b = os.lstat(new / r)
            if name not in old_names:
                add_subtree(r)
                continue
            a = os.lstat(old / r)
            if stat.S_ISDIR(b.st_mode) and stat.S_ISDIR(a.st_mode):
                if _dir_meta(a) != _dir_meta(b):
                    paths.add(r)
                walk(r)
            elif stat.S_ISDIR(b.st_mode):
                add_subtree(r)  # a directory where old had a file: the whole directory
            elif not _same(old / r, new / r, a, b):
                paths.add(r)  # a file over a lower directory hides it entirely (OCI)

    walk("")
    for rel in list(paths) + whiteouts:  # every parent directory, with new's metadata
        parent = os.path.dirname(rel)
        while parent:
            paths.add(parent)
            parent = os.path.dirname(parent)
    return Diff(tuple(sorted(paths, key=lambda p: p.split("/"))), tuple(whiteouts))


def subtree(root: Path) -> Diff:
    """Every entry below `root` (a layer that adds the whole tree)."""
    paths = []
    for dirpath, dirs, files in os.walk(root):
        base = os.path.relpath(dirpath, root)
        base = "" if base == "." else base
        paths.extend(_join(base, n) for n in dirs + files)
    return Diff(tuple(sorted(paths, key=lambda p: p.split("/"))), ())


def _tar(argv: list[str], listing: list[str], directory: Path, tmp: Path) -> None:
    """GNU tar with a NUL-separated list of entries (no recursion) taken from `directory`."""
    lst = tmp / "list"
    lst.write_bytes(b"".join(os.fsencode("./" + p) + b"\0" for p in listing))
    subprocess.run(
        ["tar", *argv, f"--directory={directory}", "--no-recursion", "--numeric-owner",
         "--xattrs", "--xattrs-include=*", "--format=pax",
         "--pax-option=delete=atime,delete=ctime", "--null", f"--files-from={lst}"],
        check=True, capture_output=True,
    )


def write_layer(tree: Path, diff: Diff, out: Path) -> tuple[str, int]:
    """Write `diff` (entries of `tree`, then whiteouts) as the tar `out`; return
    (diff_id 'sha256:...', size in bytes). Written to a temp name, renamed when complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    with tempfile.TemporaryDirectory(prefix="layer-", dir=out.parent) as tmp_name:
        tmp = Path(tmp_name)
        _tar(["--create", f"--file={part}"], list(diff.paths), tree, tmp)
        if diff.whiteouts:
            wh_root = tmp / "wh"
            names = []
            for rel in diff.whiteouts:
                parent, name = os.path.split(rel)
                (wh_root / parent).mkdir(parents=True, exist_ok=True)
                marker = wh_root / parent / f".wh.{name}"
                marker.touch()
                os.utime(marker, ns=(0, 0))
                names.append(_join(parent, f".wh.{name}"))
            _tar(["--append", f"--file={part}"], names, wh_root, tmp)
    digest = file_sha256(part)
    size = part.stat().st_size
    part.rename(out)
    return f"sha256:{digest}", size


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BUF):
            h.update(block)
    return h.hexdigest()


def gzip_layer(tar: Path, out: Path) -> tuple[str, int]:
    """`gzip -n -6` of `tar` into `out`; return ('sha256:...', size) of the compressed blob."""
    part = out.with_name(out.name + ".part")
    with open(part, "wb") as f:
        subprocess.run(["gzip", "-n", "-6", "-c", str(tar)], stdout=f, check=True)
    digest, size = file_sha256(part), part.stat().st_size
    part.rename(out)
    return f"sha256:{digest}", size


@dataclass(frozen=True)
class Blob:
    """A compressed layer of an image: its gzip file, digest and size, and its diff_id."""

    path: Path
    digest: str
    size: int
    diff_id: str


def _put_json(layout: Path, doc: dict[str, Any]) -> tuple[str, int]:
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def _put_blob(layout: Path, blob: Blob) -> None:
    target = layout / "blobs" / "sha256" / blob.digest.removeprefix("sha256:")
    if not target.exists():
        try:
            os.link(blob.path, target)  # the gzip files are immutable: share them
        except OSError:
            shutil.copyfile(blob.path, target)


def write_oci_layout(
    layout: Path, images: dict[str, list[Blob]], env: list[str], cmd: list[str]
) -> None:
    """An OCI image layout at `layout` (replaced) holding every image of `images` (name ->
    layers, lowest first), each with the runtime config `env` and `cmd`."""
    shutil.rmtree(layout, ignore_errors=True)
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    manifests = []
    for name, blobs in images.items():
        for blob in blobs:
            _put_blob(layout, blob)
        config = {
            "architecture": "amd64", "os": "linux",
            "config": {"Env": env, "Cmd": cmd, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [b.diff_id for b in blobs]},
            "history": [{"created_by": f"benchmarks/workloads.py layer {i}"}
                        for i in range(len(blobs))],
        }
        config_digest, config_size = _put_json(layout, config)
        manifest = {
            "schemaVersion": 2, "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": config_size},
            "layers": [{"mediaType": MEDIA_LAYER_GZIP, "digest": b.digest, "size": b.size}
                       for b in blobs],
        }
        digest, size = _put_json(layout, manifest)
        manifests.append({"mediaType": MEDIA_MANIFEST, "digest": digest, "size": size,
                          "annotations": {REF_ANNOTATION: name}})
    index = {"schemaVersion": 2, "manifests": manifests}
    (layout / "index.json").write_text(json.dumps(index, indent=1))
