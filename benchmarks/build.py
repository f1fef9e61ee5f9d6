#!/usr/bin/env python3
"""Benchmark `weenv build` and the group index, each next to a competitor in the same run.

Owns three measurements (issue 2; results summarized in docs/benchmarks.md):
1. Build throughput: `build_group` in-process into a fresh local store per repeat, against
   `tar -C TREE -cf - . | zstd -3 -T0 -o FILE` of the same tree, page cache warm for both;
   then a no-change rebuild into the same store (everything deduplicated against the
   previous version). Also the stored size against the .tar.zst size.
2. Index size per entry, of the real trees built in 1 and of a synthetic group.
3. A synthetic group of `--entries` small files (default 100k; the index is encoded directly
   with weenvfs.format.index_writer, with fake batch-chunk references, since only the index
   is measured): decompress + open (`GroupIndex.from_object`) against unpickling a
   {path: inode} dict, and random lookups by path (`resolve`) and by (directory inode, name)
   (`lookup`) against the same lookups in Python dicts.

Must not: assert anything about the numbers; it reports them (table on stdout, JSON file).
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import (
    Timing,
    add_common_args,
    compile_project,
    describe_machine,
    measure_interleaved,
    paired_ratio,
    print_table,
    ratio,
    repeats_for,
    timed,
    write_json,
)

from weenvfs.format import constants as C
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import ChunkRef, Node, encode_index_object
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, BuildResult, build_group, open_source
from weenvfs.tools.sample import sample_tree

NAME = "build"
FULL_REPEATS = 3
FULL_PROFILES = ("python", "reference")
QUICK_PROFILES = ("minbase",)
TAR_ZSTD = "tar -C {tree} -cf - . | zstd -3 -T0 -q -f -o {out}"
MB = 1e6  # throughputs are in MB/s (10^6 bytes of file data per second)

EXAMPLES = """\
examples:
  # full run (3 repeats on the 'python' and 'reference' sample trees, 100k-entry index)
  .venv/bin/python benchmarks/build.py
  # smoke run: 1 repeat on the 'minbase' tree
  .venv/bin/python benchmarks/build.py --quick
  # your own tree, only the build part, results into /tmp/bench
  .venv/bin/python benchmarks/build.py --tree /srv/rootfs --only build --out /tmp/bench
