"""Which OCI runtime runs a sandbox (runtimes.py, crun.py): crun where it is installed, runc
when asked ($WEENV_RUNTIME) or when crun is not; a sandbox keeps the runtime that made it.

Real sandboxes on real mounts, in real cgroups, under both real runtimes; `node_clean`
(conftest) fails any test that leaves a container, cgroup or mount of either behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from rt_support import EnvRef, run_weenv

from weenvfs import native_programs
from weenvfs.errors import UsageError, WeenvError
from weenvfs.fuse.daemon import process_alive
from weenvfs.runtime import cgroups, sandbox_state
from weenvfs.runtime.crun import (
    CRUN_ROOT,
    VIEW_HELPER,
    CrunLauncher,
    needs_private_cgroup_view,
)
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.launcher import RUNC_ROOT, CgroupSpec, LaunchSpec
from weenvfs.runtime.runtimes import RUNTIME_ENV, default_launcher, launcher_named
from weenvfs.runtime.sandbox import Sandbox

ROOTS = {"crun": CRUN_ROOT, "runc": RUNC_ROOT}
RUNTIMES = pytest.mark.parametrize("runtime", sorted(ROOTS))


@pytest.fixture(autouse=True)
def _crun(require_or_skip: Callable[[object, str], None]) -> None:
    require_or_skip(shutil.which("crun"), "crun not found (Debian package crun)")


def _open(env: EnvRef, **kwargs: object) -> Environment:
    return Environment.open(env.ref, store=env.store, cache=env.cache, **kwargs)  # type: ignore[arg-type]


def test_crun_is_the_default_and_weenv_runtime_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    assert default_launcher().name == "crun"
    monkeypatch.setenv(RUNTIME_ENV, "runc")
    assert default_launcher().name == "runc"
    monkeypatch.setenv(RUNTIME_ENV, "kata")
    with pytest.raises(UsageError, match=r"unknown OCI runtime 'kata' in \$WEENV_RUNTIME"):
        default_launcher()


def test_a_runtime_that_is_not_installed_is_named(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither runtime on it
    monkeypatch.setenv(RUNTIME_ENV, "crun")
    with pytest.raises(WeenvError, match="crun not found .install the Debian package crun"):
        default_launcher()
    monkeypatch.delenv(RUNTIME_ENV)
    with pytest.raises(WeenvError, match="runc not found .install the Debian package runc"):
        default_launcher()


def test_an_unknown_runtime_fails_the_open_and_leaves_nothing(
        env_ref: EnvRef, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUNTIME_ENV, "kata")
    before = set(sandbox_state.list_ids())
    with pytest.raises(UsageError, match="unknown OCI runtime 'kata'"):
        _open(env_ref)
    assert set(sandbox_state.list_ids()) == before  # no half-made sandbox folder
    done = run_weenv("run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
                     env_ref.ref, "true", check=False)
    assert done.returncode != 0
    assert done.stderr.decode().strip().splitlines() == [
        "weenv: error: unknown OCI runtime 'kata' in $WEENV_RUNTIME (known: crun, runc)"]


@RUNTIMES
def test_a_sandbox_runs_and_ends_on_either_runtime(env_ref: EnvRef, runtime: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUNTIME_ENV, runtime)
    with _open(env_ref, memory=256 << 20, pids=64) as env:
        sandbox_id = env.id
        assert env.sandbox.state["launcher"] == runtime
        assert (ROOTS[runtime] / sandbox_id).is_dir()
        assert all(not (root / sandbox_id).exists() for name, root in ROOTS.items()
                   if name != runtime)
        done = env.exec(["sh", "-c", "cat; echo err >&2; exit 3"], input=b"in")
        assert (done.exit_code, done.stdout, done.stderr) == (3, b"in", b"err\n")
        assert env.exec(["sh", "-c", "kill -9 $$"]).exit_code == 137
        assert env.exec(["cat", "/proc/1/cmdline"]).stdout.startswith(b"/dev/.weenv-init\0-P")
        # The runtime wrote the limits into the sandbox's own cgroup.
        dirs = cgroups.cgroup_dirs(f"/weenv/{sandbox_id}")
        assert dirs, "no cgroup made"
        limits = [path.read_text().strip() for folder in dirs
                  for name in ("memory.limit_in_bytes", "memory.max", "pids.max")
                  if (path := folder / name).exists()]
        assert str(256 << 20) in limits and "64" in limits, limits
        assert env.sandbox.launcher.status(sandbox_id) == "running"
    assert not (ROOTS[runtime] / sandbox_id).exists()
    assert not cgroups.cgroup_dirs(f"/weenv/{sandbox_id}")


@RUNTIMES
def test_a_command_that_cannot_start_gets_the_shells_code(env_ref: EnvRef, runtime: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # Straight to the runtime: Sandbox.command finds a missing command before it would.
    monkeypatch.setenv(RUNTIME_ENV, runtime)
    with _open(env_ref) as env:
        box = env.sandbox
        for argv, shell_code in ((("/no/such/program",), 127), (("/etc/passwd",), 126)):
            proc, pid_file = box.exec(replace(box.process, args=argv),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            _, err = proc.communicate(timeout=60)
            box.forget_exec(pid_file)
            assert proc.returncode == 255, err
            assert box.launcher.exit_code(proc.returncode, err) == shell_code, err


def test_a_sandbox_keeps_the_runtime_that_made_it(env_ref: EnvRef,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUNTIME_ENV, "runc")
    with _open(env_ref) as env:
        monkeypatch.delenv(RUNTIME_ENV)  # the default is crun again
        assert Sandbox.load(env.id).launcher.name == "runc"
        # A new process (the CLI) finds, enters and lists it through runc.
        assert run_weenv("sandbox", "exec", env.id, "cat", "/proc/sys/kernel/hostname").stdout \
            == f"{env.id}\n".encode()
        listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)
        mine = next(b for b in listed["sandboxes"] if b["id"] == env.id)
        assert mine["status"] == "running" and mine["runtime"] == "runc"
    assert not (RUNC_ROOT / env.id).exists()


def _weenv_without_runtimes(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`weenv ARGS` where neither runtime is on PATH any more (uninstalled since)."""
    return subprocess.run([sys.executable, "-m", "weenvfs", *args],
                          env={**os.environ, "PATH": str(tmp_path)}, capture_output=True,
                          text=True, timeout=60)


