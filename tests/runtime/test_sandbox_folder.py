"""runtime/sandbox_state.py: a sandbox's folder and its lock.

A teardown removes the folder under the sandbox's lock, its state first; a process taking the
lock meanwhile (a run taking a parked root, gc, a drop of parked roots) finds the sandbox gone
and never makes the lock file again. (It did: a folder holding only `lock` was left after a
benchmark of 32 environments at once, which `exists` took for a live sandbox and nothing
removed.) gc removes a folder that has had no state for a minute (test_cleanup.py runs it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weenvfs.runtime import sandbox_state
from weenvfs.runtime.sandbox_state import (
    STUB_AGE,
    locked,
    make_folder,
    remove_folder,
    remove_stub,
    write_state,
)


def _made(folder: Path) -> Path:
    make_folder(folder)
    write_state(folder, {"id": folder.name})
    return folder


def test_a_locker_between_the_teardowns_steps_finds_the_sandbox_gone(tmp_path: Path) -> None:
    folder = _made(tmp_path / "weenv-between")
    with locked(folder) as present:
        assert present
    # What the teardown's rmtree may have removed when another process opens the lock.
    (folder / "state.json").unlink()
    (folder / "lock").unlink()
    with locked(folder) as present:
        assert not present
    assert list(folder.iterdir()) == []  # the lock file was not made again


@pytest.fixture
def quick_switches() -> Iterator[None]:
    """Threads switch within the removal's steps (every 5 ms by default)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_lockers_racing_removals_leave_no_folder(tmp_path: Path, quick_switches: None) -> None:
    rounds, errors = 150, []
    for n in range(rounds):
        folder = _made(tmp_path / f"weenv-race{n}")
        stop = threading.Event()

        def lock_until_gone(folder: Path = folder, stop: threading.Event = stop) -> None:
            try:
                while not stop.is_set():
                    with locked(folder) as present:
                        if not present:
                            return
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        lockers = [threading.Thread(target=lock_until_gone) for _ in range(4)]
        for thread in lockers:
            thread.start()
        with locked(folder) as present:
            assert present
            remove_folder(folder)
        stop.set()
        for thread in lockers:
            thread.join(10)
        assert errors == []
        assert not folder.exists(), f"round {n}: left {sorted(os.listdir(folder))}"


def test_a_sandbox_made_before_its_folder_had_a_lock_file_is_locked(tmp_path: Path) -> None:
    # A sandbox of an earlier version, still running when the node's weenv was upgraded.
    folder = tmp_path / "weenv-older"
    folder.mkdir()
    write_state(folder, {"id": folder.name})
    with locked(folder) as present:
        assert present
    assert (folder / "lock").exists()


def test_make_folder_refuses_a_taken_id(tmp_path: Path) -> None:
    folder = _made(tmp_path / "weenv-taken")
    with pytest.raises(FileExistsError):
        make_folder(folder)
    assert (folder / "state.json").exists()


def test_a_folder_without_state_is_removed_once_it_is_a_minute_old(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_state, "SANDBOXES_ROOT", tmp_path)
    stub, young, live = tmp_path / "weenv-stub", tmp_path / "weenv-young", tmp_path / "weenv-live"
    make_folder(stub)
    make_folder(young)  # a sandbox being made: no state yet
    _made(live)
    old = time.time() - STUB_AGE - 5
    for folder in (stub, live):
        os.utime(folder, (old, old))
    assert [remove_stub(f.name) for f in (stub, young, live)] == [True, False, False]
    assert not stub.exists() and young.exists() and live.exists()
    assert not remove_stub("weenv-none")
