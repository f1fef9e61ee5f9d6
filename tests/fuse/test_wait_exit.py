"""`daemon.wait_exit`: returns once a process that is not our child has exited (woken by a
pidfd), raises after its timeout while it runs, and returns at once for a pid that is gone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weenvfs.errors import WeenvError
from weenvfs.fuse import daemon


def _orphan(seconds: float) -> int:
    """The pid of a `sleep SECONDS` whose parent has exited (re-parented, as a daemon is)."""
    out = subprocess.run(
        [sys.executable, "-c",
         f"import subprocess; print(subprocess.Popen(['sleep', '{seconds}'], "
         "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
        capture_output=True, text=True, check=True, timeout=30)
    return int(out.stdout)


def test_it_returns_once_the_process_exited() -> None:
    pid = _orphan(2)
    assert daemon.process_alive(pid)
    daemon.wait_exit(pid, 30)
    assert not daemon.process_alive(pid)


def test_it_raises_after_the_timeout_while_the_process_runs() -> None:
    pid = _orphan(60)
    try:
        with pytest.raises(WeenvError, match=f"mount daemon {pid} did not exit within 0.2 s"):
            daemon.wait_exit(pid, 0.2)
        assert daemon.process_alive(pid)
    finally:
        subprocess.run(["kill", str(pid)], check=False)
    daemon.wait_exit(pid, 30)


def test_a_pid_that_is_gone_returns_at_once() -> None:
    pid = _orphan(0)
    daemon.wait_exit(pid, 30)
    daemon.wait_exit(pid, 0)
