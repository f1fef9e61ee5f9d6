#!/usr/bin/env python3
"""Benchmark the cold start of the reference workload: time-to-ready and bytes fetched.

The reference workload (DESIGN.md): the sample tree `reference` (Debian + python3 + numpy +
pandas, about 1.2 GB) and `chroot ROOT /usr/bin/python3 -c "import numpy, pandas"`. Each round
runs, in turns (who goes first rotates), with the page cache dropped before each contender
(`sync; echo 3 > /proc/sys/vm/drop_caches`):
- weenv cold: an empty node cache; `weenv mount --hint none` (no prefetch hint: the budget is
  for lazy loading alone) + the command; time-to-ready = both, then `weenv stats` gives the
  bytes fetched. Budget: fetched / image size under 15%.
- weenv cold, FUSE tree: the same with `--path fuse` (the whole tree over FUSE: the path
  before metadata moved into the kernel, and the fallback where the kernel path cannot run).
- weenv warm / weenv warm, FUSE tree / local disk, warm: the command again right after the
  cold one, on the same mount (page cache and the kernel's caches filled): the median of
  WARM_RUNS runs in a row, each timed alone (a single warm run of ~0.3 s varied by up to
  +-20% from one to the next on this machine, more than the budget's 10%).
- weenv, chunks cached: the same with the node cache the cold run filled (a node that ran the
  environment before; page cache still dropped).
- local disk: the command in a chroot of a copy of the same tree on local disk (no mount).
- extract .tar.zst: `tar -I 'zstd -T0' -xf` of the tree's archive into an empty folder, then
  the command there: what pulling the image costs at the very least (no network, no
  registry, no layer verification).
- the README's commands from SeaweedFS (readme_runs.py; --no-readme leaves them out): `weenv
  run` cold with no hint (its first run, which records one), cold with a hint, and warm, and
  the Python API cold: what issue 13's budgets are about.
The weenv software itself (Python, trio, pyfuse3) is read once after each cache drop, before
the clock starts: a node keeps it warm, as it keeps Docker's daemon; only the environment's
data is cold. The store is a local folder (its blobs are cold too).
The peers, in the same rounds, from the same tree as a one-layer image in Debian's
docker-registry on 127.0.0.1 (docker_tree.py pushes it once; the registry folder is kept under
the benchmark folder), each with everything local removed and the page cache dropped before
the clock starts, each running `/usr/bin/python3 -c CODE` in a container with no network:
- docker pull + run: our own dockerd (docker_tree.ColdDockerRun);
- eStargz (containerd + stargz, lazy): the image converted once to eStargz (`ctr-remote image
  optimize --no-optimize`; `--stargz-optimized` adds the variant with the workload recorded),
  `ctr-remote image rpull` + `ctr run --snapshotter stargz` (stargz_peer.py);
- containerd pull + run (overlayfs): the gzip image, `ctr image pull` + `ctr run`.
A peer that cannot run here (`scripts/setup.sh --bench` installs them) is skipped with a
one-line reason; --no-peers leaves them all out.
And WeEnv under containerd (snapshotter_peer.py; --no-snapshotter leaves it out): the
environment pushed once per run with `weenv push` (marker layers) to the same registry, its
data in the same local store as weenv cold; each round containerd, `weenv snapshotter` and
the mount server are restarted with nothing left (images, snapshots, group mounts, node
cache), then `weenv pull` + `ctr run --snapshotter weenv`: with no hint (a first pull), and
with the workload's hint as the environment's `latest` (recorded once in the store, as a first
`weenv run` or `weenv hints record` anywhere leaves one). Budget (issue 17): at least 3x
faster than eStargz cold, paired round by round.

Before each contender the machine is left to settle (`_mounting.settle`: until the CPUs are
under 15% busy for two 0.2 s windows, at most 15 s): a peer's daemon goes on working after
its own run (containerd's stargz snapshotter fetches the rest of an image in the background),
and the contender after it paid for that. The seconds each step waited are in the JSON
(`settle_s`).
Must not: assert anything about the numbers; it reports them (table on stdout, JSON file).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
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
    paired_ratio,
    print_table,
    ratio,
    repeats_for,
    write_json,
)
from _mounting import (
    BENCH_DIR,
    Mounts,
    Published,
    can_drop_caches,
    copy_tree,
    drop_caches,
    published,
    settle,
    weenv,
)
from docker_peer import Dockerd, Registry, docker_unavailable
from docker_tree import ColdDockerRun, push_tree
from readme_runs import WARM_RUNS, ReadmeRuns, readme_steps
from snapshotter_peer import (
    HINTED_LABEL,
    LABEL,
    ColdSnapshotterRun,
    SnapshotterPeer,
    snapshotter_unavailable,
)
from stargz_peer import ColdContainerdRun, ColdStargzRun, StargzPeer, stargz_unavailable

from weenvfs.tools.sample import sample_tree

NAME = "coldstart_ref"
FULL_REPEATS = 3
BUDGET_FRACTION = 0.15
BUDGET_OVER_STARGZ = 3.0  # issue 17: the weenv snapshotter vs eStargz, cold
WORKLOADS = {
    "reference": "import numpy, pandas",
    "python": "import json, sqlite3, decimal, email.parser",  # --quick: a smaller tree
    "large": "import torch, sklearn",  # a large Python image (~2 GB: tools/sample.py)
}
TAR_EXTRACT = ["tar", "-I", "zstd -T0", "-xf"]
DOCKER = "docker pull + run"
STARGZ_OPTIMIZED = "eStargz optimized (containerd + stargz, lazy)"
PeerRun = ColdDockerRun | ColdStargzRun | ColdSnapshotterRun

EXAMPLES = """\
examples:
  # full run: the reference tree (Debian + numpy + pandas), 3 rounds
  .venv/bin/python benchmarks/coldstart_ref.py
  # smoke run: the smaller 'python' tree, 1 round
  .venv/bin/python benchmarks/coldstart_ref.py --quick
  # without WeEnv under containerd (weenv pull + ctr run --snapshotter weenv)
  .venv/bin/python benchmarks/coldstart_ref.py --no-snapshotter
  # a large Python image (~2 GB: + PyTorch, scikit-learn), `import torch, sklearn`
  .venv/bin/python benchmarks/coldstart_ref.py --profile large --repeats 2
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser, FULL_REPEATS)
    parser.add_argument("--profile", choices=sorted(WORKLOADS), default=None,
                        help="sample tree (default reference, python with --quick)")
    parser.add_argument("--no-extract", action="store_true",
                        help="skip the .tar.zst extraction contender")
    parser.add_argument("--no-peers", action="store_true",
                        help="leave out Docker, eStargz and containerd")
    parser.add_argument("--no-snapshotter", action="store_true",
                        help="leave out WeEnv under containerd (`weenv pull` + `ctr run "
                        "--snapshotter weenv`: snapshotter_peer.py)")
    parser.add_argument("--no-readme", action="store_true",
                        help="leave out the README's commands from SeaweedFS (`weenv run`, "
                        "the Python API: readme_runs.py)")
    parser.add_argument("--stargz-optimized", action="store_true",
                        help="add eStargz with the workload's accesses recorded at conversion")
    return parser.parse_args(argv)


