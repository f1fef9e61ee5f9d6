#!/usr/bin/env python3
"""Benchmark `weenv convert` against `skopeo copy` + `umoci unpack` of the same image.

Owns two measurements (issue 4):
1. Convert throughput: a one-layer gzip image of a sample root tree (the ~1.3 GB `reference`
   tree; `minbase` with --quick) is pushed to a local registry (Debian's docker-registry on
   127.0.0.1), then, per repeat and into fresh folders, `weenv convert docker://...` into a
   new local store is timed next to `skopeo copy docker://... oci:DIR` followed by
   `umoci unpack` (what a node does to get the same tree from the same registry). Reported
   as times and the ratio (competitor / weenv: above 1 means weenv is faster).
2. Sharing: image A = [base, task A] and image B = [base, task B] (the same base layer,
   different small task layers) are converted into one store, A first; reported are the
   bytes downloaded and uploaded for B, next to the sizes of B's layers.

Must not: assert anything about the numbers; it reports them (table on stdout, JSON file).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from _common import (
    Timing,
    add_common_args,
    compile_project,
    describe_machine,
    measure,
    print_table,
    ratio,
    repeats_for,
    write_json,
)

from weenvfs.tools.registry_server import RegistryServer
from weenvfs.tools.sample import sample_tree

NAME = "convert"
FULL_REPEATS = 3
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
WEENV = [sys.executable, "-m", "weenvfs"]


# -- images ---------------------------------------------------------------------------------------


def _blob(layout: Path, data_path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with open(data_path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    dest = layout / "blobs" / "sha256" / h.hexdigest()
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(data_path, dest)
    return "sha256:" + h.hexdigest(), dest.stat().st_size


def _put(layout: Path, data: bytes) -> tuple[str, int]:
    tmp = layout / "tmp-blob"
    tmp.write_bytes(data)
    return _blob(layout, tmp)


def _gzip_layer(layout: Path, tar_cmd: list[str] | None, tar_bytes: bytes | None) -> dict:
    """Compress a layer (from `tar_cmd`'s stdout or bytes) into the layout; its descriptor
    plus diff_id."""
    raw = layout / "tmp-layer"
    diff = hashlib.sha256()
    with (
        open(raw, "wb") as out,
        gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1, mtime=0) as gz,
    ):
        if tar_cmd is not None:
            proc = subprocess.Popen(tar_cmd, stdout=subprocess.PIPE)
            assert proc.stdout is not None
            while block := proc.stdout.read(1 << 20):
                diff.update(block)
                gz.write(block)
            if proc.wait() != 0:
                raise RuntimeError(f"{tar_cmd[0]} failed")
        else:
            assert tar_bytes is not None
            diff.update(tar_bytes)
            gz.write(tar_bytes)
    digest, size = _blob(layout, raw)
    return {
        "mediaType": LAYER_GZIP,
        "digest": digest,
        "size": size,
        "diff_id": "sha256:" + diff.hexdigest(),
    }


def write_image(layout: Path, layers: list[dict], tag: str) -> None:
    """An OCI layout `layout` holding an image of `layers` (descriptors with diff_id)."""
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [la["diff_id"] for la in layers]},
        }
    ).encode()
    cfg_digest, cfg_size = _put(layout, config)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": cfg_digest, "size": cfg_size},
            "layers": [{k: la[k] for k in ("mediaType", "digest", "size")} for la in layers],
        }
    ).encode()
    digest, size = _put(layout, manifest)
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": digest,
                "size": size,
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))


def tree_layer(layout: Path, tree: Path) -> dict:
    cmd = [
        "tar",
        "-C",
        str(tree),
        "--numeric-owner",
        "--xattrs",
        "--xattrs-include=*",
        "-cf",
        "-",
        ".",
    ]
    return _gzip_layer(layout, cmd, None)


def task_layer(layout: Path, seed: int, size: int) -> dict:
    """A synthetic task layer: a repository of ~`size` bytes of files, half compressible."""
    rng = random.Random(seed)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        written = 0
        for n in range(10_000):
            length = rng.randrange(100, 64_000)
            data = rng.randbytes(length // 2) + b"x" * (length - length // 2)
            info = tarfile.TarInfo(f"work/repo/src/f{n:05d}.py")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            written += len(data)
            if written >= size:
                break
    return _gzip_layer(layout, None, buf.getvalue())


# -- measurements ---------------------------------------------------------------------------------


def convert(ref: str, env: str, store: Path) -> dict[str, Any]:
    out = subprocess.run(
        [*WEENV, "convert", f"docker://{ref}", env, "--store", str(store), "--insecure", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def competitor(ref: str, work: Path) -> None:
    work.mkdir(parents=True)
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--src-tls-verify=false",
            f"docker://{ref}",
            f"oci:{work / 'oci'}:v1",
        ],
        check=True,
    )
    subprocess.run(
        ["umoci", "unpack", "--image", f"{work / 'oci'}:v1", str(work / "bundle")],
        check=True,
        capture_output=True,
    )


def fresh(work: Path, name: str) -> Path:
    path = work / name
    shutil.rmtree(path, ignore_errors=True)
    return path


def throughput(host: str, work: Path, repeats: int) -> dict[str, Any]:
    ref = f"{host}/bench:v1"
    weenv = measure(lambda: convert(ref, "bench", fresh(work, "store")), repeats)
    other = measure(lambda: competitor(ref, fresh(work, "competitor")), repeats)
    result = convert(ref, "bench", fresh(work, "store"))
    return {
        "weenv": weenv,
        "skopeo_umoci": other,
        "file_bytes": result["groups"][0]["bytes_in"],
        "blob_bytes": result["bytes_downloaded"],
    }


def sharing(registry: RegistryServer, layouts: Path, work: Path, base: dict,
            task_size: int) -> dict[str, Any]:
    host = registry.host
    store = fresh(work, "shared-store")
    sizes = {}
    for name, seed in (("a", 1), ("b", 2)):
        layout = layouts / f"task-{name}"
        if layout.exists():
            shutil.rmtree(layout)
        (layout / "blobs" / "sha256").mkdir(parents=True)
        base_blob = Path(layouts / "base" / "blobs" / "sha256" / base["digest"].split(":")[1])
        shutil.copy(base_blob, layout / "blobs" / "sha256" / base_blob.name)
        task = task_layer(layout, seed, task_size)
        write_image(layout, [base, task], "v1")
        registry.push(layout, "v1", f"task-{name}")
        sizes[name] = task["size"]
    convert(f"{host}/task-a:v1", "task-a", store)
    second = convert(f"{host}/task-b:v1", "task-b", store)
    return {
        "base_blob_bytes": base["size"],
        "task_b_blob_bytes": sizes["b"],
        "b_downloaded": second["bytes_downloaded"],
        "b_uploaded": second["bytes_uploaded"],
        "b_groups_reused": second["groups_reused"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, FULL_REPEATS)
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        metavar="DIR",
        help="scratch folder (default: a temporary one)",
    )
    args = parser.parse_args()
    repeats = repeats_for(args, FULL_REPEATS)
    profile = "minbase" if args.quick else "reference"
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    tree = sample_tree(None, profile)
    work = args.work or Path(tempfile.mkdtemp(prefix="weenv-bench-convert-"))
    try:
        layouts = work / "layouts"
        (layouts / "base").mkdir(parents=True, exist_ok=True)
        base = tree_layer(layouts / "base", tree)
        write_image(layouts / "base", [base], "v1")
        with RegistryServer(work / "registry") as registry:  # as `weenv dev registry` runs it
            registry.push(layouts / "base", "v1", "bench")
            speed = throughput(registry.host, work, repeats)
            shared = sharing(registry, layouts, work, base,
                             2_000_000 if args.quick else 20_000_000)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    w, o = speed["weenv"], speed["skopeo_umoci"]
    mb = speed["file_bytes"] / 1e6
    print_table(
        f"convert from a local registry: {profile} tree, {mb:,.0f} MB of files, "
        f"{speed['blob_bytes'] / 1e6:,.0f} MB gzip blob, {repeats} repeat(s)",
        ["what", "median s", "spread", "MB/s of files"],
        [
            ["weenv convert", w.median, w.spread, mb / w.median],
            ["skopeo copy + umoci unpack", o.median, o.spread, mb / o.median],
            ["ratio (competitor / weenv)", ratio(o.median, w.median), "", ""],
        ],
    )
    print_table(
        "second image sharing the base layer (A converted first, then B)",
        ["what", "bytes"],
        [[k, v] for k, v in shared.items()],
    )
    results = {
        "throughput": {k: v.as_dict() if isinstance(v, Timing) else v for k, v in speed.items()},
        "ratio": ratio(o.median, w.median),
        "sharing": shared,
    }
    path = write_json(NAME, args.out, {"profile": profile, "repeats": repeats}, results)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
