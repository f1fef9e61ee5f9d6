"""Serving the snapshotter: a gRPC server on a unix socket that containerd's proxy plugin
dials (docs/containerd.md has the configuration).

Start: take the root (one snapshotter per root), serve the metrics (metrics.py), restore
every WeEnv snapshot's group mount (snapshots.restore), then listen: the socket (mode 0600,
root's) appears only once the snapshots answer. Stop (SIGTERM, SIGINT): stop answering, wait
up to STOP_GRACE seconds for calls in flight, remove the socket. Mounts are left as they are:
they belong to the node (runtime/mounts.py), containers keep running on them, and the next
start takes them again.

Owns: the server's life. Must not: implement calls (snapshots.py) or parse arguments.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from weenvfs.errors import UsageError

from . import metrics
from .remote import Groups
from .service import Observe, handler
from .snapshots import Snapshots
from .state import SnapshotState

log = logging.getLogger(__name__)

STOP_GRACE = 10.0  # seconds for calls in flight at SIGTERM
WORKERS = 8  # concurrent calls (a WeEnv Prepare waits for a mount daemon to answer)


@dataclass(frozen=True)
class ServerOptions:
    """Where the snapshotter listens and keeps state, and what it may mount."""

    socket: Path
    root: Path
    stores: tuple[str, ...]
    cache_dir: Path
    keep_warm: float | None = None
    metrics: str | None = None  # --metrics HOST:PORT|off (None: $WEENV_SNAPSHOTTER_METRICS...)
    node_metrics: bool = False  # serve the node's mount metrics too (metrics.py)


def serve(options: ServerOptions, ready: Callable[[], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0."""
    if not options.stores:
        raise UsageError("give at least one --store: WeEnv layers are mounted only from "
                         "the stores the snapshotter is configured with")
    options.root.mkdir(parents=True, exist_ok=True)
    state = SnapshotState(options.root)
    try:
        groups = Groups(list(options.stores), options.cache_dir, options.root, options.keep_warm)
        snaps = Snapshots(state, groups)
        # Before the restore: a bad address fails first, and the node's metrics are settled
        # before a mount starts the node's mount server.
        endpoint = metrics.start(snaps, options.metrics, options.socket, options.node_metrics)
        try:
            restored, failed = snaps.restore()
            for line in failed:
                log.error("could not restore a WeEnv snapshot: %s", line)
            log.info("snapshotter: %d snapshots in %s, %d WeEnv mounts restored",
                     len(state.by_key), options.root, restored)
            return _listen(options.socket, snaps, ready,
                           endpoint.observe if endpoint else None)
        finally:
            if endpoint is not None:
                endpoint.close()
    finally:
        state.close()


def _listen(path: Path, snaps: Snapshots, ready: Callable[[], None] | None,
            observe: Observe | None) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS,
                                            thread_name_prefix="snapshotter"))
    server.add_generic_rpc_handlers((handler(snaps, observe) if observe else handler(snaps),))
    # Bound under another name and renamed once serving: a client that finds the socket is
    # answered (a call between bind and start fails with `unavailable`).
    binding = path.with_name(f".{path.name}.{os.getpid()}")
    old_mask = os.umask(0o177)
    try:
        if server.add_insecure_port(f"unix:{binding}") == 0:
            raise UsageError(f"cannot listen on {path}")
        server.start()
        os.replace(binding, path)
    finally:
        os.umask(old_mask)
    log.info("snapshotter %d listening on %s", os.getpid(), path)
    try:
        if ready is not None:
            ready()
        while not stop.wait(1.0):
            pass
        log.info("snapshotter stopping")
    finally:
        server.stop(STOP_GRACE).wait()
        with contextlib.suppress(OSError):
            path.unlink()
        for signum, old in previous.items():
            signal.signal(signum, old)
    return 0
