"""`weenv demo`: the end-to-end job on the embedded default (a local directory store).

Builds a sample Debian + Python tree once (debootstrap, cached), publishes it as a layer group
into a local store and composes an environment, then runs one command in it with `weenv run`,
as a user would, three times: on a cold node with no hint yet (empty node cache, nothing of it
mounted; the page cache is left as it is: the run records what it reads and the node service
publishes it as the environment's prefetch hint), on a cold node again (now replaying that
hint), and warm (the node service keeps the mounts). Prints each time, and the share of the
image the cold start with the hint fetched. The demo's mounts live in a folder of its own
under WORKDIR and are all evicted at the end, also on failure; the node service `weenv run`
started stays (it exits after ten idle minutes; `weenv mountd --stop` ends it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from weenvfs.cli import add_command
from weenvfs.cli_args import print_json
from weenvfs.errors import RefNotFound, UsageError, WeenvError
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.native_programs import weenv_command
from weenvfs.runtime import mounts, recording
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group
from weenvfs.tools.inspect import inspect_env
from weenvfs.tools.progress import Progress
from weenvfs.tools.publish import compose_env
from weenvfs.tools.sample import sample_tree
from weenvfs.units import format_size

DEFAULT_WORKDIR = Path("/var/tmp/weenv-demo")
DEMO_COMMAND = (
    "/usr/bin/python3",
    "-c",
    "import json, sqlite3, sys; print('hello from', sys.version.split()[0], 'in weenv')",
)
ENV_REF = "demo/python:latest"
HINT_WAIT = 60.0  # seconds the demo waits for the node service to publish the first run's hint


def _weenv(*args: str, env: dict[str, str], capture: bool = False) -> str:
    """Run the weenv CLI as a user would; raise WeenvError with its message on failure."""
    proc = subprocess.run([*weenv_command(), *args], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        raise WeenvError(lines[-1] if lines else f"weenv {args[0]} failed ({proc.returncode})")
    return proc.stdout if capture else ""


def _publish(tree: Path, store_url: str, quiet: bool) -> tuple[str, int]:
    """Build the sample tree as group demo/debian-python and compose env demo/python, with no
    hint (a hint of an earlier demo is removed, so that the first run records one); the
    environment's digest and its size in bytes of files."""
    with open_store(store_url, create=True) as store:
        repo = Repository(store)
        progress = Progress(sys.stderr, mode="quiet" if quiet else "auto")
        result = build_group(_open_dir(tree), repo, "demo/debian-python", "latest",
                             progress=progress)
        config = RuntimeConfig(env=("PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"), cwd="/")
        compose_env(repo, "demo/python", "latest", ["demo/debian-python:latest"], config)
        digest, _ = repo.resolve_env(ENV_REF)
        with contextlib.suppress(RefNotFound):
            repo.get_tag("hints", digest, recording.HINT_TAG)
            repo.delete_tag("hints", digest, recording.HINT_TAG)
        _, report = inspect_env(repo, ENV_REF)
    print(f"published: {result.as_dict().get('bytes_new', 0)} new bytes", file=sys.stderr)
    return digest, int(report["size"]["file_bytes"])


def _open_dir(tree: Path):  # noqa: ANN202 - the builder's Source protocol
    from weenvfs.tools.builder import open_source

    return open_source(tree)


def _wait_for_hint(store_url: str, digest: str) -> bool:
    """Whether the first run's hint was published within HINT_WAIT seconds (the node service
    publishes it once the run's recording mount is unmounted)."""
    deadline = time.monotonic() + HINT_WAIT
    with open_store(store_url) as store:
        repo = Repository(store)
        while True:
            with contextlib.suppress(RefNotFound):
                repo.get_tag("hints", digest, recording.HINT_TAG)
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def _evict_all(env: dict[str, str]) -> None:
    """Unmount every mount of the demo's own folder of shared mounts (parked roots first)."""
    _weenv("mounts", "evict", "--all", "--force", "--quiet", env=env)