# -- the inputs, built once -----------------------------------------------------------------


def local_copy(profile: str, tree: Path) -> Path:
    """A copy of `tree` on local disk under BENCH_DIR (made once)."""
    copy = BENCH_DIR / "trees" / f"{profile}-copy"
    stamp = copy.with_name(copy.name + ".key")
    key = json.dumps({"tree": str(tree), "mtime_ns": tree.stat().st_mtime_ns})
    if copy.exists() and stamp.exists() and stamp.read_text() == key:
        return copy
    shutil.rmtree(copy, ignore_errors=True)
    copy.parent.mkdir(parents=True, exist_ok=True)
    print(f"copying {tree} to {copy} (once)", flush=True)
    copy_tree(tree, copy)
    stamp.write_text(key)
    return copy


def archive(profile: str, tree: Path) -> Path:
    """`tar -C TREE -cf - . | zstd -3 -T0` of `tree` under BENCH_DIR (made once)."""
    out = BENCH_DIR / "archives" / f"{profile}.tar.zst"
    stamp = out.with_name(out.name + ".key")
    key = json.dumps({"tree": str(tree), "mtime_ns": tree.stat().st_mtime_ns})
    if out.exists() and stamp.exists() and stamp.read_text() == key:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"archiving {tree} to {out} (once)", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run(
        ["bash", "-o", "pipefail", "-c",
         f"tar -C '{tree}' -cf - . | zstd -3 -T0 -q -f -o '{tmp}'"],
        check=True,
    )
    tmp.rename(out)
    stamp.write_text(key)
    return out


