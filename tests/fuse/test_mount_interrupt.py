"""Ctrl-C during `weenv mount` (issue 14): the daemon runs in its own session, so the
interrupted parent must stop it, and an interrupted mount leaves nothing mounted and no
daemon running; a mount that completed before the signal says so (exit 0).

SIGINT goes to a real `weenv mount` subprocess at several moments: before the daemon started,
while it starts (before and after its `pid N` line), and after it answered. The delays only
spread the moments; nothing here asserts a time. Then, on each path (kernel, FUSE), while the
daemon waits for a store that stalls its index fetch (tests/store/fault_proxy.py in front of
the store served over HTTP): the daemon must end at once, not after its stop timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mounts import force_unmount, publish, stop_daemon
from support.processes import node_processes

from weenvfs.fuse import daemon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store"))
from fault_proxy import FaultProxy  # noqa: E402 - tests/store is not on the path by itself
from http_server import RangeHTTPServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("requires_fuse")

DELAYS = (0.0, 0.15, 0.3, 0.5, 0.8, 1.2, 2.0)


def _daemons_of(mountpoint: Path) -> list[int]:
    """Pids of live processes serving `mountpoint` (a daemon's command line or title)."""
    needle = os.fsencode(f" {mountpoint} ")
    return [proc.pid for proc in node_processes()
            if b"weenvfs" in proc.command and b"--foreground" in proc.command
            and needle in proc.command + b" " and daemon.process_alive(proc.pid)]


def _clean_up(proc: subprocess.Popen[bytes], mp: Path) -> None:
    """Whatever a failed test left: the command, the mount and its daemon."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    force_unmount(mp)
    for pid in _daemons_of(mp):
        stop_daemon(pid, mp)


@pytest.fixture(scope="module")
def env_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("interrupt")
    src = root / "src"
    src.mkdir()
    (src / "hello").write_text("hello\n")
    return publish(root / "store", [src]), root / "store"


@pytest.mark.parametrize("delay", DELAYS)
def test_interrupted_mount_leaves_nothing(env_store: tuple[str, Path], tmp_path: Path,
                                          delay: float) -> None:
    ref, store = env_store
    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weenvfs", "--log-file", str(tmp_path / "mount.log"), "mount",
         ref, str(mp), "--store", str(store), "--cache", str(tmp_path / "cache")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        mounted, daemons = daemon.is_mounted(mp), _daemons_of(mp)
        if proc.returncode == 0:  # it completed before the signal: mounted, and said so
            assert mounted and daemons
        else:
            assert proc.returncode in (130, -signal.SIGINT), err
            assert not mounted, f"still mounted after: {err!r}"
            assert daemons == [], f"daemon left running after: {err!r}"
            assert daemon.read_pid_file(mp) is None
    finally:
        _clean_up(proc, mp)


# A Ctrl-C still unanswered after this waited for the daemon's stop (or spawn) to time out.
HANG_GUARD = min(daemon.SPAWN_TIMEOUT, daemon.EXIT_TIMEOUT) / 2


@pytest.mark.parametrize("path", ["kernel", "fuse"])
def test_interrupted_while_the_store_stalls(env_store: tuple[str, Path], tmp_path: Path,
                                            path: str) -> None:
    ref, store = env_store
    mp = tmp_path / "mnt"
    mp.mkdir()
    with RangeHTTPServer(store) as server, \
            FaultProxy(server.url, "t", stall=3600, match=r"^GET .*/indexes/") as proxy:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weenvfs", "--log-file", str(tmp_path / "mount.log"),
             "mount", ref, str(mp), "--store", proxy.url, "--cache", str(tmp_path / "cache"),
             "--path", path],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
        )
        try:
            while proxy.requests(code="t") == 0:  # the daemon waits for the stalled index
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
            _, err = proc.communicate(timeout=HANG_GUARD)
            assert proc.returncode == 130, err
            assert err.decode().strip().splitlines()[-1] == "weenv: interrupted", err
            assert not daemon.is_mounted(mp)
            assert _daemons_of(mp) == []
        finally:
            _clean_up(proc, mp)
