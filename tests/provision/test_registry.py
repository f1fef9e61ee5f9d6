"""The registry API the runtime calls, the spool folder and the sidecar process lifecycle."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from provision_support import V1Cgroups, V2Folder
from support.polling import wait_for

from weenvfs.provision import registry
from weenvfs.provision.cgroup_driver import MIB, CgroupLimits, ProvisionError
from weenvfs.provision.history import History, RunSummary
from weenvfs.provision.policy import PolicyConfig


def test_register_applies_initial_limits_at_once_and_spools(
    v2_folder: V2Folder, tmp_path: Path
) -> None:
    cgroup = v2_folder.make("weenv-sb1")
    spool = tmp_path / "spool"
    initial = CgroupLimits(200 * MIB, 250 * MIB, 1500)
    reg = registry.register(
        "sb1",
        [str(cgroup.dirs["unified"])],
        "sha256:abc",
        initial,
        spool=spool,
        driver=v2_folder.driver,
    )
    assert (v2_folder.get(cgroup, "memory.high"), v2_folder.get(cgroup, "memory.max")) == (
        str(200 * MIB),
        str(250 * MIB),
    )
    assert v2_folder.get(cgroup, "cpu.max") == "150000 100000"
    assert reg.cgroups == (str(cgroup.dirs["unified"]),) and reg.initial == initial
    body = json.loads((spool / "sandboxes" / "sb1.json").read_text())
    assert body["env"] == "sha256:abc" and body["initial"]["mem_high"] == 200 * MIB
    assert registry.registrations(spool) == {"sb1": reg}
    assert registry.unregister("sb1", spool=spool)
    assert not registry.unregister("sb1", spool=spool)
    assert registry.registrations(spool) == {}


def test_initial_limits_come_from_the_environments_history(
    v2_folder: V2Folder, tmp_path: Path
) -> None:
    history = History(tmp_path / "history")
    history.record(
        "env-a", RunSummary(900 * MIB, 300 * MIB, 200 * MIB, 2000, 800, 500, 60.0, 0, 0.0)
    )
    v2_folder.make("weenv-a")
    seeded = registry.register(
        "sb1",
        ["weenv-a"],
        "env-a",
        spool=tmp_path / "s",
        history=history,
        driver=v2_folder.driver,
    )
    assert seeded.initial == CgroupLimits(360 * MIB, 450 * MIB, 1000)  # 300 * 1.2; 800 * 1.25
    v2_folder.make("weenv-b")
    fresh = registry.register(
        "sb2",
        ["weenv-b"],
        "env-new",
        spool=tmp_path / "s",
        history=history,
        driver=v2_folder.driver,
    )
    assert fresh.initial == CgroupLimits(512 * MIB, 640 * MIB, 1000)  # defaults, v2 net 1.25x


def test_register_on_v1_sets_hold_and_one_hard_limit(v1_cgroups: V1Cgroups, tmp_path: Path) -> None:
    cgroup = v1_cgroups.make("sb")
    reg = registry.register(
        "sb",
        cgroup.paths(),
        "env",
        spool=tmp_path / "spool",
        driver=v1_cgroups.driver,
        history=History(None),
        config=PolicyConfig(),
    )
    assert reg.initial.mem_high == reg.initial.mem_max == 512 * MIB  # v1: one hard limit
    sample = v1_cgroups.driver.read(cgroup)
    assert sample.mem_limit == 512 * MIB and sample.cpu_quota_millis == 1000
    assert "oom_kill_disable 1" in (cgroup.dirs["memory"] / "memory.oom_control").read_text()


def test_register_rejects_bad_ids_and_missing_cgroups(v2_folder: V2Folder, tmp_path: Path) -> None:
    v2_folder.make("weenv-ok")
    with pytest.raises(ProvisionError, match="invalid sandbox id"):
        registry.register("../x", ["weenv-ok"], "env", spool=tmp_path, driver=v2_folder.driver)
    with pytest.raises(ProvisionError, match="does not exist"):
        registry.register("sb", ["weenv-missing"], "env", spool=tmp_path, driver=v2_folder.driver)


def test_malformed_registrations_are_skipped(tmp_path: Path, assert_logs: Any) -> None:
    folder = tmp_path / "sandboxes"
    folder.mkdir()
    (folder / "bad.json").write_text('{"sandbox_id": "bad"}')
    (folder / "worse.json").write_text("{")
    with assert_logs("skipping malformed registration", count=2):
        assert registry.registrations(tmp_path) == {}


def test_pid_lock_allows_one_sidecar(tmp_path: Path) -> None:
    assert registry.running_pid(tmp_path) is None
    with registry.pid_lock(tmp_path):
        assert registry.running_pid(tmp_path) == os.getpid()
        with (
            pytest.raises(registry.AlreadyRunning, match=f"pid {os.getpid()}"),
            registry.pid_lock(tmp_path),
        ):
            pass
    assert registry.running_pid(tmp_path) is None
    with pytest.raises(ProvisionError, match="no provisioner is running"):
        registry.read_status(tmp_path)


def test_background_sidecar_starts_reports_and_stops(v1_cgroups: V1Cgroups, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    cgroup = v1_cgroups.make("sb")
    registry.register(
        "sb", cgroup.paths(), "env", spool=spool, driver=v1_cgroups.driver, history=History(None)
    )
    args = ["--history", str(tmp_path / "history"), "--interval", "0.05"]
    pid = registry.ensure_sidecar(spool, args)
    try:
        assert registry.ensure_sidecar(spool, args) == pid  # one per node
        status = wait_for(
            lambda: _status_with(spool, "sb"), "the sidecar's status to show the sandbox"
        )
        assert status["pid"] == pid and status["driver"].startswith("cgroup v1")
        assert status["sandboxes"]["sb"]["limits"]["mem_high"] >= 64 * MIB
        ticks = status["ticks"]
        wait_for(lambda: _status_with(spool, None)["ticks"] >= ticks + 3, "three more ticks")
        assert registry.unregister("sb", spool=spool)
        wait_for(lambda: "sb" not in _status_with(spool, None)["sandboxes"], "unregistration")
        assert registry.stop_sidecar(spool) == pid
        assert registry.running_pid(spool) is None
    finally:
        if registry.running_pid(spool) == pid:
            os.kill(pid, signal.SIGKILL)
    events = [json.loads(line) for line in (spool / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "stop"
    assert "register" in kinds and "unregister" in kinds
    [summary] = [e["run"] for e in events if e["event"] == "unregister"]
    assert summary is not None and summary["mem_peak"] >= 0
    assert len(History(tmp_path / "history").runs("env")) == 1  # the run went into history


def _status_with(spool: Path, sandbox: str | None) -> Any:
    try:
        status = registry.read_status(spool)
    except ProvisionError:
        return None
    return status if sandbox is None or sandbox in status["sandboxes"] else None
