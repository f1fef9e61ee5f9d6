"""Parked roots (weenvfs/runtime/parking.py): a run that changed nothing in its root leaves it
mounted, parked, for the next run of the same mounts, which takes it over; a run that changed
anything leaves nothing; a root over a mount that was mounted again is never taken; expired
roots are removed, and evictions remove those over the mounts they evict.

Real sandboxes, overlays and shared mounts (the `warm_root` fixture keeps mounts warm as on a
node; parking is on here, at its default time). The sandbox's hostname is its id: a run that
took a parked root over prints the id of the run that parked it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rt_support import EnvRef, run_weenv
from support.polling import wait_for

from weenvfs.fuse import daemon
from weenvfs.runtime import mounts, parking, rootfs, standby
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.sandbox import Sandbox, drop_parked
from weenvfs.runtime.sandbox_state import SANDBOXES_ROOT, read_state


def _run(env: EnvRef, *command: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return run_weenv("run", "--store", str(env.store), "--cache", str(env.cache), env.ref,
                     *command, check=check)


def _hostname(env: EnvRef) -> str:
    return _run(env, "hostname").stdout.decode().strip()


def _parked(env: EnvRef) -> list[str]:
    """Ids of the parked sandboxes over `env`'s mounts."""
    found = []
    for path in SANDBOXES_ROOT.iterdir():
        try:
            state = read_state(path)
        except (OSError, ValueError):
            continue
        if state.get("status") == "parked" and state.get("mounts") == list(env.keys):
            found.append(path.name)
    return found


def test_a_run_that_changes_nothing_parks_its_root_and_the_next_run_takes_it_over(
        parked_env: EnvRef) -> None:
    first = _hostname(parked_env)
    assert _parked(parked_env) == [first]
    box = Sandbox.load(first)
    assert box.status() == "parked" and box.state["owner"] is None
    assert rootfs.is_mount_point(box.rootfs) and not os.listdir(box.upper_root / "upper")
    # No process, but the init of the standby the node service starts in it after the run
    # (test_standby.py), once that is there.
    if standby.wanted():
        box.state = wait_for(lambda: (state := read_state(box.dir)).get("standby") and state,
                             "the standby", 30.0)
        assert box.processes() == [box.state["standby"]["pid"]]
    else:
        assert not box.processes() and "cgroup" not in box.state
    # The index names it under its stack of mounts; its mounts stay held by it.
    index = parking.PARKED_ROOT / parking.stack_name(list(parked_env.keys))
    assert index.read_text() == first
    assert all(first in m.holders for m in mounts.list_mounts())
    listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)["sandboxes"]
    assert [b["status"] for b in listed if b["id"] == first] == ["parked"]
    refused = run_weenv("sandbox", "exec", first, "true", check=False)
    assert refused.returncode != 0
    assert b"is parked" in refused.stderr and b"Traceback" not in refused.stderr

    assert _hostname(parked_env) == first  # taken over: the same sandbox, root and upper
    assert _parked(parked_env) == [first]  # and parked again
    # An eviction of its mounts removes it first, and leaves nothing (node_clean checks).
    run_weenv("mounts", "evict", "--all")
    assert not (SANDBOXES_ROOT / first).exists() and not index.exists()
    assert not any(daemon.is_mounted(mounts.mountpoint(k)) for k in parked_env.keys)