@RUNTIMES
def test_a_sandbox_whose_runtime_is_gone_is_listed_refused_and_removed(
        env_ref: EnvRef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        runtime: str) -> None:
    """Uninstalling the runtime strands no sandbox: `ls` shows it (and says so), `exec` says
    what to install, `rm` removes everything, its processes, cgroup and the runtime's own
    record included."""
    monkeypatch.setenv(RUNTIME_ENV, runtime)
    env = _open(env_ref)
    try:
        box = env.sandbox
        init = int(box.state["init_pid"])
        done = _weenv_without_runtimes(tmp_path, "sandbox", "ls", "--json")
        assert done.returncode == 0, done.stderr
        listed = {b["id"]: b for b in json.loads(done.stdout)["sandboxes"]}
        assert listed[box.id]["status"] == "running"
        assert listed[box.id]["runtime_installed"] is False
        assert f"sandbox {box.id}: {runtime} not found (install the Debian package " \
            f"{runtime}); it can be removed" in done.stderr
        done = _weenv_without_runtimes(tmp_path, "sandbox", "exec", box.id, "--", "true")
        assert done.returncode != 0
        assert done.stderr.strip().splitlines() == [
            f"weenv: error: {runtime} not found (install the Debian package {runtime})"]
        done = _weenv_without_runtimes(tmp_path, "sandbox", "rm", box.id)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert not sandbox_state.exists(box.id)
        assert not (ROOTS[runtime] / box.id).exists()  # the runtime's record
        assert not cgroups.cgroup_dirs(box.cgroup_path or f"/weenv/{box.id}")
        assert not process_alive(init)
        assert not os.path.ismount(box.rootfs)
    finally:
        env.close()  # a no-op once removed; removes it if the test failed before


