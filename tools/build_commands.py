"""The `weenv build` and `weenv compose` commands: arguments in, one summary out.

Owns: the arguments of both commands (sizes with K/M/G suffixes, K=V lists, JSON argv
lists), opening the store and the source, and printing the result (a summary or --json on
stdout; progress on stderr). The work itself is `builder.build_group` and
`publish.compose_env`.

Must not: contain build logic; errors are raised as WeenvError/FormatError for cli.main()
to print on one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from weenvfs.cli import add_command
from weenvfs.cli_args import add_store, print_json
from weenvfs.errors import UsageError
from weenvfs.format import constants as C
from weenvfs.format.chunk import DEFAULT_LEVEL
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.format.refs import parse_name_tag
from weenvfs.store.repository import Repository
from weenvfs.units import format_size, size_arg

from .builder import BuildOptions, BuildResult, build_group, open_source
from .chunker import DEFAULT_MAX_BLOB_SIZE, ChunkOptions
from .command_repo import open_repo
from .hint_command import add_hint_command_argument, check_hint_command, record_after_publish
from .layout import load_layout_order
from .progress import Progress
from .publish import compose_env


def add_layout_and_output_arguments(p: argparse.ArgumentParser, hint_note: str = "") -> None:
    """`--hint REF`, `--hint-tag TAG` (the data a hint reads first: layout.py), `--json`
    and `--quiet`: every command that builds groups takes them (build, convert)."""
    p.add_argument(
        "--hint",
        metavar="REF",
        help="put the data this prefetch hint reads first, in its order, in blob(s) of its "
        f"own{hint_note}: an environment (its hint tag --hint-tag) or a hint digest",
    )
    p.add_argument(
        "--hint-tag", default="latest", metavar="TAG", help="hint tag of --hint (default latest)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_chunk_arguments(p: argparse.ArgumentParser) -> None:
    """The chunking options every command that builds groups takes (build, convert)."""
    p.add_argument(
        "--chunk-size",
        type=size_arg,
        default=C.DEFAULT_CHUNK_SIZE,
        metavar="SIZE",
        help="size of large-file chunks (default 1M)",
    )
    p.add_argument(
        "--batch-threshold",
        type=size_arg,
        default=C.DEFAULT_BATCH_THRESHOLD,
        metavar="SIZE",
        help="files smaller than this are batched (default 64K)",
    )
    p.add_argument(
        "--max-blob-size",
        type=size_arg,
        default=DEFAULT_MAX_BLOB_SIZE,
        metavar="SIZE",
        help="roll over to a new blob at this size (default 256M)",
    )
    p.add_argument(
        "--level",
        type=int,
        default=DEFAULT_LEVEL,
        metavar="N",
        help="zstd compression level, 1-22 (default 3)",
    )


def chunk_options(args: argparse.Namespace) -> ChunkOptions:
    """ChunkOptions from `add_chunk_arguments`' options (UsageError if they do not fit)."""
    if not 1 <= args.level <= 22:
        raise UsageError(f"--level must be within 1..22, got {args.level}")
    try:
        return ChunkOptions(
            chunk_size=args.chunk_size,
            batch_threshold=args.batch_threshold,
            level=args.level,
            max_blob_size=args.max_blob_size,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _argv_json(text: str) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(
            f'expected a JSON list of strings such as \'["/bin/sh", "-c"]\', got {text!r}'
        )
    return tuple(value)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `build` and `compose`."""
    _register_build(subparsers)
    _register_compose(subparsers)


def _register_build(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        subparsers,
        "build",
        help="build a layer group from a directory or a tar and publish it",
        description=(
            "Chunk, dedup and publish SOURCE as the layer group NAME[:TAG]: blobs first, then\n"
            "the index, then the tag. Chunks already stored by the group's previous version\n"
            "(and by --dedup-with groups) are reused, so a republish uploads only what changed.\n"
            "SOURCE is a directory, a tar file (plain, gzip, bzip2, xz or zstd) or '-' for a\n"
            "tar on stdin; OCI whiteouts in a tar become whiteout markers."
        ),
        examples=[
            "weenv build ./rootfs --store /srv/weenv --group base-os:bookworm",
            "weenv build layer.tar.zst --store file:///srv/weenv --group python-3.11",
            "docker export c1 | weenv build - --store /srv/weenv --group app:v2 --json",
            "weenv build ./repo --store /srv/weenv --group task-1234 --dedup-with task-1233",
            "weenv build ./rootfs --store /srv/weenv --group py:3.11 --hint py-env:latest",
        ],
        func=_cmd_build,
    )
    p.add_argument("source", metavar="SOURCE", help="a directory, a tar file, or '-' (stdin)")
    add_store(p)
    p.add_argument("--group", required=True, metavar="NAME[:TAG]", help="group to publish")
    add_chunk_arguments(p)
    p.add_argument(
        "--dedup-with",
        action="append",
        default=[],
        metavar="REF",
        help="also reuse chunks of this group (NAME[:TAG] or index digest)",
    )
    p.add_argument(
        "--no-dedup-previous",
        action="store_true",
        help="do not reuse chunks of earlier versions of NAME (by default: the version NAME:TAG "
        "points at now, then the newest other tags of NAME, at most 3)",
    )
    add_layout_and_output_arguments(p)


def _register_compose(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        subparsers,
        "compose",
        help="publish an environment manifest made of layer groups",
        description=(
            "Publish the environment NAME[:TAG]: an ordered list of groups (lowest first,\n"
            "like image layers) plus how to run it. Prints the manifest digest."
        ),
        examples=[
            "weenv compose py-env:v1 --group base-os:bookworm --group python-3.11"
            " --store /srv/weenv",
            "weenv compose task-1234 --group base-os --group task-1234 --store /srv/weenv"
            " --env PATH=/usr/bin:/bin --cwd /work --cmd '[\"bash\"]'",
        ],
        func=_cmd_compose,
    )
    p.add_argument("env", metavar="NAME[:TAG]", help="environment to publish")
    p.add_argument(
        "--group",
        action="append",
        required=True,
        metavar="REF",
        dest="groups",
        help="a group (NAME[:TAG] or index digest); repeat, lowest first",
    )
    add_store(p)
    p.add_argument(
        "--env",
        action="append",
        default=[],
        type=_key_value,
        metavar="K=V",
        dest="env_vars",
        help="environment variable; repeatable",
    )
    p.add_argument("--cwd", default="/", metavar="DIR", help="working directory (default /)")
    p.add_argument("--user", default="", metavar="U", help="user[:group] to run as")
    p.add_argument(
        "--entrypoint",
        type=_argv_json,
        default=(),
        metavar="JSON",
        help="entrypoint as a JSON list of strings",
    )
    p.add_argument(
        "--cmd",
        type=_argv_json,
        default=(),
        metavar="JSON",
        help="command as a JSON list of strings",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        type=_key_value,
        metavar="K=V",
        dest="labels",
        help="label; repeatable",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_hint_command_argument(p)


def _build_options(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(chunk_options(args), not args.no_dedup_previous,
                        tuple(args.dedup_with))


def _with_layout(options: BuildOptions, repo: Repository, args: argparse.Namespace) -> BuildOptions:
    if args.hint is None:
        return options
    return dataclasses.replace(options, layout=load_layout_order(repo, args.hint, args.hint_tag))


def _cmd_build(args: argparse.Namespace) -> int:
    name, tag = parse_name_tag(args.group, "group")
    options = _build_options(args)
    progress = Progress.quiet() if args.quiet or args.json else Progress()
    with open_repo(args.store, write=True) as repo:
        options = _with_layout(options, repo, args)
        source = open_source(args.source)
        try:
            result = build_group(source, repo, name, tag, options, progress)
        finally:
            source.close()
    if args.json:
        print_json(result.as_dict())
    else:
        print(_summary(result))
    return 0


def _summary(r: BuildResult) -> str:
    s, c = r.stats, r.counts
    kinds = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in c.as_dict().items() if v)
    lines = [
        f"group {r.name}:{r.tag} -> index {r.index_digest}",
        f"  {kinds or 'empty'}; {format_size(s.bytes_in)} of file data",
        f"  new:    {s.chunks_new} chunks, {format_size(s.bytes_new)} "
        f"({format_size(s.bytes_new_compressed)} compressed) in {r.blobs_new} blobs, "
        f"{r.blobs_uploaded} uploaded",
        f"  reused: {s.chunks_reused} chunks, {format_size(s.bytes_reused)} "
        f"({format_size(s.bytes_reused_compressed)} compressed); {s.files_reused} small files"
        f" (from {', '.join(r.dedup_sources) or 'no earlier group'})",
    ]
    if s.chunks_zero:
        lines.append(f"  holes:  {s.chunks_zero} zero chunks, {format_size(s.bytes_zero)}")
    return "\n".join(lines)


def _cmd_compose(args: argparse.Namespace) -> int:
    name, tag = parse_name_tag(args.env, "environment")
    config = RuntimeConfig(
        env=tuple(f"{k}={v}" for k, v in args.env_vars),
        cwd=args.cwd,
        user=args.user,
        entrypoint=args.entrypoint,
        cmd=args.cmd,
        labels=dict(args.labels),
    )
    if not config.cwd.startswith("/"):
        raise UsageError(f"--cwd must be an absolute path, got {config.cwd!r}")
    check_hint_command(args)
    provenance: dict[str, Any] = {"composed_by": "weenv compose", "groups": list(args.groups)}
    with open_repo(args.store, check=False) as repo:  # compose_env says what is missing
        digest = compose_env(repo, name, tag, args.groups, config, provenance)
    if args.json:  # the JSON says what the hint recorded after publishing did
        seed = record_after_publish(args, digest, quiet=False)
        print_json({"env": f"{name}:{tag}", "manifest": digest, "seed_hint": seed})
    else:
        print(digest)
        record_after_publish(args, digest, quiet=False)
    return 0
