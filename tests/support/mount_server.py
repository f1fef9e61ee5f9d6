"""A mount server (`weenv mountd`) of one test: started on a socket of the test's own and
always stopped, for the tests of the server (tests/fuse) and of sandboxes whose mounts fork
from it (tests/runtime)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from weenvfs.fuse import daemon, mountd


def server_pid(sock: Path) -> int | None:
    """The pid the server of socket `sock` recorded, or None."""
    try:
        return int(sock.with_name(sock.name + ".pid").read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def mount_server(sock: Path, monkeypatch: pytest.MonkeyPatch, *extra: str,
                 log_file: Path | None = None) -> Iterator[int]:
    """`weenv [--log-file LOG_FILE] mountd --detach EXTRA...` on `sock` ($WEENV_MOUNTD_SOCKET
    for the block, so this process and the CLI it runs use it); yields its pid; `--stop`, or
    SIGKILL, at the end."""
    monkeypatch.setenv(mountd.SOCKET_ENV, str(sock))
    monkeypatch.delenv(mountd.SWITCH_ENV, raising=False)
    logging = []
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        logging = ["--log-file", str(log_file)]
    subprocess.run([sys.executable, "-m", "weenvfs", *logging, "mountd", "--detach", *extra],
                   check=True, capture_output=True, timeout=120)
    pid = server_pid(sock)
    assert pid is not None and daemon.process_alive(pid)
    try:
        yield pid
    finally:
        subprocess.run([sys.executable, "-m", "weenvfs", "mountd", "--stop"],
                       capture_output=True, timeout=120, check=False)
        if daemon.process_alive(pid) and mountd._is_server(pid):
            os.kill(pid, signal.SIGKILL)
