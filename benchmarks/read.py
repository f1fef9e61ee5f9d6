#!/usr/bin/env python3
"""Benchmark reads through a mount: cached read throughput of a large file, and a metadata walk.

1. Throughput (budget, DESIGN.md: at least 50% of local disk). A 1 GB file of incompressible
   data (128 MB with --quick) is published once into a local store under /var/tmp/weenv-bench
   and read once through a mount, so that every chunk is in the node cache. Each round then
   mounts afresh (the kernel keeps nothing of a file across mounts), drops the page cache
   (`sync; echo 3 > /proc/sys/vm/drop_caches`: the node cache's chunk files are read from disk,
   like the competitor's file), reads the weenv software back in (a node keeps it warm) and
   reads the file sequentially in 1 MiB blocks; the competitor reads the same file from local
   disk, page cache dropped the same way. A second pair, "page cache warm", reads both again
   with the page cache kept (a fresh mount, chunk files in memory): FUSE's own overhead.
2. Cold from S3 (no budget; issue 13: "no regression in the read benchmark"): the same file
   through a fresh mount whose node cache is empty, from SeaweedFS on 127.0.0.1 (its data kept
   under /var/tmp/weenv-bench/seaweed-read), page cache dropped: the mount and the sequential
   read, against a plain GET of each of the store's blobs (the bytes any pull moves at the
   least, with nothing decoded, verified or written). Reported: MB/s of file data, the ratio of
   the two, requests and bytes the mount fetched.
3. Walk: lstat every entry of the reference tree (`find ROOT -exec stat`, with scandir and
   lstat) on a fresh mount against a local copy of the same tree with dentries and inodes
   dropped, then a second walk of each (kernel caches warm). Metadata comes from the indexes
   in memory: the walk fetches no chunk.

Must not: assert anything about the numbers; it reports them (table on stdout, JSON file).
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    Timing,
    add_common_args,
    compile_project,
    describe_machine,
    paired_ratio,
    print_table,
    repeats_for,
    write_json,
)
from _mounting import (
    BENCH_DIR,
    Mounts,
    Published,
    can_drop_caches,
    drop_caches,
    forget_environments,
    mount_server,
    published,
    walk_stat,
)
from coldstart_ref import local_copy
from weenv_peer import mirror, start_seaweed

from weenvfs.fuse.commands import read_stats
from weenvfs.store import open_store
from weenvfs.tools.sample import sample_tree

NAME = "read"
FULL_REPEATS = 3
BUDGET_FRACTION = 0.5
BLOCK = 1 << 20
MB = 1e6

EXAMPLES = """\
examples:
  # full run: a 1 GB file and the reference tree, 3 rounds
  .venv/bin/python benchmarks/read.py
  # smoke run: a 128 MB file and the 'python' tree, 1 round
  .venv/bin/python benchmarks/read.py --quick
  # only the throughput part
  .venv/bin/python benchmarks/read.py --only throughput
  # only the cold read from SeaweedFS against a plain GET
  .venv/bin/python benchmarks/read.py --only cold-s3
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser, FULL_REPEATS)
    parser.add_argument("--size-mb", type=int, default=None, metavar="N",
                        help="size of the large file in MiB (default 1024, 128 with --quick)")
    parser.add_argument("--profile", default=None,
                        help="sample tree to walk (default reference, python with --quick)")
    parser.add_argument("--only", choices=("throughput", "cold-s3", "walk"), default=None)
    return parser.parse_args(argv)


# -- inputs ---------------------------------------------------------------------------------


def big_file_tree(size_mib: int) -> Path:
    """A tree holding one file `big.bin` of `size_mib` MiB of random bytes (made once)."""
    tree = BENCH_DIR / "trees" / f"bigfile-{size_mib}m"
    big = tree / "big.bin"
    if big.exists() and big.stat().st_size == size_mib << 20:
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    rng = random.Random(size_mib)
    tmp = tree / ".big.tmp"
    with open(tmp, "wb") as f:
        for _ in range(size_mib):
            f.write(rng.randbytes(BLOCK))
    tmp.rename(big)
    return tree


def read_all(path: Path) -> int:
    """Read `path` sequentially in 1 MiB blocks (as `cat` or `cp` would); return bytes."""
    buf = bytearray(BLOCK)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total


def cold() -> None:
    """Drop the page cache, then read the weenv software back (a node keeps it warm)."""
    drop_caches()
    subprocess.run(
        [sys.executable, "-c", "import weenvfs.cli, weenvfs.fuse.commands, weenvfs.fuse.mount"],
        check=True,
    )


# -- 1. throughput --------------------------------------------------------------------------


