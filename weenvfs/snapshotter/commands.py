"""The `weenv snapshotter` and `weenv pull` commands: WeEnv images under containerd.

Owns: the arguments and their defaults, and the containerd configuration it prints
(`--print-config`, the snippet of docs/containerd.md). Must not: serve (server.py) or pull
(pull.py); both are imported only when their command runs (grpc is heavy for `weenv --help`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from weenvfs.cli import add_command
from weenvfs.cli_args import print_json

PLUGIN = "weenv"
DEFAULT_SOCKET = Path("/run/weenv/snapshotter.sock")
DEFAULT_ROOT = Path("/var/lib/weenv/snapshotter")
CONTAINERD_SOCKET = Path("/run/containerd/containerd.sock")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `snapshotter` and `pull`."""
    p = add_command(
        subparsers,
        "snapshotter",
        help="serve containerd's snapshots API: WeEnv images lazily, other layers on overlayfs",
        description=(
            "Run containerd's remote snapshotter for WeEnv images (`weenv push`) until\n"
            "SIGTERM: a gRPC server on a unix socket that containerd reaches as the proxy\n"
            "plugin `weenv`. A WeEnv layer is its group's shared lazy mount on this node (the\n"
            "mounts and chunk cache `weenv run` uses); containerd never downloads or unpacks\n"
            "it. Other layers are kept as containerd's overlayfs snapshotter keeps them.\n"
            "Snapshots survive a restart. Only groups in the --store URLs are mounted.\n"
            "Prometheus metrics on --metrics (docs/metrics.md).\n"
            "Configuration for containerd and Kubernetes: --print-config, docs/containerd.md."
        ),
        examples=[
            "weenv snapshotter --store s3://bucket/weenv",
            "weenv snapshotter --store /srv/weenv --socket /run/weenv/snapshotter.sock "
            "--root /var/lib/weenv/snapshotter",
            "weenv snapshotter --print-config >> /etc/containerd/config.toml",
            "weenv snapshotter --store s3://bucket/weenv --metrics 127.0.0.1:9388 "
            "--node-metrics",
        ],
        func=_cmd_snapshotter,
    )
    p.add_argument("--store", action="append", default=[], metavar="URL", dest="stores",
                   help="a store WeEnv layers may name (repeatable; others are refused)")
    p.add_argument("--socket", type=Path, default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"unix socket to listen on (default {DEFAULT_SOCKET})")
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, metavar="DIR",
                   help=f"where snapshots are kept (default {DEFAULT_ROOT})")
    p.add_argument("--cache", type=Path, metavar="DIR",
                   help="node chunk cache (default: as `weenv mount`)")
    p.add_argument("--keep-warm", type=float, metavar="SECS",
                   help="seconds a group mount stays after its last snapshot is removed "
                   "(default: the node's policy, $WEENV_KEEP_WARM)")
    p.add_argument("--metrics", type=_metrics_address, metavar="HOST:PORT|off",
                   help="where to serve the snapshotter's Prometheus metrics (default "
                   "$WEENV_SNAPSHOTTER_METRICS, else 127.0.0.1:9388; port 0: any free port, "
                   "written to SOCKET.metrics), or off")
    p.add_argument("--node-metrics", action="store_true",
                   help="serve the node's mount metrics there too (for a node whose mount "
                   "server serves none: docs/metrics.md)")
    p.add_argument("--print-config", action="store_true",
                   help="print containerd's configuration for this snapshotter and exit")
    _register_pull(subparsers)


def _register_pull(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        subparsers,
        "pull",
        help="pull a WeEnv image into containerd, its groups mounted lazily",
        description=(
            "Pull image REF (HOST/REPO[:TAG], pushed by `weenv push`) into containerd for the\n"
            "snapshotter `weenv`: each WeEnv layer is prepared with its annotations as\n"
            "snapshot labels (as Kubernetes' CRI does), so the snapshotter mounts its group\n"
            "and containerd neither downloads nor unpacks it. An image of WeEnv layers only\n"
            "is then recorded directly (its manifest and config, as `ctr images pull` would);\n"
            "any other goes through `ctr images pull`, which unpacks its ordinary layers.\n"
            "Run it with `ctr run --snapshotter weenv REF ...`. Registry auth as `weenv\n"
            "convert` (docker config, --creds)."
        ),
        examples=[
            "weenv pull 127.0.0.1:5000/py-env:v1 --insecure",
            "weenv pull registry.example.com/team/py-env:v1 --containerd-socket "
            "/run/containerd/containerd.sock --namespace k8s.io",
        ],
        func=_cmd_pull,
    )
    p.add_argument("ref", metavar="REF", help="HOST/REPO[:TAG]")
    p.add_argument("--containerd-socket", type=Path, default=CONTAINERD_SOCKET, metavar="PATH",
                   help=f"containerd's socket (default {CONTAINERD_SOCKET})")
    p.add_argument("--namespace", default="default", help="containerd namespace (default "
                   "default; Kubernetes uses k8s.io)")
    p.add_argument("--snapshotter", default=PLUGIN,
                   help=f"the proxy plugin's name in containerd (default {PLUGIN})")
    p.add_argument("--creds", metavar="USER:PASS",
                   help="registry credentials (default: docker config)")
    p.add_argument("--insecure", action="store_true",
                   help="plain HTTP (loopback registries only)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _metrics_address(text: str) -> str:
    from weenvfs.fuse.exporter import argument

    return argument(text)


def containerd_config(socket: Path) -> str:
    """The containerd 1.6 config.toml entries: the proxy plugin and CRI's use of it."""
    return (
        "[proxy_plugins]\n"
        f"  [proxy_plugins.{PLUGIN}]\n"
        '    type = "snapshot"\n'
        f'    address = "{socket}"\n'
        "\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd]\n'
        f'  snapshotter = "{PLUGIN}"\n'
        "  disable_snapshot_annotations = false\n"
    )


def _cmd_snapshotter(args: argparse.Namespace) -> int:
    if args.print_config:
        print(containerd_config(args.socket.absolute()), end="")
        return 0
    from weenvfs.fuse.config import cache_dir_of

    from .server import ServerOptions, serve

    options = ServerOptions(args.socket.absolute(), args.root.absolute(), tuple(args.stores),
                            cache_dir_of(args.cache), args.keep_warm,
                            args.metrics, args.node_metrics)
    return serve(options)


def _cmd_pull(args: argparse.Namespace) -> int:
    from weenvfs.tools.image_source import SourceOptions
    from weenvfs.tools.registry import Reference
    from weenvfs.tools.registry_auth import config_creds, parse_creds

    from .pull import Containerd, pull, resolve

    # The docker config's credentials are looked up here, not only by our registry client:
    # `ctr images pull` reads no docker config, it must be given them.
    host = Reference.parse(args.ref.removeprefix("docker://")).host
    creds = parse_creds(args.creds) if args.creds else config_creds(host)
    image = resolve(args.ref, SourceOptions(creds=creds, insecure=args.insecure))
    containerd = Containerd(args.containerd_socket, args.namespace, args.snapshotter,
                            args.insecure, creds)
    try:
        result = pull(args.ref, image, containerd)
    finally:
        containerd.close()
    if args.json:
        print_json({"image": args.ref, "chain_ids": result.chain_ids,
                    "weenv_layers": result.weenv_layers, "present": result.present,
                    "recorded_by": result.recorded_by})
    else:
        print(f"pulled {args.ref}: {len(result.chain_ids)} layers, "
              f"{len(result.weenv_layers)} WeEnv layers mounted lazily, "
              f"{len(result.present)} already present")
    return 0