def test_a_bad_park_time_is_refused_before_anything_runs(parked_env: EnvRef,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("abc", "-1"):
        monkeypatch.setenv(parking.PARK_SECONDS_ENV, bad)
        refused = _run(parked_env, "sh", "-c", "echo ran", check=False)
        assert refused.returncode == 2 and refused.stdout == b"", refused
        assert refused.stderr == (f"weenv: error: ${parking.PARK_SECONDS_ENV} must be a "
                                  f"non-negative number, not '{bad}'\n").encode()
    assert _parked(parked_env) == []


@pytest.mark.parametrize("change", [
    "echo x > /tmp/made",  # a new file (its folder copied up)
    ": > /made && rm /made",  # made and removed again: the upper's times changed
    "chmod 0700 /",  # the root's own mode
    "touch -d 2001-01-01 /etc/hostname",  # a lower file's times (copied up)
])
def test_a_run_that_changes_its_root_is_not_parked_and_the_next_run_sees_none_of_it(
        parked_env: EnvRef, change: str) -> None:
    parked = _hostname(parked_env)  # so that the changing run takes a parked root over
    assert _hostname(parked_env) == parked
    assert _run(parked_env, "sh", "-c", f"{change}; hostname").stdout.decode().strip() == parked
    assert _parked(parked_env) == [] and not (SANDBOXES_ROOT / parked).exists()
    seen = _run(parked_env, "sh", "-c", "hostname; ls -A /tmp; ls -A / | grep -c made; "
                "stat -c %a /; stat -c %Y /etc/hostname", check=False).stdout.decode().split()
    fresh = _run(parked_env, "sh", "-c", "stat -c %a /").stdout.decode().strip()
    assert seen[0] != parked  # a new root
    assert seen[1:] == ["0", fresh, seen[-1]] and seen[-1] != "978307200"


def test_a_root_over_a_mount_that_was_mounted_again_is_not_taken(parked_env: EnvRef) -> None:
    """The shared mount's daemon dies under a parked root; the next run mounts it again (a
    new daemon) and must not take the root parked over the dead one: it gets a new root, and
    the old one is removed."""
    parked = _hostname(parked_env)
    [info] = [m for m in mounts.list_mounts() if m.key == parked_env.keys[0]]
    assert info.pid is not None
    os.kill(info.pid, signal.SIGKILL)
    wait_for(lambda: not daemon.process_alive(info.pid), "the daemon's death", 30.0)
    assert _hostname(parked_env) != parked
    assert not (SANDBOXES_ROOT / parked).exists()
    [again] = [m for m in mounts.list_mounts() if m.key == parked_env.keys[0]]
    assert again.pid != info.pid


def _kill_the_mount(env: EnvRef) -> None:
    [info] = [m for m in mounts.list_mounts() if m.key == env.keys[0]]
    assert info.pid is not None
    os.kill(info.pid, signal.SIGKILL)
    wait_for(lambda: not daemon.process_alive(info.pid), "the daemon's death", 30.0)


def test_a_root_parked_over_a_mount_that_died_in_its_run_is_never_taken(
        parked_env: EnvRef, assert_logs: Any) -> None:
    """The shared mount's daemon dies during a run, whose end does not ask (a round trip to
    every mount's daemon at the end of every run): gc removes the root parked over the dead
    mount, and a run before gc gets a new root (the old one removed)."""
    for removed_by in ("gc", "the next run"):
        if removed_by == "gc":
            env = Environment.open(parked_env.ref, store=parked_env.store,
                                   cache=parked_env.cache)
        else:  # the mount gc's turn left dead is mounted again
            with assert_logs(r"environment mount .* is dead .*; remounting", count=1):
                env = Environment.open(parked_env.ref, store=parked_env.store,
                                       cache=parked_env.cache)
        root = env.sandbox.id
        _kill_the_mount(parked_env)
        env.close()
        assert _parked(parked_env) == [root], removed_by
        if removed_by == "gc":
            assert drop_parked(expired_only=True) == [root]
        else:
            assert _hostname(parked_env) != root
        assert not (SANDBOXES_ROOT / root).exists(), removed_by


def test_expired_parked_roots_are_removed_by_gc_and_the_housekeeping(
        parked_env: EnvRef, monkeypatch: pytest.MonkeyPatch) -> None:
    parked = _hostname(parked_env)
    run_weenv("mounts", "evict", "--expired")  # not expired: kept
    run_weenv("sandbox", "gc")
    assert _parked(parked_env) == [parked]
    # Its time is its parker's: a remover with another setting (here parking off, as the
    # node service the first mount of a session of tests starts) does not cut it short.
    monkeypatch.setenv(parking.PARK_SECONDS_ENV, "0")
    assert json.loads(run_weenv("sandbox", "gc", "--json").stdout)["parked"] == []
    run_weenv("mounts", "evict", "--expired", "--quiet")
    assert _parked(parked_env) == [parked]
    assert drop_parked(expired_only=True, now=1e12) == [parked]  # past its time
    # Parked for a second, then removed by gc and by the housekeeping once it is past that.
    for remover in (("sandbox", "gc", "--json"), ("mounts", "evict", "--expired", "--quiet")):
        monkeypatch.setenv(parking.PARK_SECONDS_ENV, "1")
        parked = _hostname(parked_env)
        until = read_state(SANDBOXES_ROOT / parked)["parked"]["until"]
        assert until <= time.time() + 1
        monkeypatch.setenv(parking.PARK_SECONDS_ENV, "60")
        time.sleep(max(0.0, until - time.time()) + 0.05)
        done = run_weenv(*remover)
        if remover[1] == "gc":
            assert json.loads(done.stdout)["parked"] == [parked]
        assert not (SANDBOXES_ROOT / parked).exists() and _parked(parked_env) == []


def test_another_node_roots_housekeeping_leaves_a_parked_root_alone(
        parked_env: EnvRef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parked root's mounts are in the folder of shared mounts it was made in: the
    housekeeping of another one ($WEENV_ENVS_ROOT), which found no mount at those keys in
    its own folder, took the root for one over dead mounts and removed it (the tests' session
    service did so to this file's roots)."""
    parked = _hostname(parked_env)
    own = os.environ[mounts.ROOT_ENV]
    monkeypatch.setenv(mounts.ROOT_ENV, str(tmp_path / "other-envs"))
    for command in (("mounts", "evict", "--expired", "--quiet"), ("mounts", "evict", "--all")):
        assert b"Traceback" not in run_weenv(*command).stderr
        assert _parked(parked_env) == [parked]
    monkeypatch.setenv(mounts.ROOT_ENV, own)
    listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)["sandboxes"]
    assert [b["status"] for b in listed if b["id"] == parked] == ["parked"]
    assert _hostname(parked_env) == parked  # and the next run takes it over


def test_a_sandbox_removed_from_another_node_root_gives_its_mounts_back(
        parked_env: EnvRef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`weenv sandbox rm` run with another $WEENV_ENVS_ROOT releases the sandbox's mounts in
    the folder they are in (its state's), not in its own, where they are not: they were
    left held for good."""
    parked = _hostname(parked_env)
    held = {m.key: m.holders for m in mounts.list_mounts()}
    assert all(held[key] == (parked,) for key in parked_env.keys)
    own = os.environ[mounts.ROOT_ENV]
    monkeypatch.setenv(mounts.ROOT_ENV, str(tmp_path / "other-envs"))
    run_weenv("sandbox", "rm", parked)
    monkeypatch.setenv(mounts.ROOT_ENV, own)
    held = {m.key: m.holders for m in mounts.list_mounts()}
    assert all(held.get(key, ()) == () for key in parked_env.keys), held


def test_parking_off_parks_nothing(parked_env: EnvRef, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(parking.PARK_SECONDS_ENV, "0")
    first = _hostname(parked_env)
    assert _parked(parked_env) == [] and not (SANDBOXES_ROOT / first).exists()
    assert _hostname(parked_env) != first


def test_two_runs_at_once_take_one_parked_root_once(parked_env: EnvRef) -> None:
    parked = _hostname(parked_env)
    argv = [sys.executable, "-m", "weenvfs", "run", "--store", str(parked_env.store),
            "--cache", str(parked_env.cache), parked_env.ref, "sh", "-c", "hostname; sleep 1"]
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE) for _ in range(2)]
    names = [run.communicate(timeout=120)[0].decode().strip() for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    assert names.count(parked) <= 1 and names[0] != names[1]
    assert len(_parked(parked_env)) == 1  # one stack, one parked root


def test_the_python_api_parks_on_close_and_takes_over_on_open(parked_env: EnvRef) -> None:
    def use() -> str:
        with Environment.open(parked_env.ref, store=parked_env.store,
                              cache=parked_env.cache) as env:
            assert env.exec(["true"]).ok
            return env.sandbox.id

    first = use()
    assert _parked(parked_env) == [first]
    assert use() == first
    with Environment.open(parked_env.ref, store=parked_env.store,
                          cache=parked_env.cache) as env:  # takes it, then writes
        env.write_file("/tmp/note", b"x")
    assert _parked(parked_env) == []
