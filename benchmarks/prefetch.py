#!/usr/bin/env python3
"""Benchmark prefetch hints: cold time-to-ready with no hint, with a hint, and with a hint
plus a hint-ordered blob layout, from a local store and from SeaweedFS over loopback.

The reference workload of DESIGN.md: the `reference` Debian sample (python3, numpy, pandas
and pandas' optional backends, about 1.2 GB), `chroot MP python3 -c "import numpy, pandas"`.
Prepared once and cached under the benchmark folder (benchmarks/_mounting.py), with the real
CLI as a user would run it:
1. the tree built as environment `hint-reference:bench` (local store);
2. its hint recorded: `weenv hints record ... --replace -- python3 -c "import numpy, pandas"`;
3. the same tree built again with `weenv build --hint hint-reference:bench --dedup-with
   <the first group>` (hinted chunks rewritten into a blob of their own, in hint order; every
   other chunk reused) and composed as `hint-reference-laid:bench`, whose own hint is then
   recorded the same way (a hint is bound to its manifest).
Each round then runs, in turns, for each store (the local folder; SeaweedFS over loopback;
the same SeaweedFS behind a TCP relay in this process (tcp_relay.py) that delays every byte by
`--delay-ms` each way and limits each connection to `--rate-mbs`, as a remote object store
would): `weenv mount` + the workload in a chroot,
timed together (time-to-ready), with an empty node cache and the page cache dropped:
`no hint` (`--hint none`), `hint` (the default: tag latest), `hint + layout` (the laid-out
environment, tag latest) and, as the floor, `cached` (every chunk already in the node cache,
page cache dropped). After each run it reads `weenv stats` (bytes and requests fetched,
prefetched chunks, hint hits, waste) before unmounting. For SeaweedFS the local store is
copied into a throw-away `weed server -s3` on 127.0.0.1 (weenvfs.store.seaweed).
Docker runs in the same rounds next to SeaweedFS (loopback and shaped): the same tree as a
one-layer image in Debian's docker-registry on 127.0.0.1 (behind the same kind of shaped
proxy for the shaped link), pulled and run by a dockerd this script starts with its own data
root (`--bridge=none --iptables=false --ip-masq=false`); cold = every image removed and the
page cache dropped; timed: `docker pull` + `docker run --rm --network none IMAGE workload`
(docker_tree.py). --no-docker leaves it out. WeEnv's node runs `weenv mountd` (resident, as
dockerd is) unless --no-mountd.

Must not: assert anything about the numbers; it reports them (table on stdout, JSON file,
and with --doc a section appended to docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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
    timed,
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
    weenv,
)
from docker_peer import Dockerd, Registry, docker_unavailable
from docker_tree import ColdDockerRun, push_tree
from tcp_relay import relay

from weenvfs.store import open_store
from weenvfs.tools.sample import sample_tree

NAME = "prefetch"
FULL_REPEATS = 5
WORKLOAD = ("python3", "-c", "import numpy, pandas")
QUICK_WORKLOAD = ("python3", "-c", "import json, sqlite3, decimal")
CONTENDERS = ("no hint", "hint", "hint + layout", "cached")
DOCKER = "docker pull + run"
DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
PATH_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
MB = 1e6

EXAMPLES = """\
examples:
  # full run: reference sample, local store, SeaweedFS, shaped SeaweedFS, 5 rounds
  .venv/bin/python benchmarks/prefetch.py
  # smoke run: the python sample, `import json, sqlite3, decimal`, 1 round
  .venv/bin/python benchmarks/prefetch.py --quick
  # local store only, and add the results to docs/benchmarks.md
  .venv/bin/python benchmarks/prefetch.py --stores local --doc
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser, FULL_REPEATS)
    parser.add_argument("--profile", default=None,
                        help="sample tree (default reference, python with --quick)")
    parser.add_argument("--stores", default="local,seaweed,shaped",
                        help="comma-separated: local, seaweed, shaped (default all three)")
    parser.add_argument("--delay-ms", type=float, default=10.0,
                        help="shaped link: one-way delay in ms (default 10: a 20 ms RTT)")
    parser.add_argument("--rate-mbs", type=float, default=50.0,
                        help="shaped link: MB/s per connection and direction (default 50)")
    parser.add_argument("--no-mountd", action="store_true",
                        help="no resident mount server: mount daemons start a new interpreter")
    parser.add_argument("--no-docker", action="store_true",
                        help="leave Docker out (default: a dockerd and registry of our own)")
    parser.add_argument("--doc", action="store_true",
                        help=f"append the results as a section to {DOC}")
    return parser.parse_args(argv)


