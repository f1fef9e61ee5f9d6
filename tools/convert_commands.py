"""The `weenv convert` command: a container image in, an environment of layer groups out.

Owns: the arguments, the order of the checks (the image reference, credentials and
manifest are resolved before the store is opened or anything is downloaded, then the store is
checked for writing), progress on stderr and the summary (or --json) on stdout. The work is
convert.convert_image.

Must not: contain conversion logic; errors are raised as WeenvError/FormatError for
cli.main() to print on one line.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from weenvfs.cli import add_command
from weenvfs.cli_args import add_store, print_json
from weenvfs.errors import UsageError
from weenvfs.format.refs import parse_name_tag
from weenvfs.units import format_size

from .build_commands import add_chunk_arguments, add_layout_and_output_arguments, chunk_options
from .command_repo import open_repo
from .convert import ConvertOptions, ConvertResult, GroupSpec, convert_image
from .hint_command import add_hint_command_argument, check_hint_command, record_after_publish
from .image_source import SourceOptions
from .image_transports import open_image_source
from .layout import load_layout_order
from .oci_docs import Platform, short_digest
from .progress import Progress
from .registry_auth import parse_creds
from .staging import check_tmp_dir, remove_stale


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `convert`."""
    p = add_command(
        subparsers,
        "convert",
        help="convert a Docker/OCI image into layer groups and an environment",
        description=(
            "Convert the image SOURCE into layer groups and publish the environment NAME[:TAG].\n"
            "SOURCE is docker://HOST/REPO[:TAG|@DIGEST] (a registry), oci:DIR[:TAG] (an OCI\n"
            "image layout) or docker-archive:PATH[:REF] (the output of docker save).\n"
            "Each layer becomes a group unless --group squashes ranges of layers (zero-based,\n"
            "inclusive; together they must cover every layer in order). Groups the store holds\n"
            "already for the same layers are reused without downloading them; other groups\n"
            "reuse stored chunks. Every layer is checked against the image's digests, and\n"
            "nothing is tagged unless the whole conversion succeeds."
        ),
        examples=[
            "weenv convert docker://registry.example.com/team/py:3.11 py:3.11 --store /srv/weenv",
            "weenv convert docker://127.0.0.1:5000/task:1234 task:1234 --insecure"
            " --store /srv/weenv --group base=0-3 --group python=4-5 --group task=6-",
            "weenv convert oci:./layout:v1 app:v1 --store file:///srv/weenv --json",
            "weenv convert docker-archive:image.tar app:v2 --store /srv/weenv"
            " --platform linux/arm64",
        ],
        func=_cmd_convert,
    )
    p.add_argument(
        "source", metavar="SOURCE", help="docker://..., oci:DIR[:TAG] or docker-archive:PATH"
    )
    p.add_argument("env", metavar="NAME[:TAG]", help="environment to publish")
    add_store(p)
    p.add_argument(
        "--group",
        action="append",
        default=[],
        type=_group_spec,
        metavar="NAME[:TAG]=RANGE",
        dest="groups",
        help="squash layers RANGE (N, N-M or N-) into group NAME; repeat, in layer order",
    )
    p.add_argument(
        "--platform",
        type=_platform,
        default=None,
        metavar="OS/ARCH[/VARIANT]",
        help="image to pick from a multi-platform image (default: this machine's)",
    )
    p.add_argument(
        "--creds", metavar="USER:PASS", help="registry credentials (default: docker config)"
    )
    p.add_argument("--insecure", action="store_true", help="plain HTTP (loopback registries only)")
    p.add_argument(
        "--insecure-remote",
        action="store_true",
        help="allow --insecure (and plain-HTTP token services) for non-loopback hosts",
    )
    add_chunk_arguments(p)
    p.add_argument(
        "--dedup-with",
        action="append",
        default=[],
        metavar="REF",
        help="also reuse chunks of this environment or group; repeatable",
    )
    p.add_argument("--no-reuse", action="store_true", help="rebuild groups the store already has")
    add_layout_and_output_arguments(p, " (implies --no-reuse)")
    p.add_argument(
        "--tmp-dir", type=Path, metavar="DIR", help="where downloads and blobs are staged"
    )
    add_hint_command_argument(p)