def _fetched(env: dict[str, str]) -> int:
    """Bytes the demo's shared mounts fetched so far (their `weenv stats`)."""
    total = 0
    for row in json.loads(_weenv("mounts", "--json", env=env, capture=True)):
        stats = json.loads(_weenv("stats", str(row["mountpoint"]), "--json", env=env,
                                  capture=True))
        total += int(stats["fetch"]["bytes_fetched"])
    return total


@contextlib.contextmanager
def _demo_mounts(workdir: Path) -> Iterator[dict[str, str]]:
    """The environment of the demo's commands: its shared mounts in WORKDIR/envs, kept warm
    between its runs; all of them evicted when the block ends."""
    env = {**os.environ, mounts.ROOT_ENV: str(workdir / "envs"), mounts.KEEP_WARM_ENV: "600"}
    env.pop(recording.SWITCH_ENV, None)  # the default: a first run records its hint
    _evict_all(env)  # what an interrupted demo left
    try:
        yield env
    finally:
        _evict_all(env)


def _timed_run(store_url: str, cache: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.monotonic()
    out = _weenv("run", "--store", store_url, "--cache", str(cache), ENV_REF, *DEMO_COMMAND,
                 env=env, capture=True)
    return time.monotonic() - start, out.strip()


def run_demo(args: argparse.Namespace) -> int:
    """Build (once), publish, then `weenv run` cold (first run), cold with its hint, warm."""
    if os.geteuid() != 0:
        raise UsageError("weenv demo runs sandboxes (weenv run): run it as root")
    workdir: Path = args.workdir
    store_url = str(workdir / "store")
    cache = workdir / "cache"
    tree = sample_tree(None, args.profile, progress=not args.quiet)
    digest, image_bytes = _publish(tree, store_url, args.quiet)
    with _demo_mounts(workdir) as env:
        shutil.rmtree(cache, ignore_errors=True)  # a cold node: nothing cached, nothing mounted
        first_s, out = _timed_run(store_url, cache, env)
        hinted = _wait_for_hint(store_url, digest)
        _evict_all(env)
        shutil.rmtree(cache, ignore_errors=True)
        cold_s, _ = _timed_run(store_url, cache, env)
        fetched = _fetched(env)
        warm_s, _ = _timed_run(store_url, cache, env)
    summary = {
        "environment": ENV_REF,
        "command_output": out,
        "first_run_s": round(first_s, 3),
        "hint_recorded": hinted,
        "time_to_ready_s": round(cold_s, 3),
        "warm_s": round(warm_s, 3),
        "image_bytes": image_bytes,
        "bytes_fetched": fetched,
        "fraction_fetched": round(fetched / image_bytes, 4) if image_bytes else 0.0,
    }
    if args.json:
        print_json(summary)
        return 0
    print(out)
    print(f"weenv run {ENV_REF} (store {store_url}), to the command's exit:")
    print(f"  cold node, first run (records the hint)  {first_s * 1000:6.0f} ms")
    print(f"  cold node, {'with that hint' if hinted else 'no hint published':28s}"
          f"  {cold_s * 1000:6.0f} ms   fetched {format_size(fetched)} of a "
          f"{format_size(image_bytes)} image ({100 * summary['fraction_fetched']:.1f}%)")
    print(f"  warm (the node kept its mounts)          {warm_s * 1000:6.0f} ms")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `weenv demo`."""
    parser = add_command(
        subparsers,
        "demo",
        help="build a sample environment and weenv run a command in it, cold and warm",
        description=__doc__.split("\n\n")[1],
        examples=["weenv demo", "weenv demo --profile python --json"],
        func=run_demo,
    )
    parser.add_argument("--profile", default="python", help="sample tree (default: python)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                        help=f"its store, node cache and mounts (default {DEFAULT_WORKDIR})")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