# -- the contenders -------------------------------------------------------------------------


# Workloads that open device nodes (torch reads /dev/urandom as it is imported). A weenv
# mount is nodev, so its own /dev nodes cannot be opened: every chroot contender of such a
# workload, local disk's alike, runs with the node's /dev bound over the tree's, in a mount
# namespace of its own (gone with the command).
OPENS_DEVICES = frozenset({WORKLOADS["large"]})


def run_in(root: Path, code: str) -> None:
    """`chroot ROOT /usr/bin/python3 -c CODE`; exits the benchmark if it fails."""
    argv = ["chroot", str(root), "/usr/bin/python3", "-c", code]
    if code in OPENS_DEVICES:
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'root=$1; shift; mount --rbind /dev "$root/dev" && exec "$@"', "sh",
                str(root), *argv]
    done = subprocess.run(argv,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"chroot {root} python3 -c {code!r} failed: {done.stderr.strip()[-2000:]}")


def warm_median(root: Path, code: str) -> float:
    """The median time of WARM_RUNS runs of the command in `root`, one after another."""
    times = []
    for _ in range(WARM_RUNS):
        start = time.perf_counter()
        run_in(root, code)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cold() -> None:
    """Drop the page cache, then read the weenv software back (a node keeps it warm)."""
    drop_caches()
    subprocess.run(
        [sys.executable, "-c", "import weenvfs.cli, weenvfs.fuse.commands, weenvfs.fuse.mount"],
        check=True,
    )