"""


# -- 1. build throughput ------------------------------------------------------------------


def warm_page_cache(tree: Path) -> tuple[int, int]:
    """Read every regular file under `tree` once (so both contenders start warm);
    return (file count, total bytes)."""
    files = total = 0
    buf = bytearray(1 << 20)
    for dirpath, _dirs, names in os.walk(os.fsencode(tree)):
        for name in names:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            files += 1
            total += st.st_size
    return files, total


def weenv_build(tree: Path, store_dir: Path, work: Path) -> BuildResult:
    """One `weenv build TREE --store STORE --group bench:latest`, in-process."""
    repo = Repository(open_store(str(store_dir), create=True))
    try:
        return build_group(open_source(tree), repo, "bench", "latest", BuildOptions(tmp_dir=work))
    finally:
        repo.store.close()


def tar_zstd(tree: Path, out: Path) -> None:
    """The competitor: `tar | zstd -3 -T0` of the same tree into `out`."""
    cmd = TAR_ZSTD.format(tree=shlex.quote(str(tree)), out=shlex.quote(str(out)))
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], stderr=subprocess.PIPE, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"build.py: {cmd!r} failed ({done.returncode}): {done.stderr.strip()}")


def _index_sizes(store_dir: Path, digest: str, stored: int) -> dict[str, Any]:
    repo = Repository(open_store(str(store_dir)))
    try:
        index = repo.get_index(digest)
    finally:
        repo.store.close()
    return _size_row(index.inode_count, stored, len(index.raw))


def _size_row(entries: int, compressed: int, raw: int) -> dict[str, Any]:
    return {
        "entries": entries,
        "compressed_bytes": compressed,
        "raw_bytes": raw,
        "compressed_per_entry": compressed / entries,
        "raw_per_entry": raw / entries,
    }


def bench_tree(tree: Path, repeats: int, work: Path) -> dict[str, Any]:
    """Build `tree` with weenv and with tar|zstd `repeats` times each, interleaved."""
    files, size = warm_page_cache(tree)
    build_s: list[float] = []
    rebuild_s: list[float] = []
    tar_s: list[float] = []
    facts: dict[str, Any] = {}

    def run_weenv(r: int) -> None:
        store = work / f"store-{r}"
        seconds, result = timed(lambda: weenv_build(tree, store, work))
        again_s, again = timed(lambda: weenv_build(tree, store, work))
        build_s.append(seconds)
        rebuild_s.append(again_s)
        if r == 0:
            facts["index"] = _index_sizes(store, result.index_digest, result.index_size)
            facts["stored_bytes"] = result.bytes_uploaded + result.index_size
            facts["build_result"] = result.as_dict()
            facts["rebuild_bytes_uploaded"] = again.bytes_uploaded
        shutil.rmtree(store)

    def run_tar(r: int) -> None:
        out = work / f"tree-{r}.tar.zst"
        tar_s.append(timed(lambda: tar_zstd(tree, out))[0])
        facts["tar_zstd_bytes"] = out.stat().st_size
        out.unlink()

    for r in range(repeats):
        # Alternate who goes first, so slow drift in the machine's load hits both alike.
        for step in (run_weenv, run_tar) if r % 2 == 0 else (run_tar, run_weenv):
            step(r)
    build, rebuild, tar = Timing(tuple(build_s)), Timing(tuple(rebuild_s)), Timing(tuple(tar_s))
    return {
        "tree": str(tree),
        "files": files,
        "bytes": size,
        "weenv_build": build.as_dict(),
        "weenv_mb_per_s": size / build.median / MB,
        "tar_zstd": tar.as_dict(),
        "tar_zstd_mb_per_s": size / tar.median / MB,
        "time_ratio_weenv_over_tar": paired_ratio(build, tar),
        "rebuild_no_change": rebuild.as_dict(),
        "rebuild_over_build": paired_ratio(rebuild, build),
        "size_ratio_stored_over_tar_zstd": ratio(facts["stored_bytes"], facts["tar_zstd_bytes"]),
        **facts,
    }


# -- 2./3. the index of a synthetic group ---------------------------------------------------

FILES_PER_DIR = 100
DIRS_PER_PACKAGE = 50
STEMS = (b"__init__", b"core", b"utils", b"test_api", b"config", b"base", b"_internal", b"io")
EXTS = (b".py", b".pyc", b".h", b".so.1", b".txt", b".json", b".mo", b"")
MTIME_NS = 1_700_000_000 * 10**9


class _Batcher:
    """Packs small files into fake batch chunks the way the builder does (a batch closes
    before it would pass the chunk size), with random digests and a plausible clen."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.blob = rng.randbytes(32).hex()
        self.blob_offset = self.used = 0
        self.pending: list[Node] = []

    def add(self, node: Node) -> None:
        if self.used + node.size > C.DEFAULT_CHUNK_SIZE:
            self.close()
        node.inner_offset = self.used
        self.used += node.size
        self.pending.append(node)

    def close(self) -> None:
        if not self.pending:
            return
        clen = self.used * 2 // 5  # about what zstd -3 makes of a batch of small files
        ref = ChunkRef(self.rng.randbytes(32), self.blob, self.blob_offset, clen, self.used)
        for node in self.pending:
            node.chunks = [ref]
        self.blob_offset += clen
        self.used, self.pending = 0, []


def _dir() -> Node:
    return Node(mode=stat.S_IFDIR | 0o755, mtime_ns=MTIME_NS)