# -- preparation (cached) ------------------------------------------------------------------


def _record(store: Path, ref: str, workload: tuple[str, ...], cache: Path) -> None:
    shutil.rmtree(cache, ignore_errors=True)
    weenv("hints", "record", ref, "--store", str(store), "--cache", str(cache), "--replace",
          "--", *workload)


def prepare(profile: str, workload: tuple[str, ...], work: Path) -> tuple[Published, str]:
    """The environment and its hint-ordered twin in one cached local store; their refs."""
    tree = sample_tree(None, profile)
    pub = published(f"hint-{profile}", tree)
    laid = f"hint-{profile}-laid:bench"
    stamp = pub.store.with_name(pub.store.name + ".hints.key")
    key = {"workload": list(workload), "tree_key": pub.store.with_name(
        pub.store.name + ".key").read_text(), "v": 1}
    try:
        fresh = json.loads(stamp.read_text()) == key
    except (OSError, ValueError):
        fresh = False
    if not fresh:
        print(f"recording hints and building the hint-ordered layout of {pub.ref}", flush=True)
        _record(pub.store, pub.ref, workload, work / "record-cache")
        group = f"hint-{profile}-laid-tree:bench"
        weenv("build", str(tree), "--store", str(pub.store), "--group", group, "--hint",
              pub.ref, "--dedup-with", f"hint-{profile}-tree:bench", "--quiet")
        weenv("compose", laid, "--store", str(pub.store), "--group", group)
        _record(pub.store, laid, workload, work / "record-cache")
        stamp.write_text(json.dumps(key, sort_keys=True))
    return pub, laid


def hint_info(store: str, ref: str) -> dict[str, Any]:
    """`weenv hints show --json` of `ref`."""
    return json.loads(weenv("hints", "show", ref, "--store", store, "--json"))


def copy_store(local: Path, url: str) -> int:
    """Copy every object of the local store at `local` to the store at `url`; bytes copied."""
    src, dst = open_store(str(local)), open_store(url)
    keys = list(src.list(""))

    def put(key: str) -> int:
        dst.put_file(key, local / key)
        return (local / key).stat().st_size

    try:
        with ThreadPoolExecutor(8) as pool:
            return sum(pool.map(put, keys))
    finally:
        src.close()
        dst.close()


# -- one cold run ----------------------------------------------------------------------------


