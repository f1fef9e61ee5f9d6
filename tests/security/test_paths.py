"""Hostile images against the paths the runtime sets up inside a sandbox's root: /dev, /proc
and /sys (runc mounts there, then creates device nodes and links under /dev), /tmp and the
working directory (WeEnv creates them when missing). A symlink out of the root must never make
anything happen on the host: the sandbox refuses the image with one line naming the path, or
resolves the link inside the root."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.runtime import EnvRef, run_weenv
from support.trees import dir, symlink  # noqa: A004

from weenvfs.errors import WeenvError
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.runtime.environment import Environment


@pytest.fixture
def victim() -> Iterator[Path]:
    """An existing host folder with one file in it, that no sandbox may touch."""
    path = Path(f"/tmp/weenv-victim-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    (path / "precious").write_bytes(b"keep")
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def _open(env: EnvRef) -> Environment:
    return Environment.open(env.ref, store=env.store, cache=env.cache)


@pytest.mark.parametrize("name", ["dev", "proc", "sys"])
def test_a_system_folder_symlinked_to_a_host_folder_is_refused_and_the_host_untouched(
    hostile_env: Callable[..., EnvRef], victim: Path, name: str
) -> None:
    env = hostile_env(symlink(name, str(victim)))
    done = run_weenv("run", env.ref, "--store", str(env.store), "--cache", str(env.cache),
                     "--", "true", check=False)
    assert sorted(os.listdir(victim)) == ["precious"]
    assert done.returncode == 1, done.stderr
    message = done.stderr.decode().strip()
    assert len(message.splitlines()) == 1 and f"/{name}" in message and "symlink" in message


def test_dev_symlinked_inside_the_root_is_refused_too(
    hostile_env: Callable[..., EnvRef]
) -> None:
    # runc follows /dev/... by path before it pivots into the root: whatever /dev points to,
    # an absolute link would be followed on the host. Only a real folder is safe.
    env = hostile_env(dir("realdev"), symlink("dev", "/realdev"))
    with pytest.raises(WeenvError, match="/dev"):
        _open(env)


@pytest.mark.parametrize("target", ["/nonexistent-host-dir", "tmp", "/etc/hostname"])
def test_a_hostile_tmp_gives_a_clean_error_or_stays_inside(
    hostile_env: Callable[..., EnvRef], target: str
) -> None:
    env = hostile_env(symlink("tmp", target))
    done = run_weenv("run", env.ref, "--store", str(env.store), "--cache", str(env.cache),
                     "--", "sh", "-c", "echo hi > /tmp/x && cat /tmp/x", check=False)
    message = done.stderr.decode().strip()
    if target == "/nonexistent-host-dir":  # resolved inside the root: made there
        assert done.returncode == 0 and done.stdout == b"hi\n", message
        assert not os.path.exists(target)
    else:  # a loop, or a file: refused with a line naming /tmp
        assert done.returncode == 1, message
        assert len(message.splitlines()) == 1 and "/tmp" in message, message
        assert "internal error" not in message


def test_a_working_directory_through_a_symlink_out_of_the_root_stays_inside(
    hostile_env: Callable[..., EnvRef], victim: Path
) -> None:
    gone = f"/tmp/weenv-absent-{uuid.uuid4().hex[:8]}"
    env = hostile_env(symlink("work", gone), config=RuntimeConfig(cwd="/work/task"))
    with _open(env) as box:
        done = box.exec(["sh", "-c", "pwd; echo hi > here"])
        assert done.exit_code == 0, done.stderr
        assert done.stdout == f"{gone}/task\n".encode()  # the link, resolved inside
        assert box.read_file(f"{gone}/task/here") == b"hi\n"
    assert not os.path.exists(gone)


def test_a_working_directory_that_loops_is_a_clean_error(
    hostile_env: Callable[..., EnvRef]
) -> None:
    env = hostile_env(symlink("work", "work"), config=RuntimeConfig(cwd="/work"))
    done = run_weenv("run", env.ref, "--store", str(env.store), "--cache", str(env.cache),
                     "--", "true", check=False)
    message = done.stderr.decode().strip()
    assert done.returncode == 1, message
    assert len(message.splitlines()) == 1 and "/work" in message and "internal" not in message
