"""OCI image layouts written by the tests, and the multi-layer images `weenv convert` is proven on.

Owns: `write_layout` (an OCI image layout directory: blobs, a manifest, a config with the
layers' diff_ids, an index.json entry annotated with the tag, as skopeo and umoci expect),
`write_index_layout` (a multi-platform image: an image index over several manifests),
`Image` (what was written: digests and the layers), `docker_save_archive` (the tar that
`docker save` of Docker 25+ writes: the layout plus a manifest.json), and `union_layers()`,
the layer stack the conversion tests compare against `umoci unpack`.

Must not: use WeEnv code (the layouts are independent input), or run skopeo/umoci (the tests
do that).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import layers as L

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = LAYER_TAR + "+gzip"
LAYER_ZSTD = LAYER_TAR + "+zstd"
_COMPRESS = {LAYER_TAR: lambda b: b, LAYER_GZIP: L.gzip, LAYER_ZSTD: L.zstd}

DEFAULT_CONFIG: dict[str, Any] = {
    "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
    "WorkingDir": "/work",
    "User": "1000:1000",
    "Entrypoint": ["/bin/sh", "-c"],
    "Cmd": ["echo hello"],
    "Labels": {"org.example.task": "1234", "maintainer": "tests"},
}


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Image:
    """An image written into a layout."""

    layout: Path
    tag: str
    manifest_digest: str
    config_digest: str
    layer_digests: list[str]
    diff_ids: list[str]
    tars: list[bytes] = field(repr=False)  # the uncompressed layers, lowest first


def put_blob(layout: Path, data: bytes) -> str:
    """Store `data` under blobs/sha256/ of `layout`; return its digest."""
    digest = sha256(data)
    path = layout / "blobs" / "sha256" / digest.split(":")[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def _init(layout: Path) -> dict[str, Any]:
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    index_path = layout / "index.json"
    if index_path.exists():
        return json.loads(index_path.read_text())
    return {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}


def image_manifest(
    layout: Path,
    tars: list[bytes],
    media_types: list[str] | None = None,
    config: dict[str, Any] | None = None,
    arch: str = "amd64",
) -> tuple[bytes, str, list[str], list[str]]:
    """Store the layers and the config; return (manifest bytes, config digest, layer
    digests, diff_ids)."""
    media_types = media_types or [LAYER_GZIP] * len(tars)
    descriptors, digests, diff_ids = [], [], []
    for tar, media_type in zip(tars, media_types, strict=True):
        blob = _COMPRESS[media_type](tar)
        digest = put_blob(layout, blob)
        digests.append(digest)
        diff_ids.append(sha256(tar))
        descriptors.append({"mediaType": media_type, "digest": digest, "size": len(blob)})
    cfg = {
        "architecture": arch,
        "os": "linux",
        "config": DEFAULT_CONFIG if config is None else config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created_by": f"layer {i}"} for i in range(len(tars))],
    }
    cfg_bytes = json.dumps(cfg, indent=1).encode()
    cfg_digest = put_blob(layout, cfg_bytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg_digest, "size": len(cfg_bytes)},
        "layers": descriptors,
    }
    return json.dumps(manifest, indent=1).encode(), cfg_digest, digests, diff_ids


def _add_ref(index: dict[str, Any], descriptor: dict[str, Any], tag: str) -> None:
    refs = index["manifests"]
    refs[:] = [
        d for d in refs if d.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag
    ]
    refs.append({**descriptor, "annotations": {"org.opencontainers.image.ref.name": tag}})


def write_layout(
    layout: Path,
    tars: list[bytes],
    *,
    tag: str = "latest",
    media_types: list[str] | None = None,
    config: dict[str, Any] | None = None,
) -> Image:
    """Write (or add to) an OCI layout holding an image of `tars` (uncompressed, lowest
    first, compressed per `media_types`, gzip by default) tagged `tag`."""
    index = _init(layout)
    manifest, cfg_digest, digests, diff_ids = image_manifest(layout, tars, media_types, config)
    digest = put_blob(layout, manifest)
    _add_ref(index, {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(manifest)}, tag)
    (layout / "index.json").write_text(json.dumps(index, indent=1))
    return Image(layout, tag, digest, cfg_digest, digests, diff_ids, list(tars))


def write_index_layout(
    layout: Path, per_arch: dict[str, list[bytes]], *, tag: str = "latest"
) -> tuple[str, dict[str, Image]]:
    """A multi-platform image: an image index over one manifest per architecture. Returns
    the index digest and the image of each architecture."""
    index = _init(layout)
    entries, images = [], {}
    for arch, tars in per_arch.items():
        manifest, cfg_digest, digests, diff_ids = image_manifest(layout, tars, arch=arch)
        digest = put_blob(layout, manifest)
        entries.append(
            {
                "mediaType": OCI_MANIFEST,
                "digest": digest,
                "size": len(manifest),
                "platform": {"architecture": arch, "os": "linux"},
            }
        )
        images[arch] = Image(layout, tag, digest, cfg_digest, digests, diff_ids, list(tars))
    image_index = json.dumps(
        {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}, indent=1
    ).encode()
    index_digest = put_blob(layout, image_index)
    _add_ref(index, {"mediaType": OCI_INDEX, "digest": index_digest, "size": len(image_index)}, tag)
    (layout / "index.json").write_text(json.dumps(index, indent=1))
    return index_digest, images


def rewrite_manifest(image: Image, change: Any) -> Image:
    """Apply `change(manifest_dict)` to the image's manifest, store it and retarget the tag."""
    path = image.layout / "blobs" / "sha256" / image.manifest_digest.split(":")[1]
    manifest = json.loads(path.read_bytes())
    change(manifest)
    data = json.dumps(manifest, indent=1).encode()
    digest = put_blob(image.layout, data)
    index = json.loads((image.layout / "index.json").read_text())
    _add_ref(index, {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(data)}, image.tag)
    (image.layout / "index.json").write_text(json.dumps(index, indent=1))
    return Image(
        image.layout,
        image.tag,
        digest,
        image.config_digest,
        image.layer_digests,
        image.diff_ids,
        image.tars,
    )