def _group_spec(text: str) -> GroupSpec:
    try:
        return GroupSpec.parse(text)
    except Exception as e:  # UsageError or FormatError: argparse shows the message
        raise argparse.ArgumentTypeError(str(e)) from None


def _platform(text: str) -> Platform:
    try:
        return Platform.parse(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _options(args: argparse.Namespace) -> ConvertOptions:
    chunk = chunk_options(args)
    return ConvertOptions(
        groups=tuple(args.groups),
        platform=args.platform or Platform.host(),
        chunk=chunk,
        reuse=not args.no_reuse and args.hint is None,  # a reused group keeps its layout
        dedup_with=tuple(args.dedup_with),
        tmp_dir=args.tmp_dir,
    )


def _cmd_convert(args: argparse.Namespace) -> int:
    name, tag = parse_name_tag(args.env, "environment")
    check_hint_command(args)
    check_tmp_dir(args.tmp_dir)
    options = _options(args)
    source_options = SourceOptions(
        creds=parse_creds(args.creds) if args.creds else None,
        insecure=args.insecure,
        insecure_remote=args.insecure_remote,
        tmp_dir=str(args.tmp_dir) if args.tmp_dir else None,
    )
    progress = Progress.quiet() if args.quiet or args.json else Progress()
    # What a killed conversion left (downloads, a decompressed archive, blobs), before this
    # one stages anything: even a conversion that reuses every group cleans up.
    remove_stale(args.tmp_dir)
    with open_image_source(args.source, source_options) as source:
        assert options.platform is not None
        image = source.resolve(options.platform)  # auth and manifest before any write
        with open_repo(args.store, write=True) as repo:
            if args.hint is not None:
                layout = load_layout_order(repo, args.hint, args.hint_tag)
                options = dataclasses.replace(options, layout=layout)
            result = convert_image(source, repo, name, tag, options, progress, image)
    if args.json:  # the JSON says what the hint recorded after publishing did
        seed = record_after_publish(args, result.manifest_digest, args.quiet)
        print_json({**result.as_dict(), "seed_hint": seed})
    else:
        print(summary(result))
        record_after_publish(args, result.manifest_digest, args.quiet)
    return 0


def summary(r: ConvertResult) -> str:
    """The human-readable result of a conversion."""
    img = r.image
    built = [g for g in r.groups if g.stored is not None]
    lines = [
        f"environment {r.env} -> manifest {r.manifest_digest}",
        f"  image {img.source} {short_digest(img.manifest_digest)} ({img.platform or '?'}), "
        f"{len(img.layers)} layers -> {len(r.groups)} groups "
        f"({len(r.groups) - len(built)} reused, {len(built)} built)",
    ]
    for g in r.groups:
        span = (
            f"layer {g.plan.first}"
            if g.plan.first == g.plan.last
            else (f"layers {g.plan.first}-{g.plan.last}")
        )
        head = f"  {g.plan.ref} ({span}): index {g.index_digest[:12]}"
        if g.stored is None:
            lines.append(head + ", reused")
            continue
        s = g.stored.stats
        lines.append(
            f"{head}, {format_size(s.bytes_in)} of files; new {format_size(s.bytes_new)} "
            f"({format_size(s.bytes_new_compressed)} compressed), reused "
            f"{format_size(s.bytes_reused)}"
        )
    lines.append(
        f"  downloaded {format_size(r.bytes_downloaded)}, uploaded {format_size(r.bytes_uploaded)} "
        f"in {sum(g.stored.blobs_uploaded for g in built if g.stored)} blobs"
    )
    return "\n".join(lines)
