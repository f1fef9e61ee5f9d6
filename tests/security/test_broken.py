"""A sandbox whose environment mount died (its FUSE daemon killed, OOM, ...): every command
would fail inside with confusing errors ("sh: command not found"). WeEnv says what is wrong in
one line, `sandbox ls` shows it as `broken`, and `sandbox rm` still removes it."""

from __future__ import annotations

import json
import os
import signal

import pytest
from support.polling import wait_for
from support.runtime import EnvRef, run_weenv

from weenvfs.fuse import daemon
from weenvfs.runtime import mounts
from weenvfs.runtime.environment import Environment, resolve_source
from weenvfs.runtime.sandbox import Sandbox, SandboxBroken, SandboxOptions


def _kill_daemons(keys: tuple[str, ...]) -> None:
    for key in keys:
        info = daemon.read_pid_file(mounts.mountpoint(key))
        assert info is not None
        os.kill(int(info["pid"]), signal.SIGKILL)
        wait_for(lambda pid=int(info["pid"]): not daemon.process_alive(pid), "daemon exit")


def test_exec_in_a_sandbox_whose_mount_died_says_so(env_ref: EnvRef) -> None:
    box = run_weenv("sandbox", "create", env_ref.ref, "--store", str(env_ref.store), "--cache",
                    str(env_ref.cache)).stdout.decode().strip()
    try:
        assert run_weenv("sandbox", "exec", box, "--", "true").returncode == 0
        _kill_daemons(env_ref.keys)
        done = run_weenv("sandbox", "exec", box, "--", "sh", "-c", "true", check=False)
        message = done.stderr.decode().strip()
        assert done.returncode == 1 and len(message.splitlines()) == 1, message
        assert "mount" in message and "gone" in message and box in message
        listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)
        assert [b["status"] for b in listed["sandboxes"] if b["id"] == box] == ["broken"]
        table = run_weenv("sandbox", "ls").stdout.decode()
        assert any(line.split()[:2] == [box, "broken"] for line in table.splitlines())
    finally:
        run_weenv("sandbox", "rm", box)


def test_the_python_api_raises_a_clear_error(env_ref: EnvRef) -> None:
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache) as env:
        _kill_daemons(env_ref.keys)
        try:
            env.exec(["true"])
        except SandboxBroken as error:
            assert "mount" in str(error)
        else:
            raise AssertionError("exec in a broken sandbox did not raise")
        assert env.sandbox.status() == "broken"


def test_a_runs_command_trusts_the_check_its_create_just_made(env_ref: EnvRef) -> None:
    """`weenv run` builds its command right after `create`, which checked the shared
    mounts: that command (`mounts_checked=True`) does not ask every mount's daemon again;
    every other command does, the first one of a sandbox included."""
    source = resolve_source(env_ref.ref, env_ref.store, env_ref.cache, False)
    box = Sandbox.create(source, SandboxOptions(), owner_pid=os.getpid(), start=False)
    try:
        _kill_daemons(env_ref.keys)
        assert box.command(("true",), mounts_checked=True).args == ("true",)  # trusted
        with pytest.raises(SandboxBroken, match="mount"):
            box.command(("true",))
    finally:
        box.destroy(keep_upper=False)
    box = Sandbox.create(source, SandboxOptions(), owner_pid=os.getpid(), start=False)
    try:
        _kill_daemons(env_ref.keys)
        with pytest.raises(SandboxBroken, match="mount"):
            box.command(("true",))  # its first command, not trusted
    finally:
        box.destroy(keep_upper=False)