def bench_throughput(size_mib: int, repeats: int, work: Path, mounts: Mounts) -> dict[str, Any]:
    """Rounds of: weenv (chunks cached, page cache dropped) vs local disk (dropped), then
    both with the page cache warm."""
    tree = big_file_tree(size_mib)
    pub = published(f"bigfile{size_mib}m", tree)
    local = tree / "big.bin"
    cache, mp = work / "cache", work / "mnt"
    mounts.mount(pub, mp, cache, "--hint", "none")
    try:
        read_all(mp / "big.bin")  # fill the node cache
    finally:
        mounts.unmount(mp)
    samples: dict[str, list[float]] = {}

    def timed_read(name: str, path: Path) -> None:
        start = time.perf_counter()
        read_all(path)
        samples.setdefault(name, []).append(time.perf_counter() - start)

    def weenv(page_cache: str) -> None:
        mounts.mount(pub, mp, cache, "--hint", "none")
        try:
            if page_cache == "cold":
                cold()
            else:
                read_all(local)  # not timed: the chunk files are in memory too by now
            timed_read(f"weenv, page cache {page_cache}", mp / "big.bin")
        finally:
            mounts.unmount(mp)

    def disk(page_cache: str) -> None:
        if page_cache == "cold":
            cold()
        else:
            read_all(local)
        timed_read(f"local disk, page cache {page_cache}", local)

    steps: list[Callable[[], None]] = [
        lambda: weenv("cold"), lambda: disk("cold"), lambda: weenv("warm"), lambda: disk("warm"),
    ]
    for r in range(repeats):
        for pair in (steps[:2], steps[2:]):
            for step in pair if r % 2 == 0 else pair[::-1]:
                step()
    return _throughput_results(samples, size_mib << 20)


def _throughput_results(samples: dict[str, list[float]], size: int) -> dict[str, Any]:
    timings = {name: Timing(tuple(s)) for name, s in samples.items()}
    out: dict[str, Any] = {"bytes": size, "block_bytes": BLOCK, "contenders": {}}
    for name, t in timings.items():
        out["contenders"][name] = {**t.as_dict(), "mb_per_s": size / t.median / MB}
    for state in ("cold", "warm"):
        mine = timings[f"weenv, page cache {state}"]
        theirs = timings[f"local disk, page cache {state}"]
        # Throughput fraction = local time / weenv time, round by round.
        out[f"fraction_of_local_{state}"] = 1 / paired_ratio(mine, theirs)
    out["budget"] = {"min_fraction_of_local": BUDGET_FRACTION}
    out["within_budget"] = out["fraction_of_local_cold"] >= BUDGET_FRACTION
    return out


def report_throughput(res: dict[str, Any], repeats: int) -> None:
    rows = [[name, c["mb_per_s"], c["median_s"] * 1000, c["spread"]]
            for name, c in res["contenders"].items()]
    print_table(
        f"sequential read of a {res['bytes'] / 2**20:.0f} MiB file, 1 MiB blocks "
        f"(median of {repeats})",
        ["contender", "MB/s", "ms", "spread"],
        rows,
    )
    verdict = "within" if res["within_budget"] else "OVER"
    print(
        f"\nweenv / local throughput: page cache dropped {res['fraction_of_local_cold']:.2f} "
        f"(budget >= {BUDGET_FRACTION}: {verdict} budget), page cache warm "
        f"{res['fraction_of_local_warm']:.2f}"
    )


# -- 2. cold from S3 ---------------------------------------------------------------------------


def bench_cold_s3(size_mib: int, repeats: int, work: Path, mounts: Mounts) -> dict[str, Any]:
    """Rounds of: mount + sequential read with an empty node cache from SeaweedFS vs a plain
    GET of the store's blobs, page cache dropped before each."""
    pub = published(f"bigfile{size_mib}m", big_file_tree(size_mib))
    server = start_seaweed(BENCH_DIR / "seaweed-read")
    try:
        url = server.url(f"bigfile{size_mib}m")
        mirror(str(pub.store), url)
        with open_store(url) as store:
            blobs = [key for key in store.list() if key.startswith("blobs/")]
        samples: dict[str, list[float]] = {}
        fetched: dict[str, int] = {}
        mine, plain = "weenv mount + read, node cache empty", "plain GET of the blobs"

        def weenv() -> None:
            cache, mp = work / "s3-cache", work / "s3-mnt"
            shutil.rmtree(cache, ignore_errors=True)
            forget_environments(url, cache)  # as coldstart_ref.py's cold turns
            cold()
            start = time.perf_counter()
            mounts.mount(pub, mp, cache, "--hint", "none", store=url)
            try:
                read_all(mp / "big.bin")
                samples.setdefault(mine, []).append(time.perf_counter() - start)
                fetch = read_stats(str(mp))["fetch"]
                fetched.update(requests=fetch["requests"], bytes=fetch["bytes_fetched"])
            finally:
                mounts.unmount(mp)
                shutil.rmtree(cache, ignore_errors=True)

        def get() -> None:
            cold()
            start = time.perf_counter()
            with open_store(url) as store:
                got = sum(len(store.get(key)) for key in blobs)
            samples.setdefault(plain, []).append(time.perf_counter() - start)
            fetched["plain_bytes"] = got

        for r in range(repeats):
            for step in (weenv, get) if r % 2 == 0 else (get, weenv):
                step()
    finally:
        server.stop()
    size = size_mib << 20
    timings = {name: Timing(tuple(s)) for name, s in samples.items()}
    out: dict[str, Any] = {"bytes": size, "blobs": len(blobs), "fetched": fetched,
                           "contenders": {}}
    for name, t in timings.items():
        out["contenders"][name] = {**t.as_dict(), "mb_per_s": size / t.median / MB}
    out["time_ratio_weenv_over_plain"] = paired_ratio(timings[mine], timings[plain])
    return out


