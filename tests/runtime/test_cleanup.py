"""Commands that time out, fork-bomb or get killed, and controllers that crash, leave nothing.

A timed-out command's whole session is killed and the sandbox stays usable; a fork bomb
inside its pids limit is contained and killed at its timeout; `weenv run` removes its
sandbox when it is terminated; `weenv sandbox gc` clears what a `kill -9` of the controlling
process left. `node_clean` (conftest) then checks that no mount, cgroup, process, runc
container or upper dir remains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from rt_support import (
    EnvRef,
    controller,
    gc_over_an_orphan,
    owned_by,
    pid_visible,
    run_weenv,
)

from weenvfs.fuse import daemon
from weenvfs.runtime import cgroups, sandbox_state
from weenvfs.runtime.environment import TIMEOUT_EXIT, Environment
from weenvfs.runtime.sandbox import UPPERS_ROOT, Sandbox

WAIT = 60.0


def _open(env: EnvRef, **kwargs: object) -> Environment:
    return Environment.open(env.ref, store=env.store, cache=env.cache, **kwargs)  # type: ignore[arg-type]


def test_timeout_kills_the_commands_session_and_the_sandbox_lives_on(env_ref: EnvRef) -> None:
    with _open(env_ref) as env:
        init = env.sandbox.state["init_pid"]
        done = env.exec("sleep 1000 & sleep 1000 & echo waiting; wait", timeout=1)
        assert done.timed_out and done.exit_code == TIMEOUT_EXIT
        assert done.stdout == b"waiting\n"
        assert env.sandbox.processes() == [init]
        assert env.exec(["echo", "still here"]).stdout == b"still here\n"


def test_a_detached_daemon_survives_its_exec_but_not_the_sandbox(env_ref: EnvRef) -> None:
    env = _open(env_ref)
    try:
        # setsid: a new session, as a daemon makes; the exec returns at once.
        assert env.exec("setsid sleep 1000 > /dev/null 2>&1 < /dev/null &").ok
        assert len(env.sandbox.processes()) == 2
        pids = env.sandbox.processes()
    finally:
        env.close()
    assert not any(daemon.process_alive(p) for p in pids)


def test_fork_bomb_within_its_pids_limit_is_contained_and_cleaned_up(env_ref: EnvRef) -> None:
    with _open(env_ref, pids=48) as env:
        init = env.sandbox.state["init_pid"]
        bomb = "bomb() { bomb | bomb & }; bomb; exec sleep 1000"  # exec: no fork needed
        done = env.exec(["sh", "-c", bomb], timeout=3)
        assert done.timed_out
        assert env.sandbox.processes() == [init]
        folder = {d.parent.parent.name: d for d in cgroups.cgroup_dirs(env.sandbox.cgroup_path)}
        if "pids" in folder:  # v1: the limit was hit (the bomb was stopped by it)
            events = (folder["pids"] / "pids.events").read_text()
            assert int(events.split()[-1]) > 0, events
        assert env.exec(["echo", "ok"]).stdout == b"ok\n"


def test_weenv_run_terminated_removes_its_sandbox(env_ref: EnvRef) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weenvfs",
            "run",
            env_ref.ref,
            "--store",
            str(env_ref.store),
            "--cache",
            str(env_ref.cache),
            "--",
            "sh",
            "-c",
            "echo started; sleep 1000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"started\n"
        running = owned_by(child.pid)
        assert len(running) == 1
        box = Sandbox.load(running[0])
        pids = box.processes()
        child.send_signal(signal.SIGTERM)
        assert child.wait(WAIT) == 128 + signal.SIGTERM
        assert child.stderr is not None
        assert child.stderr.read().decode().strip().endswith("weenv: terminated by SIGTERM")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert not sandbox_state.exists(box.id)
    assert not any(daemon.process_alive(p) for p in pids)
    assert not daemon.is_mounted(env_ref.mountpoint())


def test_weenv_run_exits_with_the_commands_status_even_when_killed(env_ref: EnvRef) -> None:
    base = ("run", env_ref.ref, "--store", str(env_ref.store), "--cache", str(env_ref.cache))
    assert run_weenv(*base, "--", "sh", "-c", "exit 7", check=False).returncode == 7
    assert run_weenv(*base, "--", "sh", "-c", "kill -9 $$", check=False).returncode == 137
    assert run_weenv(*base, "--", "no-such-cmd", check=False).returncode == 127
    denied = run_weenv(*base, "--", "/etc/passwd", check=False)
    assert denied.returncode == 126 and b"permission denied" in denied.stderr


def test_gc_clears_orphans_after_kill_9_of_the_controller(env_ref: EnvRef) -> None:
    pids: list[int] = []

    def killed_controller() -> str:
        with controller(env_ref, command="sleep 1000 > /dev/null 2>&1 &") as (child, made):
            pids[:] = Sandbox.load(made).processes()
            assert len(pids) == 2
            child.kill()  # SIGKILL: no clean-up code runs
            child.wait(WAIT)
        listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)["sandboxes"]
        if sandbox_state.exists(made):  # (else the node's housekeeping took it meanwhile)
            assert all(daemon.process_alive(p) for p in pids)
            assert {"id": made, "status": "orphaned"}.items() <= next(
                b for b in listed if b["id"] == made
            ).items()
        return made

    sandbox_id, report = gc_over_an_orphan(killed_controller)
    assert sandbox_id in report["sandboxes"]
    assert not sandbox_state.exists(sandbox_id)
    assert not any(pid_visible(p) and daemon.process_alive(p) for p in pids)
    assert not cgroups.cgroup_dirs(f"/weenv/{sandbox_id}")
    assert not (UPPERS_ROOT / sandbox_id).exists()
    assert not daemon.is_mounted(env_ref.mountpoint())


def test_housekeeping_clears_a_sandbox_whose_controller_was_killed(env_ref: EnvRef) -> None:
    """What the node service runs every minute and after every release removes the sandbox
    of a controller killed with SIGKILL, and leaves a live one alone."""
    with controller(env_ref, command="sleep 1000 > /dev/null 2>&1 &") as (child, sandbox_id):
        pids = Sandbox.load(sandbox_id).processes()
        child.kill()  # SIGKILL: no clean-up code runs
        child.wait(WAIT)
    with _open(env_ref) as live:
        run_weenv("mounts", "evict", "--expired", "--quiet")
        assert not sandbox_state.exists(sandbox_id)
        assert not any(pid_visible(p) and daemon.process_alive(p) for p in pids)
        assert not cgroups.cgroup_dirs(f"/weenv/{sandbox_id}")
        assert sandbox_state.exists(live.id) and live.exec(["true"]).ok


def test_gc_leaves_live_and_detached_sandboxes_alone(env_ref: EnvRef) -> None:
    detached = (
        run_weenv(
            "sandbox",
            "create",
            env_ref.ref,
            "--store",
            str(env_ref.store),
            "--cache",
            str(env_ref.cache),
        )
        .stdout.decode()
        .strip()
    )
    try:
        with _open(env_ref) as env:
            report = json.loads(run_weenv("sandbox", "gc", "--json").stdout)
            assert env.id not in report["sandboxes"] and detached not in report["sandboxes"]
            assert env.exec(["true"]).ok
        assert run_weenv("sandbox", "exec", detached, "--", "true").returncode == 0
    finally:
        run_weenv("sandbox", "rm", detached)


def test_gc_removes_an_upper_dir_without_sandbox_but_keeps_a_kept_one(
    env_ref: EnvRef,
) -> None:
    base = ("run", env_ref.ref, "--store", str(env_ref.store), "--cache", str(env_ref.cache))
    done = run_weenv(*base, "--keep", "--", "sh", "-c", "echo kept > /root/kept")
    kept = Path(done.stderr.decode().split("kept in ")[1].split()[0])
    stray = UPPERS_ROOT / "weenv-straytest"
    try:
        assert (kept / "root" / "kept").read_text() == "kept\n"
        (stray / "upper").mkdir(parents=True)
        report = json.loads(run_weenv("sandbox", "gc", "--json").stdout)
        assert str(stray) in report["uppers"] and not stray.exists()
        assert kept.exists()
    finally:
        subprocess.run(["rm", "-rf", str(kept.parent), str(stray)], check=False)
    assert os.path.exists(UPPERS_ROOT)


def test_gc_clears_a_sandbox_whose_creator_died_halfway(env_ref: EnvRef) -> None:
    # What a creator killed right after writing the state leaves: a folder and a state that
    # names it (a process that has exited) as the owner, nothing built yet.
    folder = sandbox_state.SANDBOXES_ROOT / "weenv-halfmadetest"

    def half_made() -> str:
        dead = subprocess.Popen(["true"])
        start = sandbox_state.process_start(dead.pid)
        dead.wait()
        folder.mkdir(parents=True)
        state = {
            "id": folder.name,
            "owner": {"pid": dead.pid, "start": start or 1},
            "status": "creating",
            "tmpfs_upper": False,
            "env": {"ref": env_ref.ref, "digest": env_ref.digest},
        }
        (folder / "state.json").write_text(json.dumps(state))
        return folder.name

    sandbox_id, report = gc_over_an_orphan(half_made)
    assert sandbox_id in report["sandboxes"] and report["errors"] == []
    assert not folder.exists()


def test_gc_removes_a_sandbox_folder_without_state_once_it_is_a_minute_old() -> None:
    # What a creator killed between its folder and its first state leaves (or a teardown of
    # a version whose lockers could make the lock file again): nothing but the folder.
    folder = sandbox_state.SANDBOXES_ROOT / "weenv-stubtest"
    sandbox_state.make_folder(folder)
    try:
        young = json.loads(run_weenv("sandbox", "gc", "--json").stdout)
        assert folder.name not in young["sandboxes"] and folder.exists()
        old = folder.stat().st_mtime - sandbox_state.STUB_AGE - 5
        os.utime(folder, (old, old))
        report = json.loads(run_weenv("sandbox", "gc", "--json").stdout)
        assert folder.name in report["sandboxes"] and report["errors"] == []
        assert not folder.exists()
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)
