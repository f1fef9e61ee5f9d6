"""The `weenv hints record` and `weenv hints show` commands.

Owns:
- `record`: mount an environment through the mount daemon with recording on and prefetch off
  (`weenv mount --hint none --record-hints TAG`), run one command inside it with chroot(8)
  (the sandbox of weenvfs/runtime can take over once it exists), unmount, and report the hint
  the daemon merged and published on unmount (it writes the outcome to a result file). The
  command's exit status becomes ours; its run is published even when it failed (a failing
  task still shows what it reads), with a warning.
- `show`: an environment's hint (by tag or digest): size, groups, how many ranged requests a
  replay costs (the fetcher's own coalescing), and optionally every record.
- `pack`: pack the hint a tag points at (core/hint_pack.py) and move the tag to the packed
  hint; `record` packs what it published, and a recording mount has this command run in the
  background by the node service once it published.

Must not: record, publish or pack anything itself (core/node_hints.py, core/hint_pack.py and
fuse/mount.py do), or serve a mount (fuse/).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from weenvfs.cli import add_command
from weenvfs.cli_args import (
    add_ref_and_command,
    add_store,
    print_json,
    split_command,
)
from weenvfs.core.chunk_plan import (
    DEFAULT_COALESCE_GAP,
    DEFAULT_MAX_REQUEST_BYTES,
    plan_requests,
)
from weenvfs.core.node_hints import HINT_DIGEST, check_hint_spec, find_hint
from weenvfs.core.prefetch import replay_locs
from weenvfs.errors import RefNotFound, UsageError, WeenvError
from weenvfs.format.digest import short
from weenvfs.format.refs import DEFAULT_TAG
from weenvfs.fuse import daemon
from weenvfs.fuse.config import cache_dir_of, is_url, mount_args
from weenvfs.fuse.spawn import spawn
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `hints` with its subcommands `record` and `show`."""
    group = add_command(
        subparsers,
        "hints",
        help="record and inspect prefetch hints (what a task reads, replayed at mount)",
        description=(
            "Prefetch hints list the chunks a workload reads, in first-access order. A mount\n"
            "replays its environment's hint (tag latest) in the background."
        ),
        examples=[
            "weenv hints record --store /srv/weenv py:3.11 python3 -c 'import numpy'",
            "weenv hints show py:3.11 --store /srv/weenv",
            "weenv hints pack py:3.11 --store s3://envs",
        ],
        func=None,
    )
    sub = group.add_subparsers(title="hints commands", metavar="COMMAND")
    _register_record(sub)
    _register_show(sub)
    _register_pack(sub)


