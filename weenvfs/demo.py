"""`weenv demo`: the end-to-end job on the embedded default (a local directory store).

Builds a sample Debian + Python tree once (debootstrap, cached), publishes it as a layer group
into a local store, composes an environment, then does a cold start: empty node cache, lazy
mount, one command inside with chroot. Prints time-to-ready and the fraction of the image that
had to be fetched. Everything it mounts is unmounted, also on failure. It drives the same CLI a
user would (mount, stats, umount), so it shows what a user gets.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from weenvfs.cli import add_command
from weenvfs.cli_args import print_json
from weenvfs.errors import WeenvError
from weenvfs.format.manifest import RuntimeConfig
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


def _weenv(*args: str, capture: bool = False) -> str:
    """Run the weenv CLI as a user would; raise WeenvError with its message on failure."""
    proc = subprocess.run(
        [sys.executable, "-m", "weenvfs", *args], capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise WeenvError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "weenv failed")
    return proc.stdout if capture else ""


def _publish(tree: Path, store_url: str, quiet: bool) -> tuple[str, int]:
    """Build the sample tree as group demo/debian-python and compose env demo/python."""
    repo = Repository(open_store(store_url, create=True))
    progress = Progress(sys.stderr, mode="quiet" if quiet else "auto")
    result = build_group(_open_dir(tree), repo, "demo/debian-python", "latest", progress=progress)
    config = RuntimeConfig(env=("PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"), cwd="/")
    compose_env(repo, "demo/python", "latest", ["demo/debian-python:latest"], config)
    _, report = inspect_env(repo, "demo/python:latest")
    print(f"published: {result.as_dict().get('bytes_new', 0)} new bytes", file=sys.stderr)
    return "demo/python:latest", int(report["size"]["file_bytes"])


def _open_dir(tree: Path):  # noqa: ANN202 - the builder's Source protocol
    from weenvfs.tools.builder import open_source

    return open_source(tree)


def run_demo(args: argparse.Namespace) -> int:
    """Build (once), publish, cold-mount, run, report, unmount."""
    workdir: Path = args.workdir
    store_url = str(workdir / "store")
    cache = workdir / "cache"
    mountpoint = workdir / "mnt"
    tree = sample_tree(None, args.profile, progress=not args.quiet)
    ref, image_bytes = _publish(tree, store_url, args.quiet)
    shutil.rmtree(cache, ignore_errors=True)  # a cold node: nothing cached
    mountpoint.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    _weenv("mount", ref, str(mountpoint), "--store", store_url, "--cache", str(cache))
    try:
        out = subprocess.run(
            ["chroot", str(mountpoint), *DEMO_COMMAND], capture_output=True, text=True, check=True
        ).stdout
        ready = time.monotonic() - start
        stats = json.loads(_weenv("stats", str(mountpoint), "--json", capture=True))
    finally:
        _weenv("umount", str(mountpoint))
    fetched = int(stats.get("fetch", stats).get("bytes_fetched", 0))
    summary = {
        "environment": ref,
        "command_output": out.strip(),
        "time_to_ready_s": round(ready, 3),
        "image_bytes": image_bytes,
        "bytes_fetched": fetched,
        "fraction_fetched": round(fetched / image_bytes, 4) if image_bytes else 0.0,
    }
    if args.json:
        print_json(summary)
    else:
        print(summary["command_output"])
        print(f"time to ready (mount + first command, cold cache): {ready * 1000:.0f} ms")
        print(
            f"fetched {format_size(fetched)} of a {format_size(image_bytes)} image "
            f"({100 * summary['fraction_fetched']:.1f}%)"
        )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `weenv demo`."""
    parser = add_command(
        subparsers,
        "demo",
        help="build a sample environment, cold-mount it lazily and run a command in it",
        description=__doc__.split("\n\n")[1],
        examples=["weenv demo", "weenv demo --profile python --json"],
        func=run_demo,
    )
    parser.add_argument("--profile", default="python", help="sample tree (default: python)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="store, cache, mnt")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
