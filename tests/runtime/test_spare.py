"""The node service's spare (weenvfs/fuse/service_forks.py `fork_spare`): a child forked
while the service is idle, which the next `weenv run` is handed to instead of a fork. It
becomes that run, another is forked after it, it never holds a client's descriptors, one
that died is replaced by a fork, none is made with WEENV_SPARE=off, and it ends with the
service. It writes ahead the pages the last learning run wrote (fuse/spare_pages.py).

Real sandboxes and a node service of each test's own (`mount_server`).
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rt_support import EnvRef, started_run
from support.mount_server import mount_server
from support.polling import wait_for
from support.processes import node_processes

from weenvfs.fuse import daemon, spare_pages
from weenvfs.fuse.mountd import SPARE_AFTER
from weenvfs.fuse.service_forks import SPARE_SWITCH

WAIT = 60.0  # a safety bound, not a timing
TITLE = b"weenv mountd: spare for the next weenv run"


def _spares(server: int) -> list[int]:
    """The children of `server` waiting as its spare."""
    return [proc.pid for proc in node_processes()
            if proc.parent == server and proc.command == TITLE]


def _spare(server: int, other_than: int | None = None) -> int:
    [pid] = wait_for(lambda: [p for p in _spares(server) if p != other_than] or None,
                     "the service's spare", WAIT)
    return int(pid)


def _argv(env: EnvRef, *command: str) -> list[str]:
    return [sys.executable, "-m", "weenvfs", "run", "--store", str(env.store), "--cache",
            str(env.cache), env.ref, *command]


def _run(env: EnvRef, *command: str) -> subprocess.CompletedProcess[bytes]:
    # Pipes, read to their end: a spare holding a client's descriptor would hang this.
    return subprocess.run(_argv(env, *command), capture_output=True, timeout=WAIT, check=True)


def test_a_run_becomes_the_spare_and_another_is_forked(env_ref: EnvRef, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch) as server:
        assert _run(env_ref, "echo", "first").stdout == b"first\n"  # the service's preloads
        spare = _spare(server)
        with started_run(_argv(env_ref, "sh", "-c", "echo started; sleep 1000")) as child:
            with open(f"/proc/{spare}/cmdline", "rb") as f:
                assert b"weenvfs run " in f.read()  # the spare is this run's process
            after = _spare(server, other_than=spare)  # and the next one waits already
            child.kill()
            child.wait(WAIT)
        wait_for(lambda: not daemon.process_alive(spare), "the run's end", WAIT)
        assert _run(env_ref, "echo", "again").stdout == b"again\n"
        wait_for(lambda: not daemon.process_alive(after), "the next run taking it", WAIT)
        last = _spare(server, other_than=after)
    wait_for(lambda: not daemon.process_alive(last), "the spare's end with the service", WAIT)


def test_a_spare_that_died_is_replaced_by_a_fork(env_ref: EnvRef, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch) as server:
        _run(env_ref, "true")
        spare = _spare(server)
        os.kill(spare, signal.SIGKILL)
        wait_for(lambda: not daemon.process_alive(spare), "the spare's death", WAIT)
        assert _run(env_ref, "echo", "forked").stdout == b"forked\n"
        _spare(server, other_than=spare)


@pytest.mark.parametrize("value", ["off", "maybe"])
def test_switched_off_the_service_forks_every_run(env_ref: EnvRef, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  value: str) -> None:
    """A value neither on nor off is one line in the service's log, once, and no spare."""
    monkeypatch.setenv(SPARE_SWITCH, value)
    log = tmp_path / "mountd.log"
    with mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch,
                      log_file=log) as server:
        for word in ("one", "two"):
            assert _run(env_ref, "echo", word).stdout == f"{word}\n".encode()
            time.sleep(SPARE_AFTER * 5)  # past when one would have been forked
            assert _spares(server) == []
    said = log.read_text().count(f"${SPARE_SWITCH} is neither on nor off: no spare")
    assert said == (1 if value == "maybe" else 0)


def _private_dirty(pid: int) -> int:
    """Bytes of `pid`'s memory that it alone has written (copied from the service's)."""
    with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        for line in f:
            if line.startswith(b"Private_Dirty:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no Private_Dirty for {pid}")


def test_the_spare_writes_ahead_the_pages_a_run_wrote(env_ref: EnvRef, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run learns (no spare wrote pages ahead for it); the spare forked after it
    copies those pages before any request; a run that such a spare became does not learn
    again; once the file is due, the next spare leaves it to its run, which learns. The
    file goes with the service."""
    sock = tmp_path / "mountd" / "mountd.sock"
    pages = Path(f"{sock}.pages")
    with mount_server(sock, monkeypatch) as server:
        _run(env_ref, "true")
        wait_for(pages.exists, "the first run's pages", WAIT)
        ranges = pages.read_bytes()[len(spare_pages.SERVICE):]  # the service's token first
        learned = sum(count for _, count in struct.iter_unpack("=QQ", ranges))
        assert learned > 100, learned
        spare = _spare(server)
        wait_for(lambda: _private_dirty(spare) > learned * spare_pages.PAGE // 2,
                 "the spare's pages written ahead", WAIT)
        written = pages.stat().st_mtime_ns
        old = pages.stat().st_mtime - spare_pages.LEARN_EVERY - 1
        os.utime(pages, (old, old))  # due now, after that spare wrote ahead
        _run(env_ref, "true")  # that spare's run: it does not learn
        time.sleep(SPARE_AFTER * 5)
        assert pages.stat().st_mtime_ns < written
        plain = _spare(server, other_than=spare)  # forked when due: writes nothing ahead
        assert _private_dirty(plain) < learned * spare_pages.PAGE // 2
        _run(env_ref, "true")  # and its run learns
        wait_for(lambda: pages.stat().st_mtime_ns > written, "the pages learned again", WAIT)
    assert not pages.exists()  # gone with the service: no other service could use them
