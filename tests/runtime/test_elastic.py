"""Elastic sandboxes: the runtime hands them to the node's provisioner (real cgroup v1, runc).

A sandbox made with `--elastic` is registered with its first limits before it runs, shows in
`weenv provision status` and `weenv sandbox ls`, keeps its registration (and the cgroup that
carries its limits) across resets, grows instead of being OOM-killed when a command ramps to
3x its first memory limit, and on rm/close/gc is unregistered with its run recorded in the
environment's history, which seeds the next sandbox of that environment.

Every test runs against a private spool and history (`WEENV_PROVISION_DIR`,
`WEENV_PROVISION_HISTORY`); the `provisioner` fixture removes the test's sandboxes, stops the
sidecar and checks that no cgroup of them is left. The environments come from the 'python'
sample tree (the minbase one has no python to allocate memory with).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rt_support import (
    EnvRef,
    controller,
    gc_over_an_orphan,
    run_weenv,
    runtime_unavailable,
    sample_store,
)
from support.polling import wait_for

from weenvfs.provision import registry
from weenvfs.provision.cgroup_driver import MIB, CgroupLimits, read_mounts
from weenvfs.provision.history import HISTORY_ENV, History
from weenvfs.provision.registry import node_config
from weenvfs.runtime import cgroups, sandbox, sandbox_state
from weenvfs.runtime.environment import Environment
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.publish import compose_env

WAIT = 60.0
# A long calm period: limits only move under pressure, so what a test reads is not a shrink
# that happened to land first.
CALM = ("--set", "mem_calm=600", "--set", "cpu_calm=600")
# Allocates STEPS x 8 MiB, then holds it until the test, having seen the sidecar read that
# much, creates /tmp/go in the sandbox.
RAMP = textwrap.dedent("""
    import os, time
    chunks = []
    for _ in range({steps}):
        chunks.append(b"\\x01" * (8 << 20))  # written, so charged to the cgroup
        time.sleep(0.02)
    print(sum(map(len, chunks)) >> 20, flush=True)
    while not os.path.exists("/tmp/go"):
        time.sleep(0.01)
""")


@pytest.fixture(scope="module")
def python_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LocalStore holding group `python:t`, built from the cached 'python' sample tree."""
    if runtime_unavailable() is not None:
        pytest.skip(runtime_unavailable() or "")
    return sample_store(tmp_path_factory.mktemp("elastic-store"), "python", "python")


@pytest.fixture
def py_env(python_store: Path, tmp_path: Path, test_digests: set[str]) -> EnvRef:
    """A fresh environment of the python group (its own digest, so its own history)."""
    store = open_store(str(python_store))
    try:
        digest = compose_env(
            Repository(store), "py", "t1", ["python:t"], None, {"test-nonce": uuid.uuid4().hex}
        )
    finally:
        store.close()
    test_digests.add(digest)
    return EnvRef("py:t1", python_store, digest, tmp_path / "cache")


