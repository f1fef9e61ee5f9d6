#!/usr/bin/env python3
"""Benchmark mount to first `stat /`: a 100k-file environment against a 1k-file one.

Budget (DESIGN.md): under 300 ms wall for a 100k-file environment, and within 1.5x of a
1k-file one. Both environments are generated trees (directories of 100 small files), built
once into local stores under /var/tmp/weenv-bench and reused. Each round runs, in turns,
`weenv mount REF MP --store STORE --cache CACHE` as a user would (a new process that starts
the mount daemon and returns once the mount answers) followed by `stat MP`, timed together,
then unmounts (not timed). The node cache folder exists already (one untimed mount first), as
it does on a node. Also measured, to show where the time goes: the interpreter's start-up
(`python -c pass`), the daemon's imports (`python -c "import weenvfs.fuse.mount"`: trio,
pyfuse3, the core) and, in this process, loading each environment (store check, manifest,
indexes, composed tree), which is the only part that grows with the number of files. And
lookups: after each timed mount, `stat` of every file of the same 10 random directories of
the environment (1,000 files; every one a first lookup on the fresh mount, answered by the
daemon): the time per file should not grow with the number of files either.

Must not: assert anything about the numbers; it reports them (table on stdout, JSON file).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    Timing,
    add_common_args,
    compile_project,
    describe_machine,
    measure,
    paired_ratio,
    print_table,
    repeats_for,
    write_json,
)
from _mounting import BENCH_DIR, Mounts, Published, generated_tree, published

from weenvfs.core.loaded_env import open_environment
from weenvfs.store import open_store

NAME = "mount"
FULL_REPEATS = 9
FILES_PER_DIR = 100
BUDGET_S = 0.300
BUDGET_RATIO = 1.5
# Directories whose files are all stat'ed on each fresh mount (first lookups: each one reaches
# the daemon): 10 directories of 100 files.
LOOKUP_DIRS = 10

EXAMPLES = """\
examples:
  # full run: 1k-file vs 100k-file environment, 9 rounds
  .venv/bin/python benchmarks/mount.py
  # smoke run: 1k vs 10k files, 1 round
  .venv/bin/python benchmarks/mount.py --quick
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser, FULL_REPEATS)
    parser.add_argument("--small", type=int, default=1000, metavar="N",
                        help="files of the small environment (default 1000)")
    parser.add_argument("--large", type=int, default=None, metavar="N",
                        help="files of the large environment (default 100000, 10000 with --quick)")
    return parser.parse_args(argv)