def blob_path(image: Image, digest: str) -> Path:
    return image.layout / "blobs" / "sha256" / digest.split(":")[1]


# --- the layer stacks ---------------------------------------------------------------------

T0 = 1_600_000_000_000_000_000


def union_layers() -> list[bytes]:
    """Six layers exercising OCI union semantics: whiteouts, opaque dirs, hardlinks within
    and across layers, set-id files, symlinks, a deleted-then-recreated directory, xattrs,
    devices, and a large file."""
    big = bytes(range(256)) * 8192 + b"tail"  # 2 MiB + 4: several chunks
    base = L.layer(
        *L.with_parents(
            [
                L.dir(".", 0o755, mtime=T0),
                L.dir("etc", mtime=T0 + 1),
                L.file("etc/os-release", b"ID=test\n", mtime=T0 + 2),
                L.file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n", mtime=T0 + 3),
                L.dir("bin", mtime=T0 + 4),
                L.file("bin/sh", b"\x7fELF shell", mode=0o755, mtime=T0 + 5),
                L.file("bin/su", b"\x7fELF su", mode=0o4755, mtime=T0 + 6),
                L.file("bin/wall", b"\x7fELF wall", mode=0o2755, gid=5, mtime=T0 + 7),
                L.hardlink("bin/sh-link", "bin/sh"),
                L.symlink("bin/bash", "sh", mtime=T0 + 8),
                L.symlink("lib64", "/usr/lib", mtime=T0 + 9),
                L.dir("usr/lib", mtime=T0 + 10),
                L.file("usr/lib/libc.so", big, mtime=T0 + 11),
                L.dir("tmp", mode=0o1777, mtime=T0 + 12),
                L.dir("var/cache/apt", mtime=T0 + 13),
                L.file("var/cache/apt/pkgcache.bin", b"cache" * 100, mtime=T0 + 14),
                L.file("var/cache/apt/srcpkgcache.bin", b"src" * 100, mtime=T0 + 15),
                L.dir("opt/old", mtime=T0 + 16),
                L.file("opt/old/file", b"old", mtime=T0 + 17),
                L.dir("dev", mtime=T0 + 18),
                L.chardev("dev/null", 1, 3, mtime=T0 + 19),
                L.fifo("dev/initctl", mode=0o600, mtime=T0 + 20),
                L.file("data.txt", b"base version\n", mtime=T0 + 21),
                L.file(
                    "cap-bin",
                    b"\x7fELF cap",
                    mode=0o755,
                    xattrs={"security.capability": b"\x01\x00\x00\x02" + bytes(16)},
                    mtime=T0 + 22,
                ),
                L.file("hard-a", b"shared inode\n", mode=0o640, uid=1000, gid=1000, mtime=T0 + 23),
                L.hardlink("hard-b", "hard-a"),
            ]
        )
    )
    python = L.layer(
        L.dir("usr", mtime=T0 + 100),
        L.dir("usr/lib", mtime=T0 + 101),
        L.dir("usr/lib/python3", mtime=T0 + 102),
        L.file("usr/lib/python3/os.py", b"import sys\n" * 50, mtime=T0 + 103),
        L.file(
            "usr/lib/python3/xattr.py",
            b"x",
            xattrs={"user.origin": b"python layer", "trusted.md5": b"\x00\x01"},
            mtime=T0 + 104,
        ),
        L.dir("etc", mtime=T0 + 105),
        L.file("etc/os-release", b"ID=test\nVERSION=2\n", mtime=T0 + 106),
        L.dir("var", mtime=T0 + 107),
        L.dir("var/cache", mtime=T0 + 108),
        L.dir("var/cache/apt", mtime=T0 + 109),
        L.whiteout("var/cache/apt/pkgcache.bin"),
        L.dir("opt", mtime=T0 + 110),
        L.whiteout("opt/old"),
    )
    tools = L.layer(
        L.dir("var", mtime=T0 + 200),
        L.dir("var/cache", mtime=T0 + 201),
        L.dir("var/cache/apt", mode=0o700, mtime=T0 + 202),
        L.opaque("var/cache/apt"),
        L.file("var/cache/apt/new.bin", b"fresh", mtime=T0 + 203),
        L.dir("opt", mtime=T0 + 204),
        L.dir("opt/old", mode=0o750, uid=7, mtime=T0 + 205),  # deleted below, recreated here
        L.file("opt/old/new", b"recreated", mtime=T0 + 206),
        L.file("hard-c", b"shared inode\n", mode=0o600, mtime=T0 + 207),
        L.hardlink("hard-d", "hard-c"),
        L.dir("bin", mtime=T0 + 208),
        L.whiteout("bin/wall"),
        L.file("bin/newsu", b"\x7fELF newsu", mode=0o6755, uid=0, gid=0, mtime=T0 + 209),
    )
    replace = L.layer(
        L.dir("etc", mtime=T0 + 300),
        L.dir("etc/os-release", mtime=T0 + 301),  # a file replaced by a directory
        L.file("etc/os-release/inner", b"dir now", mtime=T0 + 302),
        L.file("data.txt", b"task version\n", mode=0o600, mtime=T0 + 303),
        L.dir("usr", mtime=T0 + 304),
        L.file("usr/lib", b"a directory replaced by a file", mtime=T0 + 305),
        L.symlink("tmp-link", "/tmp", mtime=T0 + 306),
    )
    # A hardlink to a file of a lower layer (links across layers), and a recreated whiteout.
    across = L.layer(
        L.dir("bin", mtime=T0 + 400),
        L.hardlink("bin/sh-third", "bin/sh"),
        L.dir("var", mtime=T0 + 401),
        L.dir("var/cache", mtime=T0 + 402),
        L.dir("var/cache/apt", mode=0o755, mtime=T0 + 403),
        L.file("var/cache/apt/pkgcache.bin", b"came back", mtime=T0 + 404),
    )
    task = L.layer(
        L.dir("work", uid=1000, gid=1000, mtime=T0 + 500),
        L.file("work/task.py", b"print('task')\n", uid=1000, gid=1000, mtime=T0 + 501),
        L.file("work/.hidden", b"h", mtime=T0 + 502),
        L.dir("work/empty", mtime=T0 + 503),
        L.file(b"work/\xff-latin", b"bytes name", mtime=T0 + 504),
    )
    return [base, python, tools, replace, across, task]


def docker_save_archive(image: Image, dest: Path, repo_tag: str = "app:latest") -> Path:
    """The archive `docker save` (Docker 25+) would write for `image`: its OCI layout, with
    the index annotated with the image name, plus a legacy manifest.json pointing into blobs/."""
    layout = image.layout
    index = json.loads((layout / "index.json").read_text())
    for d in index["manifests"]:
        d.setdefault("annotations", {})["io.containerd.image.name"] = (
            "docker.io/library/" + repo_tag
        )
    legacy = [
        {
            "Config": "blobs/sha256/" + image.config_digest.split(":")[1],
            "RepoTags": [repo_tag],
            "Layers": ["blobs/sha256/" + d.split(":")[1] for d in image.layer_digests],
        }
    ]
    with tarfile.open(dest, "w") as tar:
        for path in sorted(layout.rglob("*")):
            rel = path.relative_to(layout).as_posix()
            if path.is_file() and rel != "index.json":
                tar.add(path, rel)
        for name, obj in (("index.json", index), ("manifest.json", legacy)):
            data = json.dumps(obj).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest
