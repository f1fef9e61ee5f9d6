"""The read-side commands: `weenv ls`, `weenv inspect`, `weenv verify`, `weenv export`, `weenv gc`.

Owns: their arguments, opening (and checking) the store, progress on stderr, and printing the
results (human text or --json on stdout). The work is in inspect.py, verify.py, export.py and
gc.py. Must not: hold any logic of those; errors are raised as WeenvError/FormatError for
cli.main() to print on one line.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weenvfs.cli import add_command
from weenvfs.cli_args import add_store, print_json
from weenvfs.store.repository import Repository
from weenvfs.units import format_size

from . import gc as gc_mod
from . import inspect as insp
from .command_repo import with_repo
from .export import export_tree
from .progress import Progress
from .reader import ChunkReader, load_env, load_group_ref
from .verify import verify

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '1h', '2d' -> seconds."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (use e.g. 0, 30m, 1h, 2d)")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def register(subparsers: Subparsers) -> None:
    """Add `ls`, `inspect`, `verify`, `export` and `gc`."""
    _register_ls(subparsers)
    _register_inspect(subparsers)
    _register_verify(subparsers)
    _register_export(subparsers)
    _register_gc(subparsers)


def _store_arg(p: argparse.ArgumentParser) -> None:
    add_store(p)


def _group_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--group",
        action="store_true",
        help="REF names a single layer group (NAME[:TAG] or index digest), not an environment",
    )




# -- ls -----------------------------------------------------------------------------------------


def _register_ls(subparsers: Subparsers) -> None:
    p = add_command(
        subparsers,
        "ls",
        help="list the environments and groups a store holds",
        description=(
            "List the environments and layer groups of a store by name: each tagged version\n"
            "(newest first) with its tags, digest, size of file data, date (the mtime of its\n"
            "root directory) and, for an environment, its groups and recorded hint tags.\n"
            "Tags that cannot be read (garbage, a folder or a broken symlink in a local\n"
            "store) are listed last with why; gc refuses to run while any is there."
        ),
        examples=["weenv ls --store /srv/weenv",
                  "weenv ls --store s3://envs/weenv --json | jq '.environments[].name'"],
        func=with_repo(_cmd_ls),
    )
    _store_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON")


def _cmd_ls(args: argparse.Namespace, repo: Repository) -> int:
    from .listing import list_store

    document = list_store(repo)
    if args.json:
        print_json(document)
        return 0
    for title, kind in (("ENVIRONMENT", "environments"), ("GROUP", "groups")):
        rows = [(title, "TAGS", "DIGEST", "SIZE", "DATE", "GROUPS/HINTS" if kind[0] == "e" else "")]
        for item in document[kind]:
            for v in item["versions"]:
                rows.append(_ls_row(item["name"], v))
        if len(rows) == 1:
            print(f"no {kind} in {document['store']}")
        else:
            _print_rows(rows)
        if kind == "environments":
            print()
    if document["unreadable_tags"]:  # listed, as missing objects are: gc refuses to run
        print()
        _print_rows([("UNREADABLE TAG", "ERROR")]
                    + [(u["tag"], u["error"]) for u in document["unreadable_tags"]])
    return 0


def _ls_row(name: str, v: dict[str, Any]) -> tuple[str, ...]:
    if v.get("missing"):
        return (name, ",".join(v["tags"]), v["digest"][:12], "-", "-", "(missing)")
    extra = ""
    if "groups" in v:
        extra = " ".join(v["groups"]) + (f"; hints {','.join(v['hints'])}" if v["hints"] else "")
    return (name, ",".join(v["tags"]), v["digest"][:12], format_size(v["file_bytes"]),
            (v["date"] or "-")[:10], extra)


def _print_rows(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


# -- inspect ------------------------------------------------------------------------------------


def _register_inspect(subparsers: Subparsers) -> None:
    p = add_command(
        subparsers,
        "inspect",
        help="show what an environment or a group holds",
        description=(
            "Show an environment (default) or, with --group, one layer group: digests, groups\n"
            "with entry counts and sizes, runtime config, hint, provenance. --files lists the\n"
            "entries (the composed tree for an environment) in ls -l style, mtimes in UTC.\n"
            "Names that are not printable UTF-8 are shown with backslash escapes (\\n, \\xff);\n"
            "in --json they are surrogate-escaped strings, plus PATH_hex when not UTF-8."
        ),
        examples=[
            "weenv inspect py-env:v1 --store /srv/weenv",
            "weenv inspect base-os:bookworm --group --store /srv/weenv --json",
            "weenv inspect py-env:v1 --store /srv/weenv --files --tree /usr/lib/python3",
        ],
        func=with_repo(_cmd_inspect),
    )
    p.add_argument("ref", metavar="REF", help="NAME[:TAG] or digest")
    _store_arg(p)
    _group_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--files", action="store_true", help="list the entries")
    p.add_argument("--tree", metavar="PATH", help="list only the entries at and below PATH")


def _cmd_inspect(args: argparse.Namespace, repo: Repository) -> int:
    top = os.fsencode(args.tree) if args.tree is not None else None
    listing = args.files or top is not None
    if args.group:
        group, report = insp.inspect_group(repo, args.ref)
        indexes = [group.index]
        entries = insp.group_entries(group.index, top or b"") if listing else iter(())
        lines = insp.render_group(report)
    else:
        env, report = insp.inspect_env(repo, args.ref)
        tree = env.tree()
        indexes = tree.groups
        entries = insp.env_entries(tree, top or b"") if listing else iter(())
        lines = insp.render_env(report)
    if args.json:
        if listing:
            report["files"] = [
                insp.entry_json(indexes[g], ino, path, g) for path, g, ino in entries
            ]
        print_json(report)
        return 0
    if not listing:
        for line in lines:
            print(line)
    for path, g, ino in entries:
        print(insp.format_entry(indexes[g], ino, path, markers=args.group))
    return 0


# -- verify -------------------------------------------------------------------------------------


def _register_verify(subparsers: Subparsers) -> None:
    p = add_command(
        subparsers,
        "verify",
        help="check an environment's chain of trust, down to every chunk",
        description=(
            "Check that the manifest, every index and every blob exist and hash to their\n"
            "digests, that every index record is valid, and (unless --quick) that every chunk\n"
            "decompresses to its digest and every file with a file digest matches it. Checks\n"
            "the environment's hints too (its manifest's and every hint tag's: bound to it,\n"
            "naming its chunks, and each hint's pack blob holding those chunks). Prints\n"
            "every problem, one per line, then a summary. Exit 0 only if nothing is wrong."
        ),
        examples=[
            "weenv verify py-env:v1 --store /srv/weenv",
            "weenv verify base-os:bookworm --group --store s3://bucket/weenv --quick",
            "weenv verify py-env:v1 --store /srv/weenv --json",
        ],
        func=with_repo(_cmd_verify),
    )
    p.add_argument("ref", metavar="REF", help="NAME[:TAG] or digest")
    _store_arg(p)
    _group_arg(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="skip hashing blobs, fetching chunk data and checking file digests",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def _cmd_verify(args: argparse.Namespace, repo: Repository) -> int:
    progress = Progress(mode="bar" if sys.stderr.isatty() else "quiet")
    report = verify(repo, args.ref, group=args.group, quick=args.quick, progress=progress)
    progress.end()
    if args.json:
        print_json(report.to_json())
        return 0 if report.ok else 1
    for problem in report.problems:
        print(problem.line())
    checked = report.checked
    summary = (
        f"{checked['indexes']} indexes, {checked['inodes']} inodes, {checked['blobs']} blobs"
        + ("" if args.quick else " (hashed)")
        + (
            ""
            if args.quick
            else f", {checked['chunks']} chunks "
            f"({format_size(checked['chunk bytes'])}), {checked['file digests']} file digests"
        )
    )
    # --quick: say what an "ok" does not cover.
    skipped = f"; --quick: {', '.join(report.skipped)}" if report.skipped else ""
    if report.ok:
        print(f"ok: {args.ref}: {summary} checked{skipped}")
        return 0
    count = len(report.problems)
    print(
        f"FAILED: {args.ref}: {count} problem{'s' if count != 1 else ''} "
        f"({summary} checked{skipped})"
    )
    return 1


# -- export -------------------------------------------------------------------------------------


def _register_export(subparsers: Subparsers) -> None:
    p = add_command(
        subparsers,
        "export",
        help="write an environment's composed tree into a directory",
        description=(
            "Materialize the composed tree of an environment (or, with --group, one group) into\n"
            "DIR with every file, hardlink, symlink, device, fifo and socket and all metadata:\n"
            "owners, modes with set-id bits, xattrs, nanosecond mtimes; holes stay holes.\n"
            "DIR must be empty or absent. Run as root for exact owners and device nodes."
        ),
        examples=[
            "weenv export py-env:v1 /tmp/rootfs --store /srv/weenv",
            "weenv export base-os:bookworm /tmp/base --group --store /srv/weenv",
        ],
        func=with_repo(_cmd_export),
    )
    p.add_argument("ref", metavar="REF", help="NAME[:TAG] or digest")
    p.add_argument("dir", metavar="DIR", type=Path, help="destination (empty or absent)")
    _store_arg(p)
    _group_arg(p)


def _cmd_export(args: argparse.Namespace, repo: Repository) -> int:
    if args.group:
        from weenvfs.format.compose import ComposedTree

        tree = ComposedTree([load_group_ref(repo, args.ref).index])
    else:
        tree = load_env(repo, args.ref).tree()
    progress = Progress(mode="auto" if sys.stderr.isatty() else "quiet")
    progress.begin("exporting file data")
    try:
        stats = export_tree(tree, ChunkReader(repo.store), args.dir, progress=progress.update)
    finally:
        progress.end()
    print(
        f"exported {args.ref} to {args.dir}: {stats.dirs + 1} dirs, {stats.files} files "
        f"({format_size(stats.bytes_written)}), {stats.symlinks} symlinks, "
        f"{stats.hardlinks} hardlinks, {stats.special} special files"
    )
    return 0


# -- gc -----------------------------------------------------------------------------------------


def _register_gc(subparsers: Subparsers) -> None:
    p = add_command(
        subparsers,
        "gc",
        help="find (and with --delete remove) objects that no tag reaches",
        description=(
            "Mark everything reachable from every tag (environments, groups, hints), then list\n"
            "blobs/, indexes/, manifests/ and hints/ and report the unreferenced objects; with\n"
            "--delete, remove them (and stale temp files and the staging folders of dead builds).\n"
            "Reachable objects are never deleted, and if any reachable manifest, index or hint\n"
            "cannot be read, nothing is.\n"
            "\n"
            "Race safety: a publish writes blobs before indexes, manifests and tags, so an\n"
            "object younger than --grace (default 1h) is kept even when unreferenced, and young\n"
            "indexes and manifests count as roots. Keep every publish shorter than the grace\n"
            "period; --grace 0 is only safe when nothing writes to the store."
        ),
        examples=[
            "weenv gc --store /srv/weenv                  # dry run: report only",
            "weenv gc --store /srv/weenv --delete",
            "weenv gc --store /srv/weenv --delete --grace 6h --json",
        ],
        func=with_repo(_cmd_gc),
    )
    _store_arg(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--delete", action="store_true", help="delete (default: dry run)")
    mode.add_argument("--dry-run", action="store_true", help="report only (the default)")
    p.add_argument(
        "--grace",
        type=parse_duration,
        default=gc_mod.DEFAULT_GRACE,
        metavar="DURATION",
        help="keep unreferenced objects younger than this (default 1h; 0, 30m, 2d ...)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def _cmd_gc(args: argparse.Namespace, repo: Repository) -> int:
    report = gc_mod.collect_garbage(repo, delete=args.delete, grace=args.grace)
    if args.json:
        print_json({"store": repo.store.url, "dry_run": not args.delete, **report.to_json()})
        return 0
    for line in _gc_lines(report, repo.store.url, args.delete):
        print(line)
    return 0


def _gc_lines(report: gc_mod.GcReport, url: str, delete: bool) -> Iterator[str]:
    reach, roots = report.reachable, report.roots
    yield f"store        {url}"
    yield (
        f"reachable    {len(reach['manifests'])} manifests, {len(reach['indexes'])} indexes, "
        f"{len(reach['blobs'])} blobs, {len(reach['hints'])} hints (from {roots['envs']} "
        f"env tags, {roots['groups']} group tags, {roots['hints']} hint tags)"
    )
    for key in report.missing:
        yield f"missing      {key} is reachable but not in the store (run weenv verify)"
    for key in report.unknown:
        yield f"unknown      {key} is not a digest key: left alone"
    verb = "deleted" if delete else "would delete"
    for key, size in report.unreferenced:
        yield f"{verb:<12} {key} ({format_size(size)})"
    for path, size in report.stale_temp:
        yield f"{verb:<12} {path}: a stale temp file ({format_size(size)})"
    for staging in report.stale_staging:
        yield (
            f"{verb:<12} {staging.path}: the staging of a build or conversion that died "
            f"({format_size(staging.size)})"
        )
    if report.young:
        yield f"kept         {len(report.young)} unreferenced objects younger than the grace period"
    if report.ageless:
        yield (
            f"kept         {len(report.ageless)} unreferenced objects: the store cannot tell "
            "their age (use --grace 0 if nothing is publishing)"
        )
    total = f"{len(report.unreferenced)} objects ({format_size(report.unreferenced_bytes)})"
    if delete:
        temp = "" if report.temp_removed is None else f", {report.temp_removed} stale temp files"
        yield f"gc: deleted {total}{temp}"
    else:
        yield f"gc: dry run, {total} unreferenced, nothing deleted (use --delete)"
