#!/usr/bin/env python3
"""Benchmark the sandbox runtime (issue 7) next to its competitors, in the same run.

Owns these measurements (results summarized in docs/benchmarks.md):
1. Time to ready: create a sandbox of an environment whose mount is warm (another sandbox
   holds it) and run `true` in it (`Environment.open` + `exec`), against `docker run --rm
   --network none` of the same tree as an image already on the node (`docker import`), and
   against `bwrap` running `true` over a local directory holding the same tree (read-only
   bind, new pid/net/ipc/uts namespaces: no writable layer, no cgroup, so a lower bound).
   The same as the README's `weenv run --store STORE ENV true` (the installed entry point,
   one process per run), carried out by the node service (the default) and by the client
   itself (WEENV_NODE_RUN=off), against `docker run --rm`.
2. One more command in a running sandbox (`exec true`) against `docker exec` in a running
   container and one more `bwrap ... true`.
   Steps 1 and 2 also run WeEnv's sandboxes under runc ($WEENV_RUNTIME=runc) next to the
   default (crun where installed: weenvfs/runtime/runtimes.py), so the two OCI runtimes are
   compared in the same rounds.
3. Reset (back to the pristine tree, after the episode wrote files) against tearing the
   sandbox down and creating a new one, with the writable layer on disk and on tmpfs; and
   against what Docker offers for the same: `docker rm -f` of the dirty container and
   `docker run -d` of a new one.
4. For reference: teardown, and a cold start (no mount yet, chunks cached) to `true`.
5. (Since 2026-12-05, with the node service) the README's `weenv run ... true` with no node
   service running, as the first run after a boot or after the service idled out: the run
   starts it, and it forks the mounts; against the same run with the service up and the
   mounts evicted (chunks cached in both).
The environment is the cached Debian minbase sample (tools/sample.py), built into a
temporary local store, unless --store and --ref name another one. Docker is a dockerd this
script starts with its own data root (`--bridge=none --iptables=false --ip-masq=false`,
benchmarks/docker_peer.py) and stops at the end; --no-docker leaves it out. WeEnv's node
runs `weenv mountd` (resident, as dockerd is) unless --no-mountd.

Must not: assert anything about the numbers; it reports them (table on stdout, JSON file).
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
    measure,
    measure_interleaved,
    paired_ratio,
    print_table,
    repeats_for,
    write_json,
)
from _mounting import environment, evict_shared_mounts, mount_server, weenv
from docker_peer import DOCKER, Dockerd, docker_unavailable

from weenvfs.native_programs import weenv_command
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.runtimes import RUNTIME_ENV, default_launcher
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group, open_source
from weenvfs.tools.publish import compose_env
from weenvfs.tools.sample import sample_tree

NAME = "runtime"
RUNC_CREATE = "weenv create + true (runc)"
RUNC_CLI = "weenv run true (CLI, runc)"
SERVICE_DOWN = "weenv run true (CLI), no node service running"
SERVICE_UP = "weenv run true (CLI), node service up, mounts evicted"
RUNC_EXEC = "weenv exec true (runc)"
FULL_REPEATS = 15
DIRTY_FILES = 200  # files an episode writes before a reset (so the upper is not empty)
DIRTY_EPISODE = (f"mkdir -p /root/ep && for i in $(seq {DIRTY_FILES}); do echo $i > "
                 "/root/ep/$i; done; rm -rf /etc/apt")
BWRAP = ("bwrap --ro-bind {tree} / --proc /proc --dev /dev --tmpfs /tmp --unshare-pid "
         "--unshare-net --unshare-ipc --unshare-uts --die-with-parent true")
EXAMPLES = """\
examples:
  # full run (15 rounds) on the Debian minbase sample
  .venv/bin/python benchmarks/runtime.py
  # smoke run: 1 round
  .venv/bin/python benchmarks/runtime.py --quick
  # another environment of an existing store
  .venv/bin/python benchmarks/runtime.py --store /srv/weenv --ref py:3.11
