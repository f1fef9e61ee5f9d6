"""How a mount's statistics leave its daemon: while it serves, through the virtual xattr
`user.weenv.stats` of its root (`read_stats`, what `weenv stats` shows); once, when it has
unmounted, as an exit report (`send_exit_report`) to whoever keeps the node's totals (the
metrics exporter of `weenv mountd`, fuse/metrics.py).

An exit report is one unix datagram, JSON {"pid", "start", "stats"}, sent to the socket
`<mountd socket>.exits` when something listens there (else it is dropped: nothing piles up
on a node without an exporter). `start` is field 22 of /proc/PID/stat, so a reused pid is
never taken for the daemon. It is sent after the FUSE session ended, so once a report is out
no `read_stats` can reach that daemon again, and before the daemon exits, so a scraper that
saw the daemon gone finds its report already queued (fuse/metrics.py relies on both).

Must not: import pyfuse3 or prometheus_client (`weenv stats` and every daemon use it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError, WeenvError

from . import STATS_XATTR, daemon, mountd

log = logging.getLogger(__name__)

EXITS_SUFFIX = ".exits"
MAX_REPORT = 1 << 20  # bytes of one exit report; a stats document is a few KiB
SEND_TIMEOUT = 2.0  # seconds a daemon waits for room in the receiver's queue


def read_stats(mountpoint: str | Path) -> dict[str, Any]:
    """The statistics document of the mount at `mountpoint` (on the kernel path, its device
    folder answers: the mount point itself is EROFS or overlayfs)."""
    target = Path(mountpoint)
    if daemon.is_kernel_mount(target):
        target = daemon.kernel_dir(daemon.mount_path(target)) / "devices"
    try:
        raw = os.getxattr(target, STATS_XATTR)
    except OSError as error:
        if error.errno in (errno.ENODATA, errno.ENOTSUP):
            raise UsageError(f"{mountpoint} is not a weenv mount") from None
        if error.errno == errno.ENOTCONN:
            raise WeenvError(
                f"the daemon of {mountpoint} is gone; run `weenv umount {mountpoint}`"
            ) from None
        raise WeenvError(f"cannot read statistics of {mountpoint}: {error.strerror}") from None
    return json.loads(raw)


def exits_path(server_socket: Path) -> Path:
    """The exit-report socket that belongs to the mount server of `server_socket`."""
    return server_socket.with_name(server_socket.name + EXITS_SUFFIX)


def send_exit_report(document: dict[str, Any]) -> bool:
    """Send this daemon's final statistics to the node's receiver, if one listens; True if
    it was queued. Never raises: a lost report costs numbers, not the mount's clean exit."""
    report = json.dumps({"pid": os.getpid(), "start": daemon.start_time(os.getpid()),
                         "stats": document}, sort_keys=True).encode()
    path = exits_path(mountd.socket_path())
    if len(report) > MAX_REPORT or not path.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as conn, \
                mountd.addressable(path) as address:
            conn.settimeout(SEND_TIMEOUT)
            conn.sendto(report, address)
    except OSError as error:  # nobody listens (a stale path), or the queue stayed full
        log.debug("exit report not sent to %s: %s", path, error)
        return False
    return True


def parse_exit_report(data: bytes) -> tuple[tuple[int, str], dict[str, Any]] | None:
    """((pid, start), stats document) of one exit report; None for anything malformed."""
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        report = json.loads(data)
        if (isinstance(report, dict) and isinstance(report.get("pid"), int)
                and isinstance(report.get("start"), str)
                and isinstance(report.get("stats"), dict)):
            return (report["pid"], report["start"]), report["stats"]
    return None
