"""The `weenv mount`, `weenv umount`, `weenv stats` and `weenv mountd` commands.

Owns: their arguments, defaults and output (the daemon's command line is built by
`config.mount_args`, which the runtime uses too). `mount` without
`--foreground` starts the daemon (`spawn.spawn`), which checks the store before it mounts
(fail fast: its one-line error is reported by this process), and returns once the mount
answers; with `--foreground` it loads the environment and serves it in this process
(mount.py), reporting readiness on `--ready-fd` when a parent waits for it, and sends its
final statistics to the node's exporter when it exits (stats_channel.py). `stats` reads the
virtual xattr `user.weenv.stats` of the mount's root (see ops.py). Must not: serve requests
or manage processes itself.

Start-up cost matters here (DESIGN.md: mount to first `stat /` under 300 ms): the parent of a
background mount imports neither the store nor the core nor pyfuse3; the daemon does.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weenvfs.cli import add_command
from weenvfs.cli_args import add_store, page_root, positive, print_json
from weenvfs.errors import UsageError, WeenvError
from weenvfs.units import parse_size, size_arg

from . import daemon
from .config import DEFAULT_METRICS, PATHS, cache_dir_of, mount_args
from .stats_channel import read_stats

if TYPE_CHECKING:
    from weenvfs.core.loaded_env import LoadedEnv

    from .config import MountConfig

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = "10G"
DEFAULT_DEADLINE = 30.0


def _group_position(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a group position (0, 1, ...), got {text!r}")
    return int(text)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `mount`, `umount`, `stats` and `mountd`."""
    _register_mount(subparsers)
    _register_umount(subparsers)
    _register_stats(subparsers)
    _register_mountd(subparsers)


def _register_mount(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        subparsers,
        "mount",
        help="mount an environment read-only, loading file data lazily",
        description=(
            "Mount environment REF (NAME[:TAG] or a manifest digest) at MOUNTPOINT.\n"
            "Only the manifest and the group indexes are fetched; file data comes from the\n"
            "store on first use, through a node-local cache shared by every mount.\n"
            "Returns once the mount answers; the daemon logs to --log-file (default: a\n"
            "file under the cache folder). Stop it with `weenv umount MOUNTPOINT`."
        ),
        examples=[
            "weenv mount debian:12 /mnt/env --store file:///srv/weenv",
            "weenv mount debian:12 /mnt/env --store /srv/weenv --cache /var/cache/weenv "
            "--cache-size 20G",
            "weenv mount debian:12 /mnt/env --store /srv/weenv --foreground -v  # debugging",
            "weenv mount debian:12 /mnt/env --store /srv/weenv --fetch-all  # survive outages",
            "weenv mount debian:12 /mnt/env --store /srv/weenv --hint none --record-hints",
            "weenv mount debian:12 /mnt/g0 --store /srv/weenv --layer 0  # an overlayfs lower",
        ],
        func=_cmd_mount,
    )
    p.add_argument("ref", metavar="REF", help="environment NAME[:TAG] or manifest digest")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing, empty directory")
    add_store(p)
    p.add_argument("--nonempty", action="store_true",
                   help="mount over a directory that has files (they are hidden until unmount)")
    p.add_argument("--cache", type=Path, metavar="DIR", help="node chunk cache folder "
                   "(default: $WEENV_CACHE, else /var/cache/weenv/chunks)")
    p.add_argument("--cache-size", type=size_arg, default=parse_size(DEFAULT_CACHE_SIZE),
                   metavar="SIZE", help=f"cache bound (default {DEFAULT_CACHE_SIZE})")
    p.add_argument("--deadline", type=positive, default=DEFAULT_DEADLINE, metavar="SECS",
                   help="a read that cannot be served in SECS fails with EIO "
                   f"(default {DEFAULT_DEADLINE:g})")
    p.add_argument("--foreground", action="store_true",
                   help="serve in this process until unmounted (for debugging, supervisors)")
    p.add_argument("--allow-other", action=argparse.BooleanOptionalAction, default=None,
                   help="let other users in (default: yes when run as root; the kernel still "
                   "checks modes)")
    p.add_argument("--layer", type=_group_position, metavar="N",
                   help="serve only group N (0 is the lowest) as a kernel overlayfs lower "
                   "layer: whiteouts as 0/0 devices, opaque directories marked; stack the "
                   "groups' mounts with `mount -t overlay -o lowerdir=TOP:...:0`")
    p.add_argument("--path", choices=PATHS, default="auto",
                   help="kernel: metadata in the kernel (EROFS images, overlayfs for several "
                   "groups), only file data through this daemon; fuse: the whole tree over "
                   "FUSE; auto (default): kernel where it can run (root, EROFS), else fuse. "
                   "`weenv stats` says which one serves and why")
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    # Debugging and benchmarks/store.py: one ranged GET per chunk.
    p.add_argument("--no-coalesce", dest="coalesce", action="store_false", help=argparse.SUPPRESS)
    # benchmarks/coldstart_ref.py: no fetching of a missed chunk's neighbours (core/neighbours.py).
    p.add_argument("--no-neighbours", dest="neighbours", action="store_false",
                   help=argparse.SUPPRESS)
    _add_hint_options(p)