@dataclass
class Provisioner:
    """The test's private provisioner spool and history, and the sandboxes it made."""

    spool: Path
    history: Path
    ids: list[str] = field(default_factory=list)

    def start(self, *options: str) -> int:
        """Start the sidecar in the background (as `weenv provision run`); its pid."""
        run_weenv("provision", "run", "--spool", str(self.spool), "--interval", "0.1", *options)
        pid = registry.running_pid(self.spool)
        assert pid is not None
        return pid

    def status(self) -> dict[str, Any]:
        """`weenv provision status --json`."""
        return json.loads(run_weenv("provision", "status", "--json").stdout)

    def watched(self, sandbox_id: str) -> dict[str, Any]:
        """The sidecar's status entry of `sandbox_id`, once it has one."""
        return wait_for(
            lambda: self.status()["sandboxes"].get(sandbox_id),
            f"the provisioner to watch {sandbox_id}", WAIT,
        )

    def using(self, sandbox_id: str, least: int) -> None:
        """Wait until the sidecar has read more than `least` bytes in use by the sandbox."""
        wait_for(
            lambda: (self.watched(sandbox_id)["mem_usage"] or 0) > least,
            f"the provisioner to see {least >> 20} MiB used by {sandbox_id}", WAIT,
        )

    def sampled(self, sandbox_id: str) -> None:
        """Wait until the sidecar has read the sandbox's cgroup at two ticks (a run shorter
        than that has nothing to record)."""
        first = wait_for(lambda: self._read_at(sandbox_id), f"a sample of {sandbox_id}", WAIT)
        wait_for(lambda: (self._read_at(sandbox_id) or 0) > first, f"samples of {sandbox_id}",
                 WAIT)

    def _read_at(self, sandbox_id: str) -> int | None:
        """The tick of the last status if it has a reading of `sandbox_id`."""
        status = self.status()
        entry = status["sandboxes"].get(sandbox_id)
        return status["ticks"] if entry and entry["mem_usage"] is not None else None

    def events(self, sandbox_id: str) -> list[str]:
        """The names of the sidecar's events about `sandbox_id`, in order."""
        lines = (self.spool / "events.jsonl").read_text().splitlines()
        return [e["event"] for e in map(json.loads, lines) if e.get("sandbox") == sandbox_id]

    def runs(self, digest: str) -> int:
        """How many runs of environment `digest` the history holds."""
        return len(History(self.history).runs(digest))


@pytest.fixture
def provisioner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Provisioner]:
    """A private spool and history for the runtime and every `weenv` it runs; afterwards the
    test's sandboxes are removed, the sidecar stopped, and no cgroup of theirs may remain."""
    node = Provisioner(tmp_path / "spool", tmp_path / "history")
    monkeypatch.setenv(registry.SPOOL_ENV, str(node.spool))
    monkeypatch.setenv(HISTORY_ENV, str(node.history))
    try:
        yield node
    finally:
        for sandbox_id in node.ids:
            if sandbox.exists(sandbox_id):
                sandbox.Sandbox.load(sandbox_id).destroy(keep_upper=False)
        pid = registry.running_pid(node.spool)
        if pid is not None:
            try:
                registry.stop_sidecar(node.spool)
            except registry.ProvisionError:
                os.kill(pid, signal.SIGKILL)  # the sidecar this test started, by its pid
        left = [str(d) for i in node.ids for d in cgroups.cgroup_dirs(f"/weenv/{i}")]
        for sandbox_id in node.ids:
            cgroups.remove_cgroup(f"/weenv/{sandbox_id}")
    assert not left, f"cgroups left behind: {left}"
    assert registry.running_pid(node.spool) is None, "the sidecar is still running"


def _create(env: EnvRef, node: Provisioner, *options: str) -> str:
    done = run_weenv(
        "sandbox",
        "create",
        env.ref,
        "--store",
        str(env.store),
        "--cache",
        str(env.cache),
        "--elastic",
        *options,
    )
    sandbox_id = done.stdout.decode().strip()
    node.ids.append(sandbox_id)
    return sandbox_id


def _v1_file(controller: str, sandbox_id: str, name: str) -> str:
    return (read_mounts().v1[controller] / "weenv" / sandbox_id / name).read_text().strip()


def _sizes(limits: dict[str, Any]) -> tuple[int, int, int]:
    """Elastic and hard memory limits and CPU quota (the soft limit is the policy's own)."""
    return limits["mem_high"], limits["mem_max"], limits["cpu_millis"]


def _listed(sandbox_id: str) -> dict[str, Any]:
    listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)["sandboxes"]
    return next(b for b in listed if b["id"] == sandbox_id)