class Rounds:
    """The contenders of one run and what they measured."""

    def __init__(self, pub: Published, code: str, work: Path, mounts: Mounts) -> None:
        self.pub, self.code, self.work, self.mounts = pub, code, work, mounts
        self.cache = work / "cache"
        self.mp = work / "mnt"
        self.samples: dict[str, list[float]] = {}
        self.fetched: list[dict[str, Any]] = []
        self.peer_bytes: dict[str, list[int]] = {}
        self.peer_details: dict[str, list[dict[str, Any]]] = {}
        self.paths: set[str] = set()  # the data path `weenv stats` reported for weenv cold

    def _time(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(seconds)

    def record(self, samples: dict[str, float]) -> None:
        """Times by contender, and `bytes: CONTENDER` (readme_runs.py)."""
        for name, value in samples.items():
            if name.startswith("bytes: "):
                self.peer_bytes.setdefault(name[len("bytes: "):], []).append(int(value))
            else:
                self._time(name, value)

    def weenv_cold(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)  # an empty node cache
        self.weenv_mount("weenv cold", record=True)

    def weenv_cold_fuse(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)
        self.weenv_mount("weenv cold, FUSE tree", path="fuse")

    def weenv_cached(self) -> None:
        if not self.cache.exists():
            self.weenv_cold()  # fill the node cache first (this round's order put it first)
        self.weenv_mount("weenv, chunks cached")

    def weenv_mount(self, name: str, record: bool = False, path: str = "auto") -> None:
        """Mount + the command (`name`), then the command again on the same mount: the warm
        time (`name` with "cold" read as "warm": page cache and kernel caches filled)."""
        cold()
        start = time.perf_counter()
        self.mounts.mount(self.pub, self.mp, self.cache, "--hint", "none", "--path", path)
        try:
            run_in(self.mp, self.code)
            self._time(name, time.perf_counter() - start)
            doc = json.loads(weenv("stats", "--json", str(self.mp)))
            if record:
                self.fetched.append(doc["fetch"])
                self.paths.add(doc["mount"].get("path", "fuse"))
            if "cold" in name:
                self._time(name.replace("cold", "warm"), warm_median(self.mp, self.code))
        finally:
            self.mounts.unmount(self.mp)

    def local(self, copy: Path) -> None:
        cold()
        start = time.perf_counter()
        run_in(copy, self.code)
        self._time("local disk", time.perf_counter() - start)
        self._time("local disk, warm", warm_median(copy, self.code))

    def peer(self, name: str, run: PeerRun) -> None:
        seconds, detail = run.run()  # makes the peer cold and drops the page cache itself
        self._time(name, seconds)
        self.peer_bytes.setdefault(name, []).append(detail["bytes_fetched"])
        if len(detail) > 1:
            self.peer_details.setdefault(name, []).append(detail)

    def extract(self, tar_zst: Path) -> None:
        target = self.work / "extract"
        shutil.rmtree(target, ignore_errors=True)
        cold()
        start = time.perf_counter()
        target.mkdir()
        subprocess.run([*TAR_EXTRACT, str(tar_zst), "-C", str(target)], check=True)
        run_in(target, self.code)
        self._time("extract .tar.zst", time.perf_counter() - start)
        shutil.rmtree(target, ignore_errors=True)


def start_peers(stack: contextlib.ExitStack, profile: str, tree: Path, code: str,
                work: Path, args: argparse.Namespace, pub: Published
                ) -> tuple[dict[str, PeerRun], dict[str, str]]:
    """The registry holding `tree` as image `ref-PROFILE` (pushed once), each peer that can
    run here (none with --no-peers) and the weenv snapshotter (unless --no-snapshotter), all
    stopped when `stack` closes; (runs by contender, skip reasons by peer)."""
    runs: dict[str, PeerRun] = {}
    skipped: dict[str, str] = {}
    wanted = [] if args.no_peers else [("docker", docker_unavailable()),
                                        ("estargz", stargz_unavailable())]
    if args.no_peers:
        skipped["peers"] = "--no-peers"
    if args.no_snapshotter:
        skipped["weenv snapshotter"] = "--no-snapshotter"
    else:
        wanted.append(("weenv snapshotter", snapshotter_unavailable()))
    for peer, why in wanted:
        if why:
            skipped[peer] = why
            print(f"{peer}: skipped: {why}", flush=True)
    able = {peer for peer, why in wanted if not why}
    if not able:
        return runs, skipped
    folder = BENCH_DIR / "coldstart-ref-registry"
    registry = Registry(folder / "registry").start()
    stack.callback(registry.stop)
    name = f"ref-{profile}"
    key = {"tree": str(tree), "mtime_ns": tree.stat().st_mtime_ns, "v": 1}
    if able & {"docker", "estargz"}:
        push_tree(tree, key, registry, name, folder / "layers")
    argv = ["/usr/bin/python3", "-c", code]
    if "docker" in able:
        dockerd = Dockerd(work / "docker").start()
        stack.callback(dockerd.stop)
        runs[DOCKER] = ColdDockerRun(dockerd, registry, registry.host, name, argv)
    if "estargz" in able:
        peer = StargzPeer(work / "stargz")
        stack.callback(peer.stop)
        peer.start()
        lazy = ColdStargzRun(peer, registry, peer.convert(registry, name, key), argv)
        runs[lazy.label] = lazy
        if args.stargz_optimized:
            runs[STARGZ_OPTIMIZED] = ColdStargzRun(
                peer, registry, peer.convert(registry, name, key, optimize_argv=argv), argv)
        plain = ColdContainerdRun(peer, registry, name, argv)
        runs[plain.label] = plain
    if "weenv snapshotter" in able:
        ours = SnapshotterPeer(work / "snapshotter", pub.store)
        stack.callback(ours.stop)
        ours.start()
        ref = ours.push(registry, pub.ref, f"{name}-weenv")
        hint = ours.recorded_hint(pub.ref, argv)
        for snap in (ColdSnapshotterRun(ours, registry, ref, argv, pub.ref),
                     ColdSnapshotterRun(ours, registry, ref, argv, pub.ref, hint)):
            runs[snap.label] = snap
    return runs, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not can_drop_caches():
        sys.exit("coldstart_ref.py: needs root (it drops the page cache)")
    repeats = repeats_for(args, FULL_REPEATS)
    profile = args.profile or ("python" if args.quick else "reference")
    code = WORKLOADS[profile]
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    tree = sample_tree(None, profile, progress=False)
    pub = published(profile, tree)
    copy = local_copy(profile, tree)
    tar_zst = None if args.no_extract else archive(profile, tree)
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="coldstart-", dir=BENCH_DIR))
    mounts = Mounts(work)
    rounds = Rounds(pub, code, work, mounts)
    steps = [rounds.weenv_cold, rounds.weenv_cold_fuse, rounds.weenv_cached,
             lambda: rounds.local(copy)]
    if tar_zst is not None:
        steps.append(lambda: rounds.extract(tar_zst))
    skipped: dict[str, str] = {}
    settled: list[float] = []  # seconds each step waited for a quiet machine
    try:
        with contextlib.ExitStack() as stack:
            if not args.no_readme:
                readme = ReadmeRuns(stack, pub, profile, code, work)
                steps += readme_steps(readme, rounds.record)
            runs, skipped = start_peers(stack, profile, tree, code, work, args, pub)
            steps += [lambda n=n, r=r: rounds.peer(n, r) for n, r in runs.items()]
            for r in range(repeats):
                for step in steps[r % len(steps):] + steps[: r % len(steps)]:
                    # Nothing left working in the background from the step before.
                    settled.append(round(settle(), 2))
                    step()
    finally:
        mounts.close()
        shutil.rmtree(work, ignore_errors=True)
    results = summarize(rounds, pub, profile, code, tar_zst)
    results["skipped"] = skipped
    results["settle_s"] = settled
    report(results, repeats)
    params = {"quick": args.quick, "repeats": repeats, "profile": profile, "command": code,
              "extract": tar_zst is not None, "peers": not args.no_peers,
              "readme": not args.no_readme, "snapshotter": not args.no_snapshotter,
              "stargz_optimized": args.stargz_optimized}
    path = write_json(NAME, args.out, params, results)
    print(f"\nwrote {path}")
    return 0