def _add_hint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hint", default="latest", metavar="TAG|DIGEST|none",
                   help="prefetch hint to replay in the background: a hint tag of this "
                   "environment, a hint digest, or none (default: tag latest, if it exists; "
                   "one that does not exist is a warning, and the mount goes on without)")
    p.add_argument("--fetch-all", action="store_true",
                   help="after the hint, fetch every chunk into the cache, so that the mount "
                   "keeps working if the store goes away")
    p.add_argument("--record-hints", nargs="?", const="latest", default=None, metavar="TAG",
                   help="record what is read and, on unmount, merge it into the hint TAG "
                   "(default latest) and publish it (the store must be writable)")
    p.add_argument("--record-result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--record-replace", action="store_true", help=argparse.SUPPRESS)
    # The runtime, for the top layer of a stack: the other layers' mounts, through which the
    # hint replay reads their hinted files into the page cache (core/page_warm.py).
    p.add_argument("--pages-through", action="append", default=[], metavar="N=DIR",
                   help=argparse.SUPPRESS)


def _register_umount(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        subparsers,
        "umount",
        help="unmount an environment and stop its daemon",
        description=(
            "Unmount MOUNTPOINT (fusermount3 -u) and wait for its daemon to exit. A mount\n"
            "namespace made while it was mounted (ip netns exec, unshare -m) may hold a copy\n"
            "that keeps the daemon serving: then this fails naming those processes, after\n"
            "2 s (10 s for a copy in use; the mount is gone here, the daemon ends when they\n"
            "let go)."),
        examples=["weenv umount /mnt/env", "weenv umount --lazy /mnt/env  # even while busy"],
        func=_cmd_umount,
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--lazy", action="store_true",
                   help="detach now, finish when no longer busy (fusermount3 -z)")