def test_an_elastic_sandbox_is_registered_with_its_first_limits_and_survives_reset(
    py_env: EnvRef, provisioner: Provisioner
) -> None:
    provisioner.start(*CALM)
    sandbox_id = _create(py_env, provisioner, "--memory", "96M", "--cpus", "0.5")
    first = (96 * MIB, 96 * MIB, 500)  # v1: the hard limit is the elastic one
    entry = provisioner.watched(sandbox_id)
    assert _sizes(entry["limits"]) == first
    assert entry["cgroup"] == f"weenv/{sandbox_id}" and entry["env"] == py_env.digest
    # The limits were in the cgroup before the sandbox ran; tasks wait at it (v1 hold).
    assert _v1_file("memory", sandbox_id, "memory.limit_in_bytes") == str(96 * MIB)
    assert "oom_kill_disable 1" in _v1_file("memory", sandbox_id, "memory.oom_control")
    assert _v1_file("cpu", sandbox_id, "cpu.cfs_quota_us") == "50000"
    listed = _listed(sandbox_id)
    assert listed["elastic"] and listed["cgroup"] == f"/weenv/{sandbox_id}/runc"
    assert (listed["limits"]["memory"], listed["limits"]["cpus"]) == (96 * MIB, 0.5)
    assert listed["provisioner"]["registered"] and listed["provisioner"]["sidecar"]
    assert _sizes(listed["provisioner"]["initial"]) == first
    registered = registry.registrations()[sandbox_id]

    run_weenv("sandbox", "exec", sandbox_id, "--", "sh", "-c", "echo x > /tmp/episode")
    run_weenv("sandbox", "reset", sandbox_id)
    # Same registration, same watch, same cgroup and limits; runc's child is a new one.
    assert registry.registrations()[sandbox_id] == registered
    assert _sizes(provisioner.watched(sandbox_id)["limits"]) == first
    assert provisioner.events(sandbox_id).count("register") == 1
    assert _v1_file("memory", sandbox_id, "memory.limit_in_bytes") == str(96 * MIB)
    done = run_weenv(
        "sandbox",
        "exec",
        sandbox_id,
        "--",
        "sh",
        "-c",
        "test ! -e /tmp/episode && cat /proc/self/cgroup",
        check=True,
    )
    assert f"memory:/weenv/{sandbox_id}/runc" in done.stdout.decode()

    provisioner.sampled(sandbox_id)
    run_weenv("sandbox", "rm", sandbox_id)
    assert sandbox_id not in registry.registrations()
    assert sandbox_id not in provisioner.status()["sandboxes"]
    assert provisioner.events(sandbox_id)[-1] == "unregister"
    assert provisioner.runs(py_env.digest) == 1  # written before rm returned
    assert not cgroups.cgroup_dirs(f"/weenv/{sandbox_id}")


def test_a_ramp_to_three_times_the_first_limit_is_not_oom_killed(
    py_env: EnvRef, provisioner: Provisioner
) -> None:
    provisioner.start(*CALM)
    env = Environment.open(
        py_env.ref, store=py_env.store, cache=py_env.cache, memory=64 * MIB, elastic=True
    )
    provisioner.ids.append(env.id)
    try:
        # The memory given, the CPU quota from the history (none yet: one core).
        assert registry.registrations()[env.id].initial == CgroupLimits(64 * MIB, 64 * MIB, 1000)
        # 24 steps of 8 MiB: 192 MiB of data, 3x the first limit, plus python itself.
        with ThreadPoolExecutor(1) as pool:
            ramp = pool.submit(env.exec, ["python3", "-c", RAMP.format(steps=24)], timeout=WAIT)
            provisioner.using(env.id, 192 * MIB)
            env.write_file("/tmp/go", b"")
            done = ramp.result()
        assert (done.exit_code, done.stdout) == (0, b"192\n"), done.stderr
        assert int(_v1_file("memory", env.id, "memory.max_usage_in_bytes")) > 192 * MIB
        assert int(_v1_file("memory", env.id, "memory.limit_in_bytes")) > 192 * MIB
        assert "oom_kill 0" in _v1_file("memory", env.id, "memory.oom_control")
        assert provisioner.watched(env.id)["oom_kills"] == 0
    finally:
        env.close()
    assert env.id not in registry.registrations()
    runs = History(provisioner.history).runs(py_env.digest)
    assert len(runs) == 1 and runs[0].mem_peak > 192 * MIB and runs[0].oom_kills == 0


