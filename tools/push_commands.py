"""The `weenv push` command: an environment out as an OCI image in a registry.

Owns: the arguments and the order of the checks (the target reference and the environment
are resolved before anything is uploaded), the summary (or --json). The work is push.py.
Must not: build image documents or speak HTTP itself.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from weenvfs.cli import add_command
from weenvfs.cli_args import add_store, print_json
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

from .image_source import SourceOptions
from .oci_docs import Platform
from .push import (
    LAYER_KINDS,
    build_image,
    check_registry,
    full_layers,
    marker_layers,
    parse_target,
    push_image,
)
from .registry_auth import parse_creds


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `push`."""
    p = add_command(
        subparsers,
        "push",
        help="publish an environment as an OCI image (for containerd and Kubernetes)",
        description=(
            "Push environment ENV (NAME[:TAG] or a manifest digest) to the registry as an\n"
            "OCI image: its config carries the environment's entrypoint, command, env,\n"
            "working directory and user; each group is one layer that names the group\n"
            "(store URL, manifest and index digests) in its annotations. Its blob is a marker\n"
            "tar naming it again (the default: the data stays in the store, and only nodes\n"
            "with `weenv snapshotter` can run the image), or with --layers full the group's\n"
            "whole content: any containerd or Docker runs that image after downloading it\n"
            "all, WeEnv nodes still mount it lazily (docs/containerd.md). Registry auth as\n"
            "`weenv convert`."
        ),
        examples=[
            "weenv push py-env:v1 registry.example.com/team/py-env:v1 --store s3://bucket/weenv",
            "weenv push py-env:v1 127.0.0.1:5000/py-env:v1 --store /srv/weenv --insecure",
            "weenv push py-env:v1 127.0.0.1:5000/py-env:v1 --store /srv/weenv --insecure"
            " --store-url http://weenv-store.internal/weenv  # what nodes read from",
            "weenv push py-env:v1 registry.example.com/team/py-env:v1 --store s3://bucket/weenv"
            " --layers full  # also runnable without WeEnv",
        ],
        func=_cmd_push,
    )
    p.add_argument("env", metavar="ENV", help="environment NAME[:TAG] or manifest digest")
    p.add_argument("target", metavar="REGISTRY/REPO[:TAG]", help="where to push the image")
    add_store(p)
    p.add_argument("--store-url", metavar="URL",
                   help="the store URL written into the image, as nodes reach it "
                   "(default: the --store URL)")
    p.add_argument("--layers", choices=LAYER_KINDS, default="marker",
                   help="what each layer's blob holds: `marker` (default: a few hundred "
                   "bytes naming the group) or `full` (the group's content as a gzip tar, "
                   "spooled in $TMPDIR first)")
    p.add_argument("--platform", type=Platform.parse, default=None, metavar="OS/ARCH",
                   help="the image's platform (default: this machine's)")
    p.add_argument("--creds", metavar="USER:PASS",
                   help="registry credentials (default: docker config)")
    p.add_argument("--insecure", action="store_true",
                   help="plain HTTP (loopback registries only)")
    p.add_argument("--insecure-remote", action="store_true",
                   help="allow --insecure (and plain-HTTP token services) for non-loopback hosts")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _cmd_push(args: argparse.Namespace) -> int:
    target = parse_target(args.target)
    options = SourceOptions(creds=parse_creds(args.creds) if args.creds else None,
                            insecure=args.insecure, insecure_remote=args.insecure_remote)
    with open_store(args.store) as store, tempfile.TemporaryDirectory(
            prefix="weenv-push-") as tmp:
        store.check()
        repo = Repository(store)
        digest, manifest = repo.resolve_env(args.env)
        store_url = args.store_url or store.url
        if args.layers == "full":
            check_registry(target, options)
            layers = full_layers(manifest, digest, store_url, repo, Path(tmp))
        else:
            layers = marker_layers(manifest, digest, store_url)
        image = build_image(manifest, digest, layers, args.platform or Platform.host())
        pushed = push_image(image, target, options)
    if args.json:
        print_json({"image": str(target).removeprefix("docker://"), "digest": pushed,
                    "manifest": digest, "store": store_url, "layer_kind": args.layers,
                    "layers": [layer.digest for layer in image.layers]})
    else:
        print(f"pushed {args.env} ({digest[:12]}) as {str(target).removeprefix('docker://')}"
              f"@{pushed}: {len(image.layers)} layers, data in {store_url}")
    return 0