class Runner:
    """Cold runs of the workload in mounts made with the real CLI."""

    def __init__(self, work: Path, workload: tuple[str, ...]) -> None:
        self.work = work
        self.workload = workload
        self.mounts = Mounts(work)
        self.mountpoint = work / "mnt"
        self.chroot = shutil.which("chroot", path="/usr/sbin:/usr/bin:/sbin:/bin") or "chroot"

    def run(self, store: str, ref: str, cache: Path, extra: tuple[str, ...],
            keep_cache: bool = False) -> tuple[float, dict[str, Any]]:
        """Time `weenv mount` + the workload (cold: the node service knows nothing of the
        environment); return (seconds, stats document)."""
        forget_environments(store, cache)
        if not keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(exist_ok=True)
        if can_drop_caches():
            drop_caches()
        self.mounts.mountpoints.append(self.mountpoint)
        try:
            seconds, _ = timed(lambda: self._mount_and_run(store, ref, cache, extra))
            stats = json.loads(weenv("stats", "--json", str(self.mountpoint)))
        finally:
            self.mounts.close()
        return seconds, stats

    def _mount_and_run(self, store: str, ref: str, cache: Path, extra: tuple[str, ...]) -> None:
        weenv("--log-file", str(self.work / "mount.log"), "mount", ref, str(self.mountpoint),
              "--store", store, "--cache", str(cache), *extra)
        done = subprocess.run([self.chroot, str(self.mountpoint), *self.workload], env=PATH_ENV,
                              capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            sys.exit(f"the workload failed in {ref}: {done.stderr.strip()[-500:]}")

    def settle(self, store: str, ref: str, cache: Path, extra: tuple[str, ...]) -> None:
        """Fill `cache` with everything `ref` has (a --fetch-all mount until done)."""
        shutil.rmtree(cache, ignore_errors=True)
        self.mountpoint.mkdir(exist_ok=True)
        weenv("mount", ref, str(self.mountpoint), "--store", store, "--cache", str(cache),
              "--fetch-all", *extra)
        self.mounts.mountpoints.append(self.mountpoint)
        try:
            deadline = time.monotonic() + 1800
            while json.loads(weenv("stats", "--json", str(self.mountpoint)))["hints"][
                    "state"] != "done":
                if time.monotonic() > deadline:
                    sys.exit("fetch-all did not finish within 30 minutes")
                time.sleep(0.5)
        finally:
            self.mounts.close()


def summarize(stats: dict[str, Any]) -> dict[str, Any]:
    """What a run's stats say about fetching and prefetching."""
    fetch, hints = stats["fetch"], stats["hints"]
    return {
        "bytes_fetched": fetch["bytes_fetched"],
        "requests": fetch["requests"],
        "demand_misses": fetch["cache_misses"],
        "prefetched_chunks": fetch["prefetch"]["chunks"],
        "prefetched_bytes": fetch["prefetch"]["bytes"],
        "hint_hits": fetch["prefetch"]["hint_hits"],
        "hint_chunks": hints["chunks"],
        "hint_waste": hints["waste"],
        "hint_state": hints["state"],
    }


def measure_store(runner: Runner, store: str, pub: Published, laid: str, repeats: int,
                  docker: ColdDockerRun | None = None) -> dict[str, Any]:
    """Every contender (and Docker's cold pull + run, if given), `repeats` rounds in rotating
    order, on one store."""
    caches = runner.work / "caches"
    warm = caches / "warm"
    runner.settle(store, pub.ref, warm, ("--hint", "none"))
    plans: dict[str, tuple[str, Path, tuple[str, ...], bool]] = {
        "no hint": (pub.ref, caches / "cold", ("--hint", "none"), False),
        "hint": (pub.ref, caches / "cold", (), False),
        "hint + layout": (laid, caches / "cold", (), False),
        "cached": (pub.ref, warm, ("--hint", "none"), True),
    }
    names = (*CONTENDERS, DOCKER) if docker else CONTENDERS
    samples: dict[str, list[float]] = {name: [] for name in names}
    details: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if name == DOCKER:
                assert docker is not None
                seconds, detail = docker.run()
            else:
                ref, cache, extra, keep = plans[name]
                seconds, stats = runner.run(store, ref, cache, extra, keep_cache=keep)
                detail = summarize(stats)
            samples[name].append(seconds)
            details[name].append(detail)
            print(f"  {name:<17} {seconds:7.2f} s  {detail['bytes_fetched'] / MB:7.1f} MB "
                  f"fetched", flush=True)
    timings = {name: Timing(tuple(values)) for name, values in samples.items()}
    out = {}
    for name in names:
        out[name] = {**timings[name].as_dict(),
                     "vs_no_hint": paired_ratio(timings[name], timings["no hint"]),
                     "runs": details[name]}
        if docker:
            out[name]["docker_over_this"] = paired_ratio(timings[DOCKER], timings[name])
    return out


# -- output ----------------------------------------------------------------------------------


def table_rows(results: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for store, per in results["stores"].items():
        for name in [c for c in (*CONTENDERS, DOCKER) if c in per]:  # JSON sorts the keys
            r = per[name]
            last = r["runs"][-1]
            rows.append([
                store, name, r["median_s"], r["vs_no_hint"], r.get("docker_over_this", NA),
                r["spread"], last["bytes_fetched"] / MB,
                *(last.get(k, NA) for k in ("requests", "prefetched_chunks", "hint_hits",
                                            "hint_waste")),
            ])
    return rows


NA = "n/a"
HEADERS = ["store", "contender", "ready s", "vs no hint", "docker / this", "spread",
           "fetched MB", "requests", "prefetched", "hint hits", "waste"]


DOCKER_NOTE = (
    "`docker pull + run` is the same tree as a one-layer image in Debian's docker-registry on "
    "127.0.0.1, behind the same shaped proxy for the shaped rows, pulled by a dockerd of the "
    "script's own (cold: every image removed, page cache dropped) and run with `docker run "
    "--rm --network none IMAGE` + the workload, in the same rounds; `docker / this` is its "
    "time over each row's (paired per round). "
)


def markdown(results: dict[str, Any], params: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of this run."""
    date = time.strftime("%Y-%m-%d")
    lines = [
        "",
        "## Prefetch hints: cold time-to-ready with and without a hint (`benchmarks/prefetch.py`)",
        "",
        "```",
        ".venv/bin/python benchmarks/prefetch.py          # as published below",
        ".venv/bin/python benchmarks/prefetch.py --quick  # smoke run, python sample",
        "```",
        "",
        f"Workload `chroot MP {shlex.join(params['workload'])}` on the `{params['profile']}` "
        f"sample ({params['image_bytes'] / MB:,.0f} MB of files); each run is `weenv mount` + "
        "the workload, timed together, with an empty node cache and a dropped page cache "
        "(`cached`: every chunk already in the node cache, the floor). `hint + layout` is the "
        "same tree rebuilt with `weenv build --hint` (hinted chunks in a blob of their own, in "
        "hint order; everything else deduplicated against the first build), with its own "
        "recorded hint. The shaped link is a TCP proxy in front of SeaweedFS that delays each "
        f"direction by {params['shaped_delay_ms']:g} ms and limits each connection to "
        f"{params['shaped_rate_mbs']:g} MB/s. " + (DOCKER_NOTE if params.get("docker") ==
                                                  "measured" else "")
        + f"{params['repeats']} rounds, {date}; "
        "`fetched` ... `waste` are from the last round; full data in "
        "`benchmarks/results/prefetch.json`.",
        "",
    ]
    for ref, info in results["hints"].items():
        lines.append(
            f"- hint of `{ref}`: {info['chunks']} chunks, {info['bytes'] / MB:.1f} MB "
            f"({info['stored_bytes'] / MB:.1f} MB stored) in {info['blobs']} blob(s), "
            f"{info['ranged_requests']} ranged requests to replay"
        )
    lines += [
        "",
        "| store | contender | time-to-ready | vs no hint | docker / this | spread | fetched "
        "| requests | prefetched chunks | hint hits | waste |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in table_rows(results):
        store, name, med, ratio, over, spread, fetched, req, pre, hits, waste = row
        over_text = f"{over:.1f}x" if isinstance(over, float) else over
        lines.append(
            f"| {store} | {name} | {med:.2f} s | **{ratio:.2f}** | {over_text} | {spread:.0%} | "
            f"{fetched:.1f} MB | {req} | {pre} | {hits} | {waste} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repeats = repeats_for(args, FULL_REPEATS)
    profile = args.profile or ("python" if args.quick else "reference")
    workload = QUICK_WORKLOAD if args.quick else WORKLOAD
    stores = [s for s in args.stores.split(",") if s]
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine(), flush=True)
    if os.geteuid() != 0:
        sys.exit("run as root: the workload runs in a chroot")
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="weenv-prefetch-", dir=BENCH_DIR))
    runner = Runner(work, workload)
    results: dict[str, Any] = {"stores": {}, "hints": {}}
    why_not = ("--no-docker" if args.no_docker else
               "only next to SeaweedFS (--stores seaweed or shaped)"
               if not {"seaweed", "shaped"} & set(stores) else docker_unavailable())
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mount_server(work / "mountd", not args.no_mountd))
            pub, laid = prepare(profile, workload, work)
            for ref in (pub.ref, laid):
                results["hints"][ref] = hint_info(str(pub.store), ref)
            docker = None if why_not else _start_docker(stack, work, pub, profile)
            if "local" in stores:
                print("local store", flush=True)
                results["stores"]["local"] = measure_store(runner, str(pub.store), pub, laid,
                                                           repeats)
            if "seaweed" in stores or "shaped" in stores:
                results["stores"].update(_seaweed(runner, pub, laid, repeats, args, stores,
                                                  docker))
    finally:
        runner.mounts.close()
        shutil.rmtree(work, ignore_errors=True)
    params = {"profile": profile, "workload": list(workload), "repeats": repeats,
              "stores": stores, "image_bytes": pub.image_bytes, "stored_bytes": pub.stored_bytes,
              "shaped_delay_ms": args.delay_ms, "shaped_rate_mbs": args.rate_mbs,
              "docker": f"not measured: {why_not}" if why_not else "measured",
              "mountd": not args.no_mountd}
    print_table("cold time-to-ready (mount + workload)", HEADERS, table_rows(results))
    path = write_json(NAME, args.out, params, results)
    print(f"\nwrote {path}")
    if args.doc:
        with DOC.open("a", encoding="utf-8") as f:
            f.write(markdown(results, params))
        print(f"appended a section to {DOC}")
    return 0


class DockerRig:
    """Our dockerd, and a registry (on 127.0.0.1) holding the tree as image `name`."""

    def __init__(self, dockerd: Dockerd, registry: Registry, name: str,
                 workload: tuple[str, ...]) -> None:
        self.dockerd, self.registry, self.name, self.workload = dockerd, registry, name, workload

    def cold_run(self, port: int | None = None) -> ColdDockerRun:
        """Cold pull + run from the registry, or through a proxy of it on 127.0.0.1:`port`."""
        host = f"127.0.0.1:{port}" if port else self.registry.host
        return ColdDockerRun(self.dockerd, self.registry, host, self.name, self.workload)


def _start_docker(stack: contextlib.ExitStack, work: Path, pub: Published,
                  profile: str) -> DockerRig:
    """Start our dockerd (data root in `work`) and the registry (kept between runs under the
    benchmark folder), and push the tree there once."""
    folder = BENCH_DIR / "prefetch-docker"
    registry = Registry(folder / "registry").start()
    stack.callback(registry.stop)
    dockerd = Dockerd(work / "docker").start()
    stack.callback(dockerd.stop)
    name = f"hint-{profile}"
    key = {"tree_key": pub.store.with_name(pub.store.name + ".key").read_text(), "v": 1}
    push_tree(sample_tree(None, profile, progress=False), key, registry, name, folder / "layers")
    workload = QUICK_WORKLOAD if profile == "python" else WORKLOAD
    return DockerRig(dockerd, registry, name, workload)


def _seaweed(runner: Runner, pub: Published, laid: str, repeats: int,
             args: argparse.Namespace, stores: list[str],
             docker: DockerRig | None) -> dict[str, Any]:
    from weenvfs.store.seaweed import REGION, SeaweedFS

    out: dict[str, Any] = {}
    with SeaweedFS() as server:  # a temp folder, removed at stop
        os.environ.update(server.env())  # the CLI and its daemons read these credentials
        url = server.url("prefetch")
        seconds, copied = timed(lambda: copy_store(pub.store, url))
        print(f"SeaweedFS: {copied / MB:.0f} MB copied in {seconds:.0f} s", flush=True)
        if "seaweed" in stores:
            print("SeaweedFS over loopback", flush=True)
            out["seaweedfs"] = measure_store(runner, url, pub, laid, repeats,
                                             docker.cold_run() if docker else None)
        if "shaped" in stores:
            delay, rate = args.delay_ms / 1000, args.rate_mbs * MB
            with contextlib.ExitStack() as links:
                port = links.enter_context(relay(("127.0.0.1", server.ports["s3"]),
                                                       delay, rate))
                shaped = f"s3://{server.bucket}/prefetch?endpoint=http://127.0.0.1:{port}" \
                         f"&region={REGION}"
                cold_docker = None
                if docker:  # the registry behind a link shaped the same way
                    registry_port = links.enter_context(relay(
                        ("127.0.0.1", docker.registry.port), delay, rate))
                    cold_docker = docker.cold_run(registry_port)
                name = f"seaweedfs, {2 * args.delay_ms:g} ms RTT, {args.rate_mbs:g} MB/s"
                print(name, flush=True)
                out[name] = measure_store(runner, shaped, pub, laid, repeats, cold_docker)
    return out


if __name__ == "__main__":
    sys.exit(main())