"""


def publish_sample(work: Path) -> tuple[str, Path, Path]:
    """Build the minbase sample into a new local store under `work`; (ref, store, tree)."""
    tree = sample_tree(None, "minbase", progress=False)
    store_dir = work / "store"
    store = open_store(str(store_dir), create=True)
    try:
        repo = Repository(store)
        build_group(open_source(tree), repo, "minbase", "bench")
        compose_env(repo, "bench-minbase", "latest", ["minbase:bench"])
    finally:
        store.close()
    return "bench-minbase:latest", store_dir, tree


def export(ref: str, store: Path, dest: Path) -> Path:
    """`weenv export` of `ref` into `dest` (the local directory bwrap and Docker use)."""
    subprocess.run([sys.executable, "-m", "weenvfs", "export", ref, str(dest), "--store",
                    str(store)], check=True)
    return dest


class Bench:
    """The environment under test."""

    def __init__(self, ref: str, store: Path, cache: Path) -> None:
        self.ref, self.store, self.cache = ref, store, cache

    def open(self, tmpfs: bool = False, runtime: str | None = None) -> Environment:
        """A sandbox (under OCI runtime `runtime`, default: the node's default)."""
        # Steady state: no first-run hint recording (it would put one create on a private
        # recording mount; benchmarks/prefetch.py measures hints).
        with environment(**({RUNTIME_ENV: runtime} if runtime else {})):
            return Environment.open(self.ref, store=self.store, cache=self.cache,
                                    tmpfs_upper=tmpfs, record_hint=False)

    def cli_run_true(self, node_service: bool,
                     runtime: str | None = None) -> Callable[[], object]:
        """`weenv run ... true` as the README runs it (the installed entry point), carried
        out by the node service or (WEENV_NODE_RUN=off) by the client itself."""
        argv = [*weenv_command(), "run", "--store", str(self.store), "--cache", str(self.cache),
                "--no-record-hint", self.ref, "true"]
        env = {**os.environ, "WEENV_NODE_RUN": "on" if node_service else "off",
               **({RUNTIME_ENV: runtime} if runtime else {})}
        return lambda: subprocess.run(argv, env=env, check=True, capture_output=True)

    def create_and_true(self, runtime: str | None = None) -> None:
        env = self.open(runtime=runtime)
        try:
            env.exec(["true"])
        finally:
            env.close()

    def dirty(self, env: Environment) -> None:
        """What an episode might leave: new files, a deleted directory."""
        env.exec(DIRTY_EPISODE)


def _clock(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_ready(b: Bench, tree: Path, docker: DockerSide | None,
                repeats: int) -> dict[str, Any]:
    """1 and 2: create + true on a warm mount, and exec true, against Docker and bwrap."""
    bwrap = BWRAP.format(tree=tree).split()
    holder = b.open()  # keeps the environment mounted (its chunks are cached already)
    runc_holder = b.open(runtime="runc") if default_launcher().name != "runc" else None
    running = docker.create() if docker else ""
    try:
        contenders: dict[str, Callable[[], object]] = {
            "weenv create + true": b.create_and_true,
            "weenv run true (CLI)": b.cli_run_true(True),
            "weenv run true (CLI, WEENV_NODE_RUN=off)": b.cli_run_true(False),
            "bwrap true": lambda: subprocess.run(bwrap, check=True),
        }
        execs: dict[str, Callable[[], object]] = {
            "weenv exec true": lambda: holder.exec(["true"]),
            "bwrap true": lambda: subprocess.run(bwrap, check=True),
        }
        if runc_holder is not None:
            contenders[RUNC_CREATE] = lambda: b.create_and_true("runc")
            contenders[RUNC_CLI] = b.cli_run_true(True, "runc")
            execs[RUNC_EXEC] = lambda: runc_holder.exec(["true"])
        if docker:
            contenders["docker run --rm true"] = docker.run_true
            execs["docker exec true"] = lambda: docker.exec_true(running)
        ready = measure_interleaved(contenders, repeats)
        exec_true = measure_interleaved(execs, repeats)
        close = []
        for _ in range(repeats):
            env = b.open()
            close.append(_clock(env.close))
    finally:
        holder.close()
        if runc_holder is not None:
            runc_holder.close()
        if docker:
            docker.remove(running)
    out = {
        "create_and_true": {k: v.as_dict() for k, v in ready.items()},
        "create_vs_bwrap": paired_ratio(ready["weenv create + true"], ready["bwrap true"]),
        "exec_true": {k: v.as_dict() for k, v in exec_true.items()},
        "exec_vs_bwrap": paired_ratio(exec_true["weenv exec true"], exec_true["bwrap true"]),
        "close": Timing(tuple(close)).as_dict(),
        "bwrap_command": BWRAP.format(tree=tree),
    }
    out["cli_run_node_vs_own"] = paired_ratio(
        ready["weenv run true (CLI)"], ready["weenv run true (CLI, WEENV_NODE_RUN=off)"])
    out["runtime"] = default_launcher().name
    if runc_holder is not None:
        out["create_vs_runc"] = paired_ratio(ready["weenv create + true"], ready[RUNC_CREATE])
        out["cli_run_vs_runc"] = paired_ratio(ready["weenv run true (CLI)"], ready[RUNC_CLI])
        out["exec_vs_runc"] = paired_ratio(exec_true["weenv exec true"], exec_true[RUNC_EXEC])
    if docker:
        out["create_vs_docker"] = paired_ratio(ready["weenv create + true"],
                                               ready["docker run --rm true"])
        out["cli_run_vs_docker"] = paired_ratio(ready["weenv run true (CLI)"],
                                                ready["docker run --rm true"])
        out["exec_vs_docker"] = paired_ratio(exec_true["weenv exec true"],
                                             exec_true["docker exec true"])
    return out


class DockerSide:
    """The same tree as a Docker image on our own dockerd: what Docker does for the same
    steps (the image is already on the node, as a warm mount is for WeEnv)."""

    IMAGE = "weenv-bench-runtime:latest"

    def __init__(self, dockerd: Dockerd, tree: Path) -> None:
        self.docker = dockerd.docker
        self._count = 0
        tar = subprocess.Popen(["tar", "-C", str(tree), "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        subprocess.run([DOCKER, "import", "-", self.IMAGE], stdin=tar.stdout, check=True,
                       capture_output=True, env=dockerd.env())
        if tar.wait() != 0:
            raise RuntimeError(f"tar of {tree} failed")

    def run_true(self) -> None:
        self.docker("run", "--rm", "--network", "none", self.IMAGE, "true")

    def create(self) -> str:
        """A long-lived container (`sleep infinity`), what a rollout then runs commands in."""
        self._count += 1
        name = f"weenv-bench-runtime-{self._count}"
        self.docker("run", "-d", "--network", "none", "--name", name, self.IMAGE,
                    "sleep", "infinity")
        return name

    def exec_true(self, name: str) -> None:
        self.docker("exec", name, "true")

    def dirty(self, name: str) -> None:
        self.docker("exec", name, "sh", "-c", DIRTY_EPISODE)

    def remove(self, name: str) -> None:
        self.docker("rm", "-f", name)


def bench_reset(b: Bench, repeats: int, tmpfs: bool) -> dict[str, Any]:
    """3: reset after an episode that wrote files, against close + create of a new sandbox
    (after the same episode). Each round times one of each, in alternating order."""
    holder = b.open()
    env, fresh = b.open(tmpfs), b.open(tmpfs)
    reset, recreate = [], []
    try:
        for r in range(max(1, repeats)):
            b.dirty(env)
            b.dirty(fresh)

            def renew() -> None:
                nonlocal fresh
                fresh.close()
                fresh = b.open(tmpfs)

            if r % 2:
                recreate.append(_clock(renew))
                reset.append(_clock(env.reset))
            else:
                reset.append(_clock(env.reset))
                recreate.append(_clock(renew))
    finally:
        for e in (env, fresh, holder):
            e.close()
    reset_t, recreate_t = Timing(tuple(reset)), Timing(tuple(recreate))
    return {
        "upper": "tmpfs" if tmpfs else "disk",
        "reset": reset_t.as_dict(),
        "close_and_create": recreate_t.as_dict(),
        "reset_vs_recreate": paired_ratio(reset_t, recreate_t),
    }


def bench_docker_reset(b: Bench, docker: DockerSide, repeats: int) -> dict[str, Any]:
    """3, Docker's side: Docker has no reset, so a pristine container after an episode is
    `docker rm -f` of the dirty one and `docker run -d` of a new one; timed in the same
    rounds as a WeEnv reset (disk upper) after the same episode, alternating which goes
    first."""
    holder = b.open()
    env = b.open()
    container = docker.create()
    reset, replace = [], []

    def renew() -> None:
        nonlocal container
        docker.remove(container)
        container = docker.create()

    try:
        for r in range(max(1, repeats)):
            b.dirty(env)
            docker.dirty(container)
            order = [(reset, env.reset), (replace, renew)]
            for samples, step in order[::-1] if r % 2 else order:
                samples.append(_clock(step))
    finally:
        env.close()
        holder.close()
        docker.remove(container)
    reset_t, replace_t = Timing(tuple(reset)), Timing(tuple(replace))
    return {"reset": reset_t.as_dict(), "docker_rm_and_run": replace_t.as_dict(),
            "reset_vs_docker": paired_ratio(reset_t, replace_t)}


def bench_cold(b: Bench, repeats: int) -> dict[str, Any]:
    """4: no mount yet (chunks cached): the first sandbox mounts, then runs `true`."""
    return {"cold_mount_create_and_true": measure(b.create_and_true, repeats).as_dict()}


def bench_service_start(b: Bench, repeats: int) -> dict[str, Any]:
    """6: the README's `weenv run ... true` with no node service running, as the first run
    after a boot or after the service idled out (its mounts gone before it): the run starts
    the service, which forks the mounts; against the same run with the service up and the
    mounts evicted. Chunks cached in both; set-up untimed; the two alternate."""
    run = b.cli_run_true(True)
    samples: dict[str, list[float]] = {SERVICE_DOWN: [], SERVICE_UP: []}
    for r in range(max(1, repeats)):
        for name in (SERVICE_DOWN, SERVICE_UP)[::1 if r % 2 == 0 else -1]:
            evict_shared_mounts()
            if name == SERVICE_DOWN:
                weenv("mountd", "--stop")
            samples[name].append(_clock(run))
    timings = {name: Timing(tuple(values)) for name, values in samples.items()}
    return {"runs": {k: v.as_dict() for k, v in timings.items()},
            "down_vs_up": paired_ratio(timings[SERVICE_DOWN], timings[SERVICE_UP])}


def report(results: dict[str, Any], repeats: int) -> None:
    ready, rows = results["ready"], []
    for name, t in ready["create_and_true"].items():
        rows.append((name, t["median_s"] * 1000, t["spread"]))
    for name, t in ready["exec_true"].items():
        rows.append((f"(running) {name}", t["median_s"] * 1000, t["spread"]))
    rows.append(("weenv close (teardown)", ready["close"]["median_s"] * 1000,
                 ready["close"]["spread"]))
    for r in results["reset"]:
        rows.append((f"reset, {r['upper']} upper", r["reset"]["median_s"] * 1000,
                     r["reset"]["spread"]))
        rows.append((f"close + create, {r['upper']} upper",
                     r["close_and_create"]["median_s"] * 1000, r["close_and_create"]["spread"]))
    docker_reset = results.get("docker_reset")
    if docker_reset:
        t = docker_reset["docker_rm_and_run"]
        rows.append(("docker rm -f + run -d (new container)", t["median_s"] * 1000,
                     t["spread"]))
    cold = results["cold"]["cold_mount_create_and_true"]
    rows.append(("cold: mount + create + true", cold["median_s"] * 1000, cold["spread"]))
    for name, t in results.get("service_start", {}).get("runs", {}).items():
        rows.append((name, t["median_s"] * 1000, t["spread"]))
    print_table(f"sandbox runtime ({ready.get('runtime', 'runc')}), {repeats} rounds (median)",
                ["what", "ms", "spread"], rows)
    ratios = [("weenv create + true / bwrap true", ready["create_vs_bwrap"]),
              ("weenv exec true / bwrap true", ready["exec_vs_bwrap"]),
              ("weenv run (node service) / weenv run (own process)",
               ready["cli_run_node_vs_own"])]
    if "create_vs_docker" in ready:
        ratios += [("weenv create + true / docker run --rm true", ready["create_vs_docker"]),
                   ("weenv run true / docker run --rm true", ready["cli_run_vs_docker"]),
                   ("weenv exec true / docker exec true", ready["exec_vs_docker"])]
    ratios += [(f"reset / (close + create), {r['upper']}", r["reset_vs_recreate"])
               for r in results["reset"]]
    if docker_reset:
        ratios.append(("weenv reset / (docker rm -f + run -d)", docker_reset["reset_vs_docker"]))
    if "exec_vs_runc" in ready:
        ratios += [(f"weenv create + true: {ready['runtime']} / runc", ready["create_vs_runc"]),
                   (f"weenv run true: {ready['runtime']} / runc", ready["cli_run_vs_runc"]),
                   (f"weenv exec true: {ready['runtime']} / runc", ready["exec_vs_runc"])]
    print_table("ratios (paired, median over rounds)", ["ratio", "x"], ratios)
    print(f"\ndocker: {results['docker']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/runtime.py",
        description=(__doc__ or "").split("\n\nMust not")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser, FULL_REPEATS)
    parser.add_argument("--store", help="an existing store (default: build the sample)")
    parser.add_argument("--ref", help="environment in --store (with --store)")
    parser.add_argument("--no-mountd", action="store_true",
                        help="no resident mount server: mount daemons start a new interpreter")
    parser.add_argument("--no-docker", action="store_true",
                        help="leave Docker out (default: start a dockerd of our own)")
    parser.add_argument("--work", type=Path, metavar="DIR",
                        help="scratch folder (default: a new temporary folder, removed after)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repeats = repeats_for(args, FULL_REPEATS)
    for tool in ("runc", "bwrap", "catatonit"):
        if shutil.which(tool) is None:
            sys.exit(f"runtime.py: {tool} not found (Debian packages runc, bubblewrap, catatonit)")
    if args.store and not args.ref:
        sys.exit("runtime.py: --store needs --ref")
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    work = Path(tempfile.mkdtemp(prefix="weenv-bench-runtime-", dir=args.work))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mount_server(work / "mountd", not args.no_mountd))
            if args.store:
                ref, store = args.ref, Path(args.store).absolute()
                tree = export(ref, store, work / "tree")
            else:
                ref, store, tree = publish_sample(work)
            bench = Bench(ref, store, work / "cache")
            why_not = "--no-docker" if args.no_docker else docker_unavailable()
            docker = None
            if why_not is None:
                dockerd = Dockerd(work / "docker").start()
                stack.callback(dockerd.stop)
                docker = DockerSide(dockerd, tree)
            results: dict[str, Any] = {"ref": ref, "mountd": not args.no_mountd,
                                       "docker": f"not measured: {why_not}" if why_not
                                       else "dockerd of this run, image imported from the tree"}
            results["cold"] = bench_cold(bench, 1)  # fills the chunk cache; mounts are warm
            results["ready"] = bench_ready(bench, tree, docker, repeats)
            results["reset"] = [bench_reset(bench, repeats, tmpfs) for tmpfs in (False, True)]
            if docker:
                results["docker_reset"] = bench_docker_reset(bench, docker, repeats)
            results["cold"] = bench_cold(bench, repeats)
            if not args.no_mountd:
                results["service_start"] = bench_service_start(bench, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, repeats)
    path = write_json(NAME, args.out, {"quick": args.quick, "repeats": repeats,
                                       "dirty_files": DIRTY_FILES}, results)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
