"""The `weenv snapshotter` command: containerd's remote snapshotter for WeEnv images.

Owns: the arguments and their defaults, and the containerd configuration it prints
(`--print-config`, the snippet of docs/containerd.md). Must not: serve (server.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from weenvfs.cli import add_command

from .server import DEFAULT_ROOT, DEFAULT_SOCKET

PLUGIN = "weenv"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `snapshotter`."""
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
            "Configuration for containerd and Kubernetes: --print-config, docs/containerd.md."
        ),
        examples=[
            "weenv snapshotter --store s3://bucket/weenv",
            "weenv snapshotter --store /srv/weenv --socket /run/weenv/snapshotter.sock "
            "--root /var/lib/weenv/snapshotter",
            "weenv snapshotter --print-config >> /etc/containerd/config.toml",
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
    p.add_argument("--print-config", action="store_true",
                   help="print containerd's configuration for this snapshotter and exit")


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
    from weenvfs.fuse.commands import default_cache_dir

    from .server import ServerOptions, serve

    options = ServerOptions(args.socket.absolute(), args.root.absolute(), tuple(args.stores),
                            (args.cache or default_cache_dir()).absolute(), args.keep_warm)
    return serve(options)
