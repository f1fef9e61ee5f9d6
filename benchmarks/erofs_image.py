#!/usr/bin/env python3
"""Benchmark the derived EROFS image writer (weenvfs.format.erofs.write_image) against mkfs.erofs.

Owns one measurement: the time to produce the EROFS metadata image of a synthetic tree of
1k, 10k and 100k inodes (directories of about 20 entries, regular files of 0..200 KiB in 1 MiB
chunks, a symlink and an xattr every 50 entries), for
- `write_image`: the pure-Python writer, from the in-memory inode list (what the node does at
  mount time; building the list is not timed);
- `mkfs.erofs` (erofs-utils, the peer): the same tree materialised once on tmpfs (sparse
  files), `mkfs.erofs -T0 --chunksize=1048576 --blobdev=BLOB IMAGE DIR`: chunk-based files on
  an extra device too, so both write metadata only (mkfs also reads the tree: that is its job).
Reported: the median time, its spread, and the ratio write_image / mkfs.erofs.

Must not: assert anything about the numbers, or leave files behind (tmpfs folder removed).

examples:
    python benchmarks/erofs_image.py --quick
    python benchmarks/erofs_image.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import (
    add_common_args,
    compile_project,
    describe_machine,
    measure_interleaved,
    paired_ratio,
    print_table,
    repeats_for,
    write_json,
)

from weenvfs.format.erofs import ErofsInode, write_image

NAME = "erofs_image"
FULL_REPEATS = 5
SIZES = (1_000, 10_000, 100_000)
QUICK_SIZES = (1_000, 10_000)
CHUNK_BITS = 8  # 1 MiB chunks
T0 = 1_700_000_000_000_000_000


def synthetic_tree(count: int) -> tuple[list[ErofsInode], int, list[tuple[bytes, str, int]]]:
    """(inodes, device blocks, [(path, kind, size)]) of a tree of `count` inodes."""
    ndirs = max(1, count // 20)
    files = count - 1 - ndirs
    per_dir: list[list[tuple[bytes, int]]] = [[] for _ in range(ndirs)]
    nodes: list[ErofsInode] = [ErofsInode(stat.S_IFDIR | 0o755, 0, 0, 2, T0)]
    listing: list[tuple[bytes, str, int]] = []
    block = 0
    for f in range(files):
        d = f % ndirs
        if f % 50 == 7:
            name = b"link-%06d" % f
            nodes.append(ErofsInode(stat.S_IFLNK | 0o777, 0, 0, 1, T0, target=b"../d%05d/x" % d))
            listing.append((b"d%05d/%s" % (d, name), "lnk", 0))
        else:
            name = b"module_%06d.py" % f
            size = (f * 7919) % 200_000
            count_chunks = -(-size // (4096 << CHUNK_BITS))
            chunks = tuple(range(block, block + count_chunks))
            block += count_chunks << CHUNK_BITS
            xattrs = ((b"user.origin", b"synthetic"),) if f % 50 == 3 else ()
            nodes.append(
                ErofsInode(
                    stat.S_IFREG | 0o644,
                    0,
                    0,
                    1,
                    T0 + f,
                    xattrs=xattrs,
                    size=size,
                    chunk_bits=CHUNK_BITS if size else 0,
                    chunks=chunks,
                )
            )
            listing.append((b"d%05d/%s" % (d, name), "reg", size))
        per_dir[d].append((name, len(nodes) - 1))
    first_dir = len(nodes)
    for d in range(ndirs):
        nodes.append(ErofsInode(stat.S_IFDIR | 0o755, 0, 0, 2, T0, entries=tuple(per_dir[d])))
    root_entries = tuple((b"d%05d" % d, first_dir + d) for d in range(ndirs))
    nodes[0] = ErofsInode(stat.S_IFDIR | 0o755, 0, 0, 2 + ndirs, T0, entries=root_entries)
    return nodes, block, listing


def materialise(root: Path, listing: list[tuple[bytes, str, int]]) -> None:
    """The tree on disk: sparse files of the right size, symlinks, directories."""
    for path, kind, size in listing:
        full = os.path.join(os.fsencode(root), path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if kind == "lnk":
            os.symlink(b"../x", full)
        else:
            with open(full, "wb") as f:
                f.truncate(size)


def run(sizes: tuple[int, ...], repeats: int, work: Path) -> list[dict[str, Any]]:
    results = []
    mkfs = shutil.which("mkfs.erofs")
    for count in sizes:
        nodes, blocks, listing = synthetic_tree(count)
        tree = work / f"tree-{count}"
        materialise(tree, listing)
        image = write_image(nodes, blocks)
        contenders = {"write_image": lambda n=nodes, b=blocks: write_image(n, b)}
        if mkfs:
            out, blob = work / "mkfs.img", work / "mkfs.blob"

            def peer(tree: Path = tree, out: Path = out, blob: Path = blob) -> None:
                for p in (out, blob):
                    p.unlink(missing_ok=True)
                subprocess.run(
                    [
                        mkfs,
                        "--quiet",
                        "-T0",
                        "--chunksize=1048576",
                        f"--blobdev={blob}",
                        str(out),
                        str(tree),
                    ],
                    check=True,
                    capture_output=True,
                )

            contenders["mkfs.erofs"] = peer
        timings = measure_interleaved(contenders, repeats)
        row: dict[str, Any] = {
            "inodes": len(nodes),
            "image_bytes": len(image),
            "write_image": timings["write_image"].as_dict(),
        }
        if "mkfs.erofs" in timings:
            row["mkfs.erofs"] = timings["mkfs.erofs"].as_dict()
            row["mkfs_image_bytes"] = (work / "mkfs.img").stat().st_size
            row["ratio"] = paired_ratio(timings["write_image"], timings["mkfs.erofs"])
        results.append(row)
        shutil.rmtree(tree)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("examples:")[1] and "examples:" + __doc__.split("examples:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser, FULL_REPEATS)
    args = parser.parse_args(argv)
    repeats = repeats_for(args, FULL_REPEATS)
    sizes = QUICK_SIZES if args.quick else SIZES
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix="weenv-bench-erofs-", dir=base))
    try:
        results = run(sizes, repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(
        f"EROFS metadata image, {repeats} repeats (median seconds, spread)",
        ["inodes", "image KiB", "write_image s", "spread", "mkfs.erofs s", "spread", "ratio"],
        [
            [
                r["inodes"],
                r["image_bytes"] // 1024,
                r["write_image"]["median_s"],
                r["write_image"]["spread"],
                r.get("mkfs.erofs", {}).get("median_s", "n/a"),
                r.get("mkfs.erofs", {}).get("spread", "n/a"),
                r.get("ratio", "n/a"),
            ]
            for r in results
        ],
    )
    path = write_json(NAME, args.out, {"repeats": repeats, "sizes": list(sizes)}, results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