def test_rm_records_the_run_and_the_next_sandbox_is_seeded_from_it(
    py_env: EnvRef, provisioner: Provisioner
) -> None:
    assert registry.running_pid() is None
    first = _create(py_env, provisioner)  # no history, no sidecar: both appear
    assert registry.running_pid() is not None
    defaults = CgroupLimits(512 * MIB, 512 * MIB, 1000)  # v1: hard limit == elastic limit
    assert registry.registrations()[first].initial == defaults
    command = ["sandbox", "exec", first, "--", "python3", "-c", RAMP.format(steps=12)]
    ramp = subprocess.Popen([sys.executable, "-m", "weenvfs", *command], stdout=subprocess.PIPE)
    try:
        provisioner.using(first, 96 * MIB)
        run_weenv("sandbox", "exec", first, "--", "touch", "/tmp/go")
        assert ramp.communicate(timeout=WAIT)[0] == b"96\n"
    finally:
        if ramp.poll() is None:
            ramp.kill()
            ramp.wait()
    run_weenv("sandbox", "rm", first)
    runs = History(provisioner.history).runs(py_env.digest)
    assert len(runs) == 1 and runs[0].mem_peak > 96 * MIB

    second = _create(py_env, provisioner)
    seeded = History(provisioner.history).seed(py_env.digest, node_config(1))
    assert seeded is not None and seeded != defaults
    assert registry.registrations()[second].initial == seeded
    assert _v1_file("memory", second, "memory.limit_in_bytes") == str(seeded.mem_max)
    provisioner.sampled(second)
    run_weenv("sandbox", "rm", second)
    assert provisioner.runs(py_env.digest) == 2


def test_gc_unregisters_an_elastic_sandbox_whose_controller_was_killed(
    py_env: EnvRef, provisioner: Provisioner
) -> None:
    provisioner.start()
    runs_before = [0]

    def killed_controller() -> str:
        runs_before[0] = provisioner.runs(py_env.digest)
        with controller(py_env, elastic=True) as (child, made):
            provisioner.ids.append(made)
            provisioner.sampled(made)
            child.kill()  # SIGKILL: no clean-up code runs
            child.wait(WAIT)
        if sandbox_state.exists(made):  # (else the node's housekeeping took it meanwhile)
            assert made in registry.registrations()
        return made

    sandbox_id, report = gc_over_an_orphan(killed_controller)
    assert sandbox_id in report["sandboxes"]
    assert sandbox_id not in registry.registrations()
    assert sandbox_id not in provisioner.status()["sandboxes"]
    assert provisioner.runs(py_env.digest) == runs_before[0] + 1
    assert not cgroups.cgroup_dirs(f"/weenv/{sandbox_id}")


def test_the_command_that_starts_the_provisioner_says_so_once(
    py_env: EnvRef, provisioner: Provisioner
) -> None:
    """--elastic with no sidecar running starts one that outlives the command: one stderr line
    says so, with its pid and how to stop it; the next elastic command, which finds it
    running, says nothing."""
    notice = "weenv: started the node's provisioner (pid {pid}); it keeps running for " \
             "elastic sandboxes: stop it with `weenv provision stop`"
    assert registry.running_pid(provisioner.spool) is None
    first = run_weenv("sandbox", "create", py_env.ref, "--store", str(py_env.store),
                      "--cache", str(py_env.cache), "--elastic")
    provisioner.ids.append(first.stdout.decode().strip())
    pid = registry.running_pid(provisioner.spool)
    assert pid is not None
    assert notice.format(pid=pid) in first.stderr.decode().splitlines()
    second = run_weenv("sandbox", "create", py_env.ref, "--store", str(py_env.store),
                       "--cache", str(py_env.cache), "--elastic")
    provisioner.ids.append(second.stdout.decode().strip())
    assert "provisioner" not in second.stderr.decode()
    assert registry.running_pid(provisioner.spool) == pid