def summarize(
    rounds: Rounds, pub: Published, profile: str, code: str, tar_zst: Path | None
) -> dict[str, Any]:
    """Medians, ratios against weenv cold, and the fetched fraction."""
    timings = {name: Timing(tuple(s)) for name, s in rounds.samples.items()}
    weenv_cold = timings["weenv cold"]
    fetched = [f["bytes_fetched"] for f in rounds.fetched]
    plain = [f["bytes_decompressed"] for f in rounds.fetched]
    fraction = max(fetched) / pub.image_bytes
    return {
        "profile": profile,
        "command": f'chroot ROOT /usr/bin/python3 -c "{code}"',
        "image_bytes": pub.image_bytes,
        "stored_bytes": pub.stored_bytes,
        "archive_bytes": tar_zst.stat().st_size if tar_zst is not None else None,
        "contenders": {
            name: {**t.as_dict(), "over_weenv_cold": paired_ratio(t, weenv_cold)}
            for name, t in timings.items()
        },
        "bytes_fetched": fetched,
        "bytes_decompressed": plain,
        "peer_bytes_fetched": rounds.peer_bytes,
        "fetch": rounds.fetched[-1] if rounds.fetched else None,
        "fraction_fetched_of_image": fraction,
        "fraction_decompressed_of_image": ratio(max(plain), pub.image_bytes),
        "fraction_fetched_of_stored": ratio(max(fetched), pub.stored_bytes),
        "budget": {"max_fraction_fetched": BUDGET_FRACTION},
        "within_budget": fraction < BUDGET_FRACTION,
        "weenv_data_path": sorted(rounds.paths),
        "peer_details": rounds.peer_details,
        "snapshotter": snapshotter_ratios(timings),
    }