def test_gc_removes_orphan_containers_of_every_installed_runtime(env_ref: EnvRef,
                                                                 tmp_path: Path) -> None:
    # What a crash between the runtime's start and the sandbox's state leaves: a container
    # (and its cgroup) with no sandbox folder; one of each runtime, on a live sandbox's root.
    with _open(env_ref) as env:
        orphans = {}
        for name in ROOTS:
            orphan = f"weenv-orphan{name}"
            launcher = launcher_named(name)
            launcher.start(LaunchSpec(orphan, env.sandbox.rootfs, tmp_path / name,
                                      env.sandbox.process, CgroupSpec(f"/weenv/{orphan}"),
                                      hostname=orphan))
            assert launcher.status(orphan) == "running"
            orphans[name] = orphan
        report = json.loads(run_weenv("sandbox", "gc", "--json").stdout)
        assert set(orphans.values()) <= set(report["containers"]), report
        for name, orphan in orphans.items():
            assert not (ROOTS[name] / orphan).exists()
            assert not cgroups.cgroup_dirs(f"/weenv/{orphan}")
        assert env.exec(["true"]).ok  # the live sandbox is not an orphan


@pytest.mark.parametrize("view", ["native", "unshare"])
def test_crun_on_a_hybrid_host_sees_a_v1_host_and_leaves_the_host_alone(
        env_ref: EnvRef, monkeypatch: pytest.MonkeyPatch, view: str,
        require_or_skip: Callable[[object, str], None]) -> None:
    """The private cgroup view crun runs in: native/weenv-cgroup-view.c where installed,
    else unshare, sh and umount; the same sandbox either way."""
    if not needs_private_cgroup_view():
        pytest.skip("not a hybrid cgroup host with controllers on its cgroup2 mount")
    if view == "native":
        require_or_skip(native_programs.find(VIEW_HELPER),
                        f"{VIEW_HELPER} is not installed (scripts/setup.sh builds it)")
    else:
        monkeypatch.setattr(native_programs, "find", lambda name, path=None: None)
    prefix = CrunLauncher()._base()
    assert os.path.basename(prefix[0]) == (VIEW_HELPER if view == "native" else "unshare")
    monkeypatch.setenv(RUNTIME_ENV, "crun")
    with _open(env_ref) as env:
        assert env.exec(["true"]).ok
        assert env.exec(["sh", "-c", "exit 3"]).exit_code == 3
    assert os.path.ismount("/sys/fs/cgroup/unified")  # only crun's own namespace lost it


def test_the_cgroup_view_fails_in_one_line_before_the_program_runs(
        tmp_path: Path, require_or_skip: Callable[[object, str], None]) -> None:
    helper = native_programs.find(VIEW_HELPER)
    require_or_skip(helper, f"{VIEW_HELPER} is not installed (scripts/setup.sh builds it)")
    assert helper is not None
    marker = tmp_path / "ran"
    done = subprocess.run([helper, str(tmp_path / "not-a-mount"), "/bin/touch", str(marker)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 125 and not marker.exists()
    assert done.stderr.splitlines() == [
        f"weenv-cgroup-view: umount {tmp_path / 'not-a-mount'}: No such file or directory"]
    done = subprocess.run([helper, "/"], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 125 and done.stderr.startswith("usage:")


def test_a_plain_folder_is_not_a_hybrid_cgroup_host(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("hugetlb\n")
    assert not needs_private_cgroup_view(tmp_path)  # nothing there is a mount