def synthetic_tree(entries: int, seed: int = 2) -> tuple[Node, list[bytes]]:
    """`entries` small files, 100 per directory under usr/lib/pkgNN/modNNNN/ (50 such
    directories per package), each a slice of a batch chunk with its own file digest, as the
    builder makes them. Returns the root and the files' paths."""
    rng = random.Random(seed)
    root, batcher, paths = _dir(), _Batcher(rng), []
    lib = root.children.setdefault(b"usr", _dir()).children.setdefault(b"lib", _dir())
    for d in range(-(-entries // FILES_PER_DIR)):
        package = lib.children.setdefault(b"pkg%02d" % (d // DIRS_PER_PACKAGE), _dir())
        parent = package.children[b"mod%04d" % d] = _dir()
        prefix = b"usr/lib/pkg%02d/mod%04d/" % (d // DIRS_PER_PACKAGE, d)
        for f in range(min(FILES_PER_DIR, entries - d * FILES_PER_DIR)):
            name = b"%s_%03d%s" % (rng.choice(STEMS), f, rng.choice(EXTS))
            size = 1 + int(rng.lognormvariate(7.5, 1.2)) % (C.DEFAULT_BATCH_THRESHOLD - 1)
            node = Node(mode=stat.S_IFREG | 0o644, mtime_ns=MTIME_NS, size=size)
            node.file_digest = rng.randbytes(32)
            batcher.add(node)
            parent.children[name] = node
            paths.append(prefix + name)
    batcher.close()
    return root, paths


def _resolve_all(index: GroupIndex, paths: list[bytes]) -> None:
    resolve = index.resolve
    for path in paths:
        resolve(path)


def _lookup_all(index: GroupIndex, pairs: list[tuple[int, bytes]]) -> None:
    lookup = index.lookup
    for dir_ino, name in pairs:
        lookup(dir_ino, name)


def _dict_all(table: dict[Any, int], keys: list[Any]) -> None:
    get = table.__getitem__
    for key in keys:
        get(key)


def bench_index(entries: int, lookups: int, repeats: int) -> dict[str, Any]:
    """Size, load time and lookup times of a synthetic group's index, next to Python dicts."""
    root, paths = synthetic_tree(entries)
    encode_s, stored = timed(lambda: encode_index_object(root))
    index = GroupIndex.from_object(stored)
    by_path = dict(index.walk())  # the competitor: every path of the group -> inode
    by_pair: dict[tuple[int, bytes], int] = {}
    for path, ino in by_path.items():
        if path:
            parent, _, name = path.rpartition(b"/")
            by_pair[by_path[parent], name] = ino
    rng = random.Random(7)
    sample = rng.choices(paths, k=lookups)
    pairs = [(by_path[p.rpartition(b"/")[0]], p.rpartition(b"/")[2]) for p in sample]
    if any(index.resolve(p) != by_path[p] for p in sample[:1000]):
        sys.exit("build.py: the index resolves paths differently from the walk")
    pickled = pickle.dumps(by_path, protocol=pickle.HIGHEST_PROTOCOL)
    # Each operation and its dict competitor take turns, round by round.
    timings: dict[str, Timing] = {}
    for op, mine, theirs in (
        ("load", lambda: GroupIndex.from_object(stored), lambda: pickle.loads(pickled)),
        ("resolve", lambda: _resolve_all(index, sample), lambda: _dict_all(by_path, sample)),
        ("lookup", lambda: _lookup_all(index, pairs), lambda: _dict_all(by_pair, pairs)),
    ):
        timings.update(measure_interleaved({op: mine, f"{op}_dict": theirs}, repeats))
    result: dict[str, Any] = {
        "files": len(paths),
        "lookups": lookups,
        "encode_s": encode_s,
        "index": _size_row(index.inode_count, len(stored), len(index.raw)),
        "pickled_dict_bytes": len(pickled),
        **{k: t.as_dict() for k, t in timings.items()},
    }
    for op in ("load", "resolve", "lookup"):
        result[f"{op}_ratio_index_over_dict"] = paired_ratio(timings[op], timings[f"{op}_dict"])
    return result


# -- report ---------------------------------------------------------------------------------


def _spread(*parts: dict[str, Any]) -> str:
    return f"{max(p['spread'] for p in parts):.0%}"


BUILD_HEADERS = "tree MB weenv_MB/s tar|zstd_MB/s time_ratio rebuild_s rebuild/build spread"
SIZE_HEADERS = "tree entries index_B/entry raw_B/entry stored_MB tar.zst_MB size_ratio"


def _headers(text: str) -> list[str]:
    return [h.replace("_", " ") for h in text.split()]


def report_builds(builds: list[dict[str, Any]], repeats: int) -> None:
    """Print the throughput and the size tables of the build part."""
    speed, size = [], []
    for b in builds:
        tree, ix = Path(b["tree"]).name, b["index"]
        spread = _spread(b["weenv_build"], b["tar_zstd"], b["rebuild_no_change"])
        speed.append(
            [tree, b["bytes"] / MB, b["weenv_mb_per_s"], b["tar_zstd_mb_per_s"]]
            + [b["time_ratio_weenv_over_tar"], b["rebuild_no_change"]["median_s"]]
            + [b["rebuild_over_build"], spread]
        )
        size.append(
            [tree, ix["entries"], ix["compressed_per_entry"], ix["raw_per_entry"]]
            + [b["stored_bytes"] / MB, b["tar_zstd_bytes"] / MB]
            + [b["size_ratio_stored_over_tar_zstd"]]
        )
    title = f"Build, {repeats} rounds (ratios: median of per-round weenv / tar|zstd -3 -T0)"
    print_table(title, _headers(BUILD_HEADERS), speed)
    title = "Stored size (size ratio = weenv blobs + index / .tar.zst)"
    print_table(title, _headers(SIZE_HEADERS), size)


def report_index(ix: dict[str, Any], repeats: int) -> None:
    """Print the synthetic index table: each operation next to its dict competitor."""
    n = ix["lookups"]
    rows = []
    for op, label, scale in (
        ("load", "decompress + open, ms (dict: unpickle)", 1e3),
        ("resolve", f"resolve(path), us each of {n:,}", 1e6 / n),
        ("lookup", f"lookup(dir, name), us each of {n:,}", 1e6 / n),
    ):
        mine, theirs = ix[op], ix[f"{op}_dict"]
        rows.append(
            [label, mine["median_s"] * scale, theirs["median_s"] * scale]
            + [ix[f"{op}_ratio_index_over_dict"], _spread(mine, theirs)]
        )
    size = ix["index"]
    title = (
        f"Index of a synthetic group: {size['entries']:,} entries, "
        f"{size['compressed_per_entry']:.1f} B/entry stored, {size['raw_per_entry']:.1f} raw; "
        f"{repeats} rounds (ratio: median of per-round GroupIndex / dict)"
    )
    print_table(title, ["operation", "GroupIndex", "dict", "ratio", "spread"], rows)


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/build.py",
        description=(__doc__ or "").split("\n\nMust not")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser, FULL_REPEATS)
    parser.add_argument(
        "--profile",
        action="append",
        choices=("minbase", "python", "reference"),
        help="sample tree(s) to build (default: python and reference; minbase with --quick)",
    )
    parser.add_argument(
        "--tree",
        action="append",
        type=Path,
        metavar="DIR",
        help="build this directory instead (repeatable)",
    )
    for flag, what in (("--entries", "synthetic group files"), ("--lookups", "lookups per round")):
        parser.add_argument(flag, type=int, default=100_000, metavar="N", help=f"{what} (100000)")
    parser.add_argument("--only", choices=("build", "index"), help="run one part only")
    parser.add_argument(
        "--work",
        type=Path,
        metavar="DIR",
        help="scratch folder for stores and .tar.zst files (default: a "
        "new temporary folder, removed at the end)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repeats = repeats_for(args, FULL_REPEATS)
    missing = [tool for tool in ("tar", "zstd", "bash") if shutil.which(tool) is None]
    if missing and args.only != "index":
        sys.exit(f"build.py: {', '.join(missing)} not found (Debian packages tar, zstd, bash)")
    profiles = args.profile or (QUICK_PROFILES if args.quick else FULL_PROFILES)
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    results: dict[str, Any] = {"tar_zstd_command": TAR_ZSTD}
    if args.only != "index":
        trees = args.tree or [sample_tree(None, p, progress=False) for p in profiles]
        work = Path(tempfile.mkdtemp(prefix="weenv-bench-", dir=args.work))
        try:
            results["builds"] = [bench_tree(tree, repeats, work) for tree in trees]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        report_builds(results["builds"], repeats)
    if args.only != "build":
        results["index"] = bench_index(args.entries, args.lookups, repeats)
        report_index(results["index"], repeats)
    params = {
        "quick": args.quick,
        "repeats": repeats,
        "entries": args.entries,
        "lookups": args.lookups,
        "trees": [str(t) for t in args.tree or []] or list(profiles),
    }
    path = write_json(NAME, args.out, params, results)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