def _register_stats(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        subparsers,
        "stats",
        help="show what a mount fetched, cache hits and misses, fetch latency, errors",
        description="Show the statistics of the mount at MOUNTPOINT.",
        examples=["weenv stats /mnt/env", "weenv stats --json /mnt/env | jq .fetch"],
        func=_cmd_stats,
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--json", action="store_true", help="print JSON")


def _register_mountd(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        subparsers,
        "mountd",
        help="run the mount server: mounts start by fork, without Python start-up",
        description=(
            "Run the node's mount server in this process (for a supervisor such as systemd),\n"
            "or in the background with --detach. While it runs, `weenv mount`, `weenv run`\n"
            "and the Python API start each mount daemon by forking the server's warm\n"
            "interpreter (tenths of a second less per mount). They start one (--detach --idle\n"
            "600) when none answers. Socket: $WEENV_MOUNTD_SOCKET, else /run/weenv/mountd.sock\n"
            "for root. WEENV_MOUNTD=off makes clients neither use nor start a server. The\n"
            "server also evicts idle shared mounts past their bounds (`weenv mounts`).\n"
            "It exports the node's Prometheus metrics (docs/metrics.md) on --metrics, else\n"
            f"$WEENV_METRICS, else {DEFAULT_METRICS} (if that port is taken: no metrics)."
        ),
        examples=[
            "weenv mountd                    # foreground, until SIGTERM",
            "weenv mountd --detach --idle 600  # background, exits after 10 idle minutes",
            "weenv mountd --metrics 0.0.0.0:9387  # let other hosts scrape the node",
            "weenv mountd --metrics off      # no metrics endpoint",
            "weenv mountd --check            # exit 0 if a server answers",
            "weenv mountd --stop",
        ],
        func=_cmd_mountd,
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--detach", action="store_true",
                      help="start in the background; return once it listens")
    what.add_argument("--check", action="store_true", help="only check that a server answers")
    what.add_argument("--stop", action="store_true", help="stop the running server")
    p.add_argument("--idle", type=float, default=0.0, metavar="SECS",
                   help="exit after SECS without a request once no mount daemon it started "
                   "runs (default 0: never)")
    p.add_argument("--leave-cgroups", action="store_true",
                   help="move to the root cgroups first (as --detach and auto-start do)")
    p.add_argument("--metrics", type=_metrics_address, metavar="HOST:PORT|off",
                   help="where to serve the node's metrics over HTTP (port 0: any free "
                   "port; see `weenv mountd --check`), or off")
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def _metrics_address(text: str) -> str:
    from .exporter import argument

    return argument(text)


# -- mount ----------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> MountConfig:
    from .config import MountConfig

    mountpoint = daemon.mount_path(args.mountpoint)
    if daemon.is_mounted(mountpoint):
        raise UsageError(f"{mountpoint} is already a mount point (`weenv umount` it first)")
    if not mountpoint.exists():
        raise UsageError(f"mount point {mountpoint} does not exist (create it: mkdir -p)")
    if not mountpoint.is_dir():
        raise UsageError(f"mount point {mountpoint} is not a directory")
    if not args.nonempty and _has_entries(mountpoint):
        raise UsageError(f"mount point {mountpoint} is not empty: the mount would hide its "
                         "files (use an empty directory, or --nonempty to hide them)")
    allow_other = os.geteuid() == 0 if args.allow_other is None else args.allow_other
    if args.hint != MountConfig.hint or args.record_hints is not None:
        # core.node_hints imports the format and the store: only when there is something to check.
        from weenvfs.core.node_hints import check_hint_spec

        check_hint_spec(args.hint)
        if args.record_hints is not None:
            check_hint_spec(args.record_hints, "--record-hints", allow_none=False)
    if args.layer is not None and args.record_hints is not None:
        raise UsageError("--record-hints records a whole environment: mount it without --layer")
    return MountConfig(
        mountpoint=mountpoint,
        cache_dir=cache_dir_of(args.cache),
        cache_size=args.cache_size,
        deadline=args.deadline,
        allow_other=allow_other,
        hint=args.hint,
        fetch_all=args.fetch_all,
        record_tag=args.record_hints,
        record_result=None if args.record_result is None else args.record_result.absolute(),
        record_replace=args.record_replace,
        coalesce=args.coalesce,
        neighbours=args.neighbours,
        layer=args.layer,
        path=args.path,
        page_roots=_page_roots(args.pages_through),
    )


def _page_roots(values: list[str]) -> dict[int, Path]:
    """`N=DIR` of --pages-through: group position -> absolute folder (UsageError if not)."""
    out = {}
    for value in values:
        group, folder = page_root(value)
        if group is None:
            raise UsageError(f"--pages-through: {value!r}: a mount names its group (N=DIR)")
        out[group] = folder
    return out


def _check_writable(store_url: str) -> None:
    """--record-hints publishes at unmount, from the daemon: a store that cannot take it is
    said now, by this command, not in the daemon's log once the work is done."""
    from weenvfs.errors import StoreError
    from weenvfs.store import open_store

    with open_store(store_url) as store:
        try:
            store.check(write=True)
        except StoreError as error:
            raise UsageError(f"cannot record hints: {error}") from None


def _has_entries(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return next(entries, None) is not None
    except OSError:
        return False  # unreadable: let the mount itself report what is wrong


def _cmd_mount(args: argparse.Namespace) -> int:
    if args.foreground:
        return _mount_foreground(args)
    from .spawn import spawn  # loads the mount server's client: not for umount or stats

    config = _config(args)
    if config.record_tag is not None:
        _check_writable(args.store)
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    log_file = Path(args.log_file or _default_log_file(config)).absolute()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    child = mount_args(
        args.ref, config.mountpoint, args.store, config.cache_dir, log_file=log_file,
        cache_size=config.cache_size, deadline=config.deadline,
        allow_other=config.allow_other, hint=config.hint, fetch_all=config.fetch_all,
        record_tag=config.record_tag, record_result=config.record_result,
        record_replace=config.record_replace, coalesce=config.coalesce,
        neighbours=config.neighbours, layer=config.layer, path=config.path,
        verbose=args.verbose, nonempty=args.nonempty, page_roots=config.page_roots,
    )
    pid = spawn(child, log_file)
    # Mounted: a Ctrl-C from now on would report "interrupted" over a mount that stays.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.info("mounted %s at %s (daemon %d, log %s)", args.ref, config.mountpoint, pid, log_file)
    return 0


def _default_log_file(config: MountConfig) -> Path:
    return config.cache_dir / "logs" / (daemon.pid_file(config.mountpoint).stem + ".log")


def _mount_foreground(args: argparse.Namespace) -> int:
    import trio

    from .mount import STOP_SIGNALS, load, serve

    pipe = daemon.ReadyPipe(args.ready_fd)
    if args.ready_fd is not None:
        _log_to_file_only()
    try:
        config = _config(args)
        # Nothing is mounted yet: a SIGTERM while the store is read (a stalled store, a
        # Ctrl-C'd `weenv mount`) ends the daemon at once.
        env = load(args.store, args.ref, config.layer, config.cache_dir)
        _warn_missing_hint(env, config.hint, pipe)
        # The loaded indexes live as long as the daemon: keep them out of every collection
        # (as the node service does with its modules before it forks this process).
        gc.freeze()
    except Exception as error:
        pipe.failed(str(error) or type(error).__name__)
        raise
    # From here SIGTERM/SIGINT wait until the main loop can tear down what is already mounted
    # (a signal that killed the daemon mid-mount left the mount behind); mount.py unblocks them.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    from . import mountd, stats_channel

    # `server`: the node service whose metrics count this mount (fuse/metrics.py).
    info = {"ref": args.ref, "manifest": env.digest, "log_file": args.log_file,
            "layer": config.layer, "server": str(mountd.socket_path())}

    def ready() -> None:
        daemon.write_pid_file(config.mountpoint, info)
        pipe.ready()

    try:
        final = trio.run(serve, env, config, ready)
        stats_channel.send_exit_report(final)
    except Exception as error:
        pipe.failed(str(error) or type(error).__name__)
        raise
    finally:
        # Unmounted already: a late SIGTERM must not cut the clean-up short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        daemon.remove_pid_file(config.mountpoint, os.getpid())
        env.store.close()
    return 0


def _warn_missing_hint(env: LoadedEnv, hint: str, pipe: daemon.ReadyPipe) -> None:
    """Tell the user of a `--hint` naming a hint that is not there (the replay would only log
    it in the daemon's log file)."""
    from weenvfs.core.node_hints import NO_HINT, missing_hint

    from .config import MountConfig

    if hint in (MountConfig.hint, NO_HINT) or not env.serves_top:
        return
    note = missing_hint(env, hint)
    if note is None:
        return
    if pipe.fd is None:  # in the foreground: this process is the one on the console
        log.warning("%s", note)
    else:
        pipe.warn(note)  # the parent logs it (on the console, and in the log file)


def _log_to_file_only() -> None:
    """A daemon's stderr is its log file already: drop the console handler so that every
    record appears once (the file handler main() installed keeps timestamps and pids)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and handler.stream is sys.stderr:
            root.removeHandler(handler)


# -- mountd ---------------------------------------------------------------------------------


def _cmd_mountd(args: argparse.Namespace) -> int:
    from . import mountd

    if args.check:
        from .exporter import read_address

        mountd.check_running()
        address = read_address(mountd.socket_path())
        metrics = f"; metrics on http://{address}/metrics" if address else "; no metrics"
        print(f"a mount server answers on {mountd.socket_path()}{metrics}")
        return 0
    if args.stop:
        pid = mountd.stop()
        print(f"stopped mount server {pid}" if pid else "no mount server was running")
        return 0
    if args.detach:
        try:
            mountd.check_running()
        except WeenvError:
            pass
        else:
            print(f"a mount server already answers on {mountd.socket_path()}")
            return 0
        log_file = mountd.socket_path().with_suffix(".log")
        log_file.parent.mkdir(parents=True, exist_ok=True)
        argv = [*(["--log-file", args.log_file] if args.log_file else []), "mountd",
                "--idle", repr(args.idle), "--leave-cgroups",
                *(["--metrics", args.metrics] if args.metrics is not None else [])]
        pid = daemon.start(argv, log_file)
        print(f"mount server {pid} listens on {mountd.socket_path()} (log {log_file})")
        return 0
    pipe = daemon.ReadyPipe(args.ready_fd)
    if args.ready_fd is not None:
        _log_to_file_only()
    try:
        from weenvfs import cli

        from .exporter import Exporter, choose

        address, chosen = choose(args.metrics)
        exporter = None if address is None else Exporter(address, chosen, mountd.socket_path())
        return mountd.serve(args.idle, cli.main, ready=pipe.ready,
                            leave_cgroups=args.leave_cgroups, exporter=exporter,
                            preload=cli.SERVICE_MODULES, later=cli.pull_modules(),
                            prepare=cli.prebuild_parsers)
    except Exception as error:
        pipe.failed(str(error) or type(error).__name__)
        raise


# -- umount and stats -----------------------------------------------------------------------


def _cmd_umount(args: argparse.Namespace) -> int:
    daemon.unmount(args.mountpoint, lazy=args.lazy)
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    document = read_stats(args.mountpoint)
    if args.json:
        print_json(document)
        return 0
    for key, value in _flatten(document):
        print(f"{key:<40} {value}")
    return 0


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        out: list[tuple[str, Any]] = []
        for key, inner in value.items():
            out.extend(_flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list):
        return [(prefix, ", ".join(map(str, value)))]
    return [(prefix, "-" if value is None else value)]