def _register_record(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub,
        "record",
        help="run a command in an environment and publish what it read as its hint",
        description=(
            "Mount REF with recording on, run COMMAND in it with chroot (as root), unmount,\n"
            "and merge the chunks and files it read (first access, in order) into the\n"
            "environment's hint TAG: the union of runs, ordered by median first access.\n"
            "A mount replaying the hint fetches its chunks and, on the kernel path, reads\n"
            "its files into the page cache ahead of the workload. Exits with COMMAND's status."
        ),
        examples=[
            "weenv hints record --store /srv/weenv py:3.11 python3 -c 'import numpy'",
            "weenv hints record --store s3://envs --tag train --replace py:3.11 ./run.sh",
        ],
        func=_cmd_record,
    )
    add_store(p, required=False)
    p.add_argument("--tag", default=DEFAULT_TAG, help="hint tag to merge into (default latest)")
    p.add_argument("--replace", action="store_true",
                   help="publish this run alone instead of merging it into the tag's hint")
    p.add_argument("--cache", type=Path, metavar="DIR", help="node chunk cache folder")
    p.add_argument("--no-pack", dest="pack", action="store_false",
                   help="do not pack the published hint (see weenv hints pack)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    add_ref_and_command(p, "ref", "REF", "environment NAME[:TAG] or manifest digest")


def _register_pack(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub,
        "pack",
        help="pack an environment's hint: its chunks in one blob, in the order they are read",
        description=(
            "Write the chunks of REF's hint TAG, in the order the hint lists them, into one\n"
            "blob of their own (from the node cache where it has them, else from the store,\n"
            "each verified), publish the hint again with the pack's table and move TAG to\n"
            "it. A replay then reads a few large ranges instead of one request per scattered\n"
            "run of chunks. A recording mount has its hint packed in the background once it\n"
            "published it; run this for hints published before packs existed."
        ),
        examples=[
            "weenv hints pack py:3.11 --store s3://envs",
            "weenv hints pack py:3.11 --store /srv/weenv --tag train --json",
        ],
        func=_cmd_pack,
    )
    p.add_argument("ref", metavar="REF", help="environment NAME[:TAG] or manifest digest")
    add_store(p)
    p.add_argument("--tag", default=DEFAULT_TAG, help="hint tag to pack (default latest)")
    p.add_argument("--cache", type=Path, metavar="DIR",
                   help="node chunk cache to take chunks from (default: $WEENV_CACHE, else "
                        "/var/cache/weenv/chunks; chunks it lacks come from the store)")
    p.add_argument("--if-hint", metavar="DIGEST",
                   help="only if TAG points at this hint (what a recording mount passes)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def _register_show(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub,
        "show",
        help="show an environment's prefetch hint",
        description="Show the hint of environment REF that a mount would replay.",
        examples=[
            "weenv hints show py:3.11 --store /srv/weenv",
            "weenv hints show py:3.11 --store /srv/weenv --hint train --json --records",
        ],
        func=_cmd_show,
    )
    p.add_argument("ref", metavar="REF", help="environment NAME[:TAG] or manifest digest")
    add_store(p)
    p.add_argument("--hint", default=DEFAULT_TAG, metavar="TAG|DIGEST",
                   help="hint tag or digest (default latest)")
    p.add_argument("--records", action="store_true", help="also list every record")
    p.add_argument("--json", action="store_true", help="print JSON")


# -- record ---------------------------------------------------------------------------------


def _cmd_record(args: argparse.Namespace) -> int:
    command = split_command(args, "ref", store=True)
    if not command:
        raise UsageError("no command given (weenv hints record [OPTIONS] REF COMMAND...)")
    check_hint_spec(args.tag, "--tag", allow_none=False)
    if os.geteuid() != 0:
        raise UsageError("weenv hints record runs the command with chroot: run it as root")
    cache = cache_dir_of(args.cache)
    store = args.store if is_url(args.store) else os.path.abspath(args.store)
    with open_store(store) as s:
        s.check(write=True)  # the daemon publishes on unmount: fail now, not then
        _, manifest = Repository(s).resolve_env(args.ref)
    env_vars = dict(v.split("=", 1) for v in manifest.config.env if "=" in v)
    env_vars.setdefault("PATH", DEFAULT_PATH)
    work = Path(tempfile.mkdtemp(prefix="weenv-hints-"))
    try:
        status, outcome = _record_in(work, args, store, cache, command, env_vars)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.pack and outcome.get("hint"):
        outcome["pack"] = _pack_outcome(store, outcome["manifest"], args.tag, cache,
                                        outcome["hint"], quiet=args.json)
    _report(outcome, status, args.json)
    return status


def _pack_outcome(store: str, ref: str, tag: str, cache: Path, expect: str | None,
                  quiet: bool) -> dict[str, Any]:
    """`pack_tag` of environment `ref`'s hint `tag` in `store`, as the JSON `record` and
    `pack` print; progress on stderr unless `quiet`."""
    from weenvfs.core.cache import ChunkCache
    from weenvfs.core.hint_pack import pack_tag
    from weenvfs.tools.progress import Progress

    bar = Progress(mode="quiet" if quiet else "auto")
    with open_store(store) as s:
        repo = Repository(s)
        digest, manifest = repo.resolve_env(ref)
        indexes = [repo.get_index(g.index) for g in manifest.groups]
        node_cache = ChunkCache(cache) if cache.is_dir() else None
        with bar:
            done = pack_tag(repo, digest, indexes, tag, node_cache, expect=expect,
                            started=lambda n: bar.begin("packing the hint", n, unit="chunks"),
                            progress=bar.update)
    return {"hint": done.hint, "pack": done.pack, "chunks": done.chunks, "bytes": done.bytes,
            "from_cache": done.from_cache, "skipped": done.reason}


def _record_in(
    work: Path, args: argparse.Namespace, store: str, cache: Path, command: list[str],
    env_vars: dict[str, str],
) -> tuple[int, dict[str, Any]]:
    mountpoint, result = work / "root", work / "result.json"
    mountpoint.mkdir()
    cache.mkdir(parents=True, exist_ok=True)
    log_file = Path(args.log_file or cache / "logs" / f"hints-record-{os.getpid()}.log").absolute()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    spawn(
        mount_args(
            args.ref, mountpoint, store, cache, log_file=log_file, allow_other=True,
            hint="none", record_tag=args.tag, record_result=result, record_replace=args.replace,
        ),
        log_file,
    )
    try:
        status = _run_chroot(mountpoint, command, env_vars, stdout_to_stderr=args.json)
    finally:
        daemon.unmount(mountpoint, lazy=True, remove=True)  # our folder: copies go with it
    try:
        outcome = json.loads(result.read_text())
    except (OSError, ValueError):
        raise WeenvError(f"the mount daemon reported no recorded hint; see {log_file}") from None
    if outcome.get("error"):
        raise WeenvError(f"cannot publish the recorded hint: {outcome['error']}")
    return status, outcome


# In a private mount namespace (gone with the command, so nothing to clean up): the host's
# /dev and a fresh /proc over the image's own (a FUSE mount is nodev, so the image's device
# nodes cannot be opened), then chroot. Arguments: MOUNTPOINT COMMAND...
_SANDBOX_SCRIPT = (
    'root=$1; shift; '
    'if [ -d "$root/dev" ]; then {mount} --rbind /dev "$root/dev" || exit 125; fi; '
    'if [ -d "$root/proc" ]; then {mount} -t proc proc "$root/proc" || exit 125; fi; '
    'exec {chroot} "$root" "$@"'
)


def _tool(name: str) -> str:
    path = shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise WeenvError(f"{name} not found (Debian packages util-linux, mount, coreutils)")
    return path


def _run_chroot(mountpoint: Path, command: list[str], env_vars: dict[str, str], *,
                stdout_to_stderr: bool = False) -> int:
    """Run `command` chrooted into `mountpoint` (with /dev and /proc); its exit status.
    `stdout_to_stderr`: the command's output goes to stderr (stdout is the JSON's)."""
    script = _SANDBOX_SCRIPT.format(mount=_tool("mount"), chroot=_tool("chroot"))
    argv = [_tool("unshare"), "--mount", "--propagation", "private", "/bin/sh", "-c", script,
            "sh", str(mountpoint), *command]
    log.info("running %s in %s", command, mountpoint)
    try:
        done = subprocess.run(argv, env=env_vars, check=False,
                              stdout=sys.stderr.fileno() if stdout_to_stderr else None)
    except OSError as e:
        raise WeenvError(f"cannot run the command: {e.strerror}") from None
    if done.returncode:
        log.warning("the command exited with status %d; its run is recorded anyway",
                    done.returncode)
    return done.returncode


def _report(outcome: dict[str, Any], status: int, as_json: bool) -> None:
    outcome = {**outcome, "status": status}
    if as_json:
        print_json(outcome)
    elif outcome.get("hint") is None:
        print("nothing was read: no hint published", file=sys.stderr)
    else:
        print(f"hint {outcome['hint']} ({outcome['records']} chunks; this run read "
              f"{outcome['recorded']}) -> {short(outcome['manifest'])}:{outcome['tag']}")
        if outcome.get("pack"):
            _say_pack(outcome["pack"])


def _say_pack(pack: dict[str, Any]) -> None:
    if pack["hint"] is None or pack["skipped"]:
        print(f"not packed: {pack['skipped']}")
    else:
        print(f"packed as hint {pack['hint']}: {pack['chunks']} chunks, {pack['bytes']} bytes "
              f"in blob {short(pack['pack'])} ({pack['from_cache']} from the node cache)")


# -- pack -----------------------------------------------------------------------------------


def _cmd_pack(args: argparse.Namespace) -> int:
    if args.ready_fd is not None:
        os.close(args.ready_fd)  # started in the background: nobody waits for the result
    check_hint_spec(args.tag, "--tag", allow_none=False)
    expect = None
    if args.if_hint is not None:
        match = HINT_DIGEST.fullmatch(args.if_hint)
        if match is None:
            raise UsageError(f"--if-hint: {args.if_hint!r:.80} is not a hint digest")
        expect = match.group(1)
    cache = cache_dir_of(args.cache)
    outcome = _pack_outcome(args.store, args.ref, args.tag, cache, expect,
                            quiet=args.json or args.ready_fd is not None)
    if args.json:
        print_json(outcome)
    else:
        _say_pack(outcome)
    return 0


# -- show -----------------------------------------------------------------------------------


def describe_hint(repo: Repository, ref: str, spec: str, records: bool) -> dict[str, Any]:
    """What `weenv hints show` prints, as a JSON-able dict."""
    check_hint_spec(spec, allow_none=False)
    digest, manifest = repo.resolve_env(ref)
    indexes = [repo.get_index(g.index) for g in manifest.groups]
    found = find_hint(repo, digest, manifest, indexes, spec)
    if found is None:
        raise RefNotFound(f"no usable hint {spec} for {ref} ({short(digest)})")
    recs = found.hint.records
    locs = replay_locs(found.hint, indexes)
    runs = plan_requests(locs, DEFAULT_COALESCE_GAP, DEFAULT_MAX_REQUEST_BYTES)
    pack = found.hint.pack
    per_group = Counter(r.group for r in recs)
    out: dict[str, Any] = {
        "env": ref,
        "manifest": digest,
        "hint": found.digest,
        "source": found.source,
        "records": len(recs),
        "chunks": len(locs),
        "bytes": sum(c.ulen for c in locs),
        "stored_bytes": sum(c.clen for c in locs),
        "blobs": len({c.blob for c in locs}),
        "ranged_requests": len(runs),
        "pack": None if pack is None else {
            "blob": pack.blob, "bytes": pack.size,
            "chunks": sum(1 for n in pack.lengths if n)},
        "span_ms": recs[-1].time_ms if recs else 0,
        "groups": {g.name: per_group.get(i, 0) for i, g in enumerate(manifest.groups)},
    }
    if records:
        out["record_list"] = [[r.group, r.chunk, r.time_ms] for r in recs]
    return out


def _cmd_show(args: argparse.Namespace) -> int:
    with open_store(args.store) as store:
        info = describe_hint(Repository(store), args.ref, args.hint, args.records)
    if args.json:
        print_json(info)
        return 0
    print(f"hint {info['hint']} ({info['source']}) of {info['env']} ({short(info['manifest'])})")
    print(f"  {info['records']} records, {info['chunks']} chunks to fetch: {info['bytes']} bytes "
          f"({info['stored_bytes']} stored) in {info['blobs']} blob(s), "
          f"{info['ranged_requests']} ranged requests; read over {info['span_ms']} ms")
    if info["pack"] is not None:
        print(f"  packed: {info['pack']['chunks']} chunks in blob {short(info['pack']['blob'])}"
              f" ({info['pack']['bytes']} bytes)")
    groups = ", ".join(f"{name} {n}" for name, n in info["groups"].items())
    print(f"  records per group: {groups}")
    for g, c, t in info.get("record_list", []):
        print(f"  {t:>8} ms  group {g} chunk {c}")
    return 0