def environment(files: int) -> tuple[Published, list[str]]:
    """A published environment of about `files` small files (directories of 100), and the
    paths of every file in LOOKUP_DIRS random directories of it (the same count and shape
    for every size, so that each size needs as many lookups)."""
    dirs = max(1, files // FILES_PER_DIR)
    tree = generated_tree(dirs, FILES_PER_DIR)
    folders = sorted(top for top, _dirs, names in os.walk(tree) if names)
    chosen = random.Random(files).sample(folders, min(LOOKUP_DIRS, len(folders)))
    sample = [
        os.path.relpath(os.path.join(top, name), tree)
        for top in chosen for name in sorted(os.listdir(top))
    ]
    return published(f"gen{dirs * FILES_PER_DIR}", tree), sample


def stat_all(root: Path, paths: list[str]) -> float:
    """Seconds to `stat` every path below `root` (each a first lookup on a fresh mount)."""
    start = time.perf_counter()
    for path in paths:
        os.stat(root / path)
    return time.perf_counter() - start


def load_seconds(pub: Published, repeats: int) -> float:
    """Median seconds to load `pub` in-process: store check, manifest, indexes, tree."""

    def load() -> None:
        store = open_store(str(pub.store))
        try:
            open_environment(store, pub.ref)
        finally:
            store.close()

    return measure(load, repeats).median


FLOORS = {
    "python -c pass": "pass",
    "python -c 'import weenvfs.fuse.mount'": "import weenvfs.fuse.mount",
}


def floors(repeats: int) -> dict[str, float]:
    """Median seconds of a bare interpreter and of one that imports what the daemon needs."""
    return {
        name: measure(
            lambda code=code: subprocess.run([sys.executable, "-c", code], check=True), repeats
        ).median
        for name, code in FLOORS.items()
    }


def mount_rounds(
    envs: dict[str, tuple[Published, list[str]]], mounts: Mounts, work: Path, repeats: int
) -> tuple[dict[str, Timing], dict[str, Timing]]:
    """Mount + `stat` each environment once per round, in turns (who goes first rotates),
    then `stat` its sample of files (timed apart), then unmount (not timed). The node cache
    folder exists before the first. Returns the mount and the lookup timings."""
    cache, mp = work / "cache", work / "mnt"
    first = next(iter(envs.values()))[0]
    mounts.mount(first, mp, cache)  # untimed: creates the node cache folder
    mounts.unmount(mp)
    mount_s: dict[str, list[float]] = {name: [] for name in envs}
    lookup_s: dict[str, list[float]] = {name: [] for name in envs}
    names = list(envs)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            pub, paths = envs[name]
            mount_s[name].append(mounts.mount(pub, mp, cache))
            lookup_s[name].append(stat_all(mp, paths) / len(paths))
            mounts.unmount(mp)
    return (
        {name: Timing(tuple(values)) for name, values in mount_s.items()},
        {name: Timing(tuple(values)) for name, values in lookup_s.items()},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repeats = repeats_for(args, FULL_REPEATS)
    large_files = args.large or (10_000 if args.quick else 100_000)
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    envs = {"small": environment(args.small), "large": environment(large_files)}
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mount-", dir=BENCH_DIR))
    mounts = Mounts(work)
    try:
        timings, lookups = mount_rounds(envs, mounts, work, repeats)
    finally:
        mounts.close()
        shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {
        name: {
            "files": pub.entries,
            "ref": pub.ref,
            "mount_to_stat": timings[name].as_dict(),
            "load_in_process_s": load_seconds(pub, repeats),
            "first_stat_of_a_file": {**lookups[name].as_dict(), "files": len(paths)},
        }
        for name, (pub, paths) in envs.items()
    }
    results["lookup_ratio_large_over_small"] = paired_ratio(lookups["large"], lookups["small"])
    results["floors_s"] = floors(repeats)
    large = timings["large"].median
    results["ratio_large_over_small"] = paired_ratio(timings["large"], timings["small"])
    results["budget"] = {"max_s": BUDGET_S, "max_ratio": BUDGET_RATIO}
    results["within_budget"] = (
        large < BUDGET_S and results["ratio_large_over_small"] < BUDGET_RATIO
    )
    report(results, repeats)
    params = {"quick": args.quick, "repeats": repeats, "small_files": args.small,
              "large_files": large_files}
    path = write_json(NAME, args.out, params, results)
    print(f"\nwrote {path}")
    return 0


def report(results: dict[str, Any], repeats: int) -> None:
    """The table: both environments, the CLI's start-up floor, the ratio and the budget."""
    rows = []
    for name in ("small", "large"):
        r = results[name]
        t = r["mount_to_stat"]
        rows.append([f"{r['files']:,} entries", t["median_s"] * 1000, t["spread"],
                     r["load_in_process_s"] * 1000,
                     r["first_stat_of_a_file"]["median_s"] * 1e6])
    for name, seconds in results["floors_s"].items():
        rows.append([name, seconds * 1000, float("nan"), float("nan"), float("nan")])
    print_table(
        f"mount to first stat / (median of {repeats})",
        ["environment", "mount+stat ms", "spread", "load ms (in-process)",
         "first stat of a file us"],
        rows,
    )
    verdict = "within" if results["within_budget"] else "OVER"
    print(
        f"\nlarge/small ratio {results['ratio_large_over_small']:.2f} (budget < {BUDGET_RATIO}); "
        f"large {results['large']['mount_to_stat']['median_s'] * 1000:.0f} ms "
        f"(budget < {BUDGET_S * 1000:.0f} ms): {verdict} budget; first stat of a file "
        f"large/small {results['lookup_ratio_large_over_small']:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