def snapshotter_ratios(timings: dict[str, Timing]) -> dict[str, Any] | None:
    """How many times faster the weenv snapshotter was than each containerd/Docker peer
    (paired by round), without a hint and with one, and issue 17's budget: at least 3x
    faster than eStargz cold."""
    if LABEL not in timings:
        return None
    peers = (ColdStargzRun.label, ColdContainerdRun.label, DOCKER, STARGZ_OPTIMIZED)
    out: dict[str, Any] = {"budget_over_estargz": BUDGET_OVER_STARGZ}
    for key, label in (("", LABEL), ("hint_", HINTED_LABEL)):
        if label not in timings:
            continue
        speedup = {name: paired_ratio(timings[name], timings[label])
                   for name in peers if name in timings}
        out[f"{key}speedup"] = speedup
        if ColdStargzRun.label in speedup:
            out[f"{key}within_budget"] = speedup[ColdStargzRun.label] >= BUDGET_OVER_STARGZ
    return out


def report(results: dict[str, Any], repeats: int) -> None:
    """The table of contenders and the bytes line."""
    mb = 1e6
    fetched = {name: max(b) / mb for name, b in results["peer_bytes_fetched"].items()}
    fetched["weenv cold"] = max(results["bytes_fetched"]) / mb
    rows = [
        [name, c["median_s"] * 1000, c["spread"], c["over_weenv_cold"],
         fetched.get(name, float("nan"))]
        for name, c in results["contenders"].items()
    ]
    print_table(
        f"cold time-to-ready: {results['command']} (median of {repeats}; ms)",
        ["contender", "ms", "spread", "x weenv cold", "fetched MB"],
        rows,
    )
    print(
        f"\nfetched {max(results['bytes_fetched']) / mb:.1f} MB compressed "
        f"({max(results['bytes_decompressed']) / mb:.1f} MB of file data) of a "
        f"{results['image_bytes'] / mb:.0f} MB image: "
        f"{100 * results['fraction_fetched_of_image']:.1f}% "
        f"(budget < {100 * BUDGET_FRACTION:.0f}%: "
        f"{'within' if results['within_budget'] else 'OVER'} budget)"
    )
    snap = results.get("snapshotter")
    for key, what in (("", "weenv snapshotter"), ("hint_", "weenv snapshotter, hint")):
        if not snap or f"{key}speedup" not in snap:
            continue
        for name, speedup in snap[f"{key}speedup"].items():
            print(f"{what}: {speedup:.3g}x faster than {name} (paired by round)")
        if f"{key}within_budget" in snap:
            print(f"{what} vs eStargz cold: budget >= {BUDGET_OVER_STARGZ:g}x: "
                  f"{'within' if snap[f'{key}within_budget'] else 'SHORT of'} budget")


if __name__ == "__main__":
    sys.exit(main())