def report_cold_s3(res: dict[str, Any], repeats: int) -> None:
    rows = [[name, c["mb_per_s"], c["median_s"] * 1000, c["spread"]]
            for name, c in res["contenders"].items()]
    print_table(
        f"cold read of a {res['bytes'] / 2**20:.0f} MiB file from SeaweedFS (127.0.0.1), "
        f"median of {repeats}", ["contender", "MB/s", "ms", "spread"], rows)
    f = res["fetched"]
    print(f"\nweenv / plain GET time: {res['time_ratio_weenv_over_plain']:.2f} "
          f"(the mount: {f['requests']} requests, {f['bytes'] / 2**20:.0f} MiB)")


# -- 3. walk --------------------------------------------------------------------------------


def bench_walk(profile: str, repeats: int, work: Path, mounts: Mounts) -> dict[str, Any]:
    """Rounds of: a fresh mount walked twice vs the local copy walked twice (caches dropped
    before the first walk of each)."""
    tree = sample_tree(None, profile, progress=False)
    pub: Published = published(profile, tree)
    copy = local_copy(profile, tree)
    cache, mp = work / "walk-cache", work / "walk-mnt"
    samples: dict[str, list[float]] = {}
    entries: dict[str, int] = {}

    def walks(name: str, root: Path) -> None:
        for state in ("cold", "warm"):
            start = time.perf_counter()
            entries[name] = walk_stat(root)
            samples.setdefault(f"{name}, {state}", []).append(time.perf_counter() - start)

    def weenv() -> None:
        mounts.mount(pub, mp, cache, "--hint", "none")
        try:
            cold()
            walks("weenv", mp)
        finally:
            mounts.unmount(mp)

    def disk() -> None:
        cold()
        walks("local disk", copy)

    for r in range(repeats):
        for step in (weenv, disk) if r % 2 == 0 else (disk, weenv):
            step()
    timings = {name: Timing(tuple(s)) for name, s in samples.items()}
    out: dict[str, Any] = {"profile": profile, "entries": entries, "contenders": {}}
    for name, t in timings.items():
        out["contenders"][name] = {**t.as_dict(), "entries_per_s": entries["weenv"] / t.median}
    for state in ("cold", "warm"):
        out[f"time_ratio_weenv_over_local_{state}"] = paired_ratio(
            timings[f"weenv, {state}"], timings[f"local disk, {state}"]
        )
    return out


def report_walk(res: dict[str, Any], repeats: int) -> None:
    rows = [[name, c["median_s"] * 1000, c["entries_per_s"], c["spread"]]
            for name, c in res["contenders"].items()]
    print_table(
        f"lstat walk of the {res['profile']} tree, {res['entries']['weenv']:,} entries "
        f"(median of {repeats})",
        ["contender", "ms", "entries/s", "spread"],
        rows,
    )
    print(
        f"\nweenv / local walk time: cold {res['time_ratio_weenv_over_local_cold']:.2f}, "
        f"warm {res['time_ratio_weenv_over_local_warm']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not can_drop_caches():
        sys.exit("read.py: needs root (it drops the page cache)")
    repeats = repeats_for(args, FULL_REPEATS)
    size_mib = args.size_mb or (128 if args.quick else 1024)
    profile = args.profile or ("python" if args.quick else "reference")
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="read-", dir=BENCH_DIR))
    mounts = Mounts(work)
    results: dict[str, Any] = {}
    try:
        # A node service of the benchmark's own (never the node's), restarted for each cold
        # read from S3.
        with mount_server(work / "mountd"):
            if args.only in (None, "throughput"):
                results["throughput"] = bench_throughput(size_mib, repeats, work, mounts)
            if args.only in (None, "cold-s3"):
                results["cold_s3"] = bench_cold_s3(size_mib, repeats, work, mounts)
            if args.only in (None, "walk"):
                results["walk"] = bench_walk(profile, repeats, work, mounts)
    finally:
        mounts.close()
        shutil.rmtree(work, ignore_errors=True)
    if "throughput" in results:
        report_throughput(results["throughput"], repeats)
    if "cold_s3" in results:
        report_cold_s3(results["cold_s3"], repeats)
    if "walk" in results:
        report_walk(results["walk"], repeats)
    params = {"quick": args.quick, "repeats": repeats, "size_mib": size_mib, "profile": profile,
              "only": args.only}
    path = write_json(NAME, args.out, params, results)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
