"""crun run from a sealed copy of itself (crun_binary.py, crun.py): the copy is the binary's
bytes with every seal crun checks, made once per binary and process (threads share it), made
again when the binary changes; and real sandboxes run from it, with no descriptor of it in
the sandbox.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rt_support import EnvRef

from weenvfs.runtime import crun_binary
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.runtimes import RUNTIME_ENV


@pytest.fixture(autouse=True)
def _no_copy_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crun_binary, "_copies", {})  # each test makes its own


def _content(fd: int) -> bytes:
    return os.pread(fd, 1 << 20, 0)


def test_the_copy_is_the_binary_sealed_against_every_change(tmp_path: Path) -> None:
    binary = tmp_path / "crun"
    binary.write_bytes(os.urandom(300_000))
    copy = crun_binary.sealed_copy(str(binary))
    assert copy is not None
    assert _content(copy) == binary.read_bytes()
    assert fcntl.fcntl(copy, fcntl.F_GET_SEALS) == crun_binary.SEALS
    assert fcntl.fcntl(copy, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # a child gets it if passed
    with pytest.raises(PermissionError):
        os.pwrite(copy, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(copy, 10)
    assert crun_binary.sealed_copy(str(binary)) == copy  # made once


def test_a_changed_binary_gets_a_new_copy_and_the_old_one_stays(tmp_path: Path) -> None:
    binary = tmp_path / "crun"
    binary.write_bytes(b"one" * 1000)
    first = crun_binary.sealed_copy(str(binary))
    with open(binary, "ab") as f:
        f.write(b"two")
    second = crun_binary.sealed_copy(str(binary))
    assert first is not None and second is not None and second != first
    assert _content(second) == b"one" * 1000 + b"two"
    assert _content(first) == b"one" * 1000  # another thread may be starting crun from it


def test_threads_share_one_copy(tmp_path: Path) -> None:
    binary = tmp_path / "crun"
    binary.write_bytes(os.urandom(2_000_000))
    got: list[int | None] = []
    threads = [threading.Thread(target=lambda: got.append(crun_binary.sealed_copy(str(binary))))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(got)) == 1 and got[0] is not None
    assert _content(got[0]) == binary.read_bytes()[:1 << 20]


def test_no_binary_no_copy(tmp_path: Path) -> None:
    assert crun_binary.sealed_copy(str(tmp_path / "missing")) is None


def test_sandboxes_run_crun_from_the_copy_and_never_see_it(
        env_ref: EnvRef, monkeypatch: pytest.MonkeyPatch,
        require_or_skip: Callable[[object, str], None]) -> None:
    require_or_skip(shutil.which("crun"), "crun not found (Debian package crun)")
    monkeypatch.setenv(RUNTIME_ENV, "crun")
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache) as env:
        box = env.sandbox
        spec = box.command(["sh", "-c", "ls /proc/self/fd; sleep 3"])
        proc, pid_file = box.exec(spec, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            deadline, exe = time.monotonic() + 10, ""
            while time.monotonic() < deadline and not exe.startswith("/memfd:"):
                exe = os.readlink(f"/proc/{proc.pid}/exe")  # the cgroup view helper first
                time.sleep(0.01)
            assert exe == "/memfd:weenv-crun (deleted)"  # crun itself, never copied again
            out, _ = proc.communicate(timeout=30)
        finally:
            box.forget_exec(pid_file)
        assert proc.returncode == 0
        assert out.split() == [b"0", b"1", b"2", b"3"]  # stdio and ls's own listing only
        assert env.exec(["true"]).ok  # and the one-shot and detached paths work from it
