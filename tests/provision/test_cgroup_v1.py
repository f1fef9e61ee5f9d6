"""The cgroup v1 driver against the machine's real memory, cpu and cpuacct hierarchies.

Every cgroup lives under a `weenv-test-<pid>-<hex>` parent that the `v1_cgroups` fixture
removes, after killing the load processes it started.
"""

from __future__ import annotations

import signal

import pytest
from provision_support import V1Cgroups
from support.polling import wait_for

from weenvfs.provision.cgroup_driver import MIB, CgroupGone, CgroupLimits, ProvisionError
from weenvfs.provision.cgroup_v1 import CgroupV1Driver


def test_create_read_remove(v1_cgroups: V1Cgroups) -> None:
    cgroup = v1_cgroups.make("sb")
    assert set(cgroup.dirs) == {"memory", "cpu", "cpuacct"}
    assert all(path.is_dir() and "weenv-test-" in str(path) for path in cgroup.dirs.values())
    sample = v1_cgroups.driver.read(cgroup)
    assert sample.mem_usage == 0 and sample.mem_limit is None
    assert sample.cpu_quota_millis is None and not sample.held
    assert sample.mem_stall_us is None  # v1 has no per-cgroup PSI


def test_resolve_maps_every_hierarchy_to_one_name(v1: CgroupV1Driver) -> None:
    a = v1.resolve([str(v1.roots["memory"] / "x/weenv-a"), str(v1.roots["cpu"] / "x/weenv-a")])
    assert a.name == "x/weenv-a" and a == v1.resolve(["x/weenv-a"])
    with pytest.raises(ProvisionError, match="do not name one"):
        v1.resolve([str(v1.roots["memory"] / "a"), str(v1.roots["cpu"] / "b")])
    with pytest.raises(ProvisionError, match="not inside"):
        v1.resolve(["/tmp/weenv"])


def test_apply_writes_what_differs_and_reads_back(v1_cgroups: V1Cgroups) -> None:
    driver, cgroup = v1_cgroups.driver, v1_cgroups.make("sb")
    limits = CgroupLimits(64 * MIB, 64 * MIB, 500, mem_soft=32 * MIB, hold=True)
    writes = driver.apply(cgroup, limits)
    assert [w.file for w in writes] == [
        "memory.oom_control",
        "memory.limit_in_bytes",
        "memory.soft_limit_in_bytes",
        "cpu.cfs_quota_us",
    ]
    sample = driver.read(cgroup)
    assert (sample.mem_limit, sample.cpu_quota_millis) == (64 * MIB, 500)
    assert "oom_kill_disable 1" in (cgroup.dirs["memory"] / "memory.oom_control").read_text()
    assert driver.apply(cgroup, CgroupLimits(64 * MIB, 64 * MIB, 500, 32 * MIB, True)) == []
    bigger = CgroupLimits(96 * MIB, 96 * MIB, 0, 32 * MIB)
    assert [w.file for w in driver.apply(cgroup, bigger)] == [
        "memory.limit_in_bytes",
        "cpu.cfs_quota_us",
    ]
    assert driver.read(cgroup).cpu_quota_millis is None  # 0 millicores: no quota


def test_never_lowers_below_usage_plus_guard(v1_cgroups: V1Cgroups) -> None:
    driver, cgroup = v1_cgroups.driver, v1_cgroups.make("sb")
    process = v1_cgroups.load(cgroup)
    process.run("mem 48 0")
    writes = driver.apply(cgroup, CgroupLimits(32 * MIB, 32 * MIB, 1000))
    [limit] = [w for w in writes if w.file == "memory.limit_in_bytes"]
    assert limit.clamped and int(limit.value) == limit.usage_before + driver.guard
    assert limit.usage_before >= 48 * MIB
    process.run("sleep 0.1")  # still alive, nothing was reclaimed from under it
    assert driver.read(cgroup).oom_kills == 0


def test_hold_makes_tasks_wait_at_the_limit_until_it_is_raised(v1_cgroups: V1Cgroups) -> None:
    driver, cgroup = v1_cgroups.driver, v1_cgroups.make("sb")
    driver.apply(cgroup, CgroupLimits(64 * MIB, 64 * MIB, 1000, hold=True))
    process = v1_cgroups.load(cgroup)
    process.send("mem 96 0")
    held = wait_for(lambda: driver.read(cgroup).held, "the task to be held at the limit")
    assert held and process.popen.poll() is None
    driver.apply(cgroup, CgroupLimits(160 * MIB, 160 * MIB, 1000, hold=True))  # wakes it
    process.expect("ok mem 96 0")
    sample = driver.read(cgroup)
    assert not sample.held and sample.oom_kills == 0 and sample.mem_limit_hits > 0
    assert sample.mem_usage >= 96 * MIB


def test_release_lets_the_kernel_kill_a_held_task(v1_cgroups: V1Cgroups) -> None:
    driver, cgroup = v1_cgroups.driver, v1_cgroups.make("sb")
    driver.apply(cgroup, CgroupLimits(64 * MIB, 64 * MIB, 1000, hold=True))
    process = v1_cgroups.load(cgroup)
    process.send("mem 96 0")
    wait_for(lambda: driver.read(cgroup).held, "the task to be held at the limit")
    driver.apply(cgroup, CgroupLimits(64 * MIB, 64 * MIB, 1000, hold=False))
    assert process.popen.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: driver.read(cgroup).oom_kills == 1, "the OOM kill to be counted")


def test_a_removed_cgroup_is_gone(v1_cgroups: V1Cgroups) -> None:
    driver, cgroup = v1_cgroups.driver, v1_cgroups.make("sb")
    driver.remove(cgroup)
    with pytest.raises(CgroupGone):
        driver.read(cgroup)
    with pytest.raises(CgroupGone):
        driver.apply(cgroup, CgroupLimits(64 * MIB, 64 * MIB, 100))
    driver.remove(cgroup)  # removing twice is fine


def test_cpu_counters_follow_a_spinning_task(v1_cgroups: V1Cgroups) -> None:
    driver, cgroup = v1_cgroups.driver, v1_cgroups.make("sb")
    driver.apply(cgroup, CgroupLimits(256 * MIB, 256 * MIB, 200))  # 0.2 cores
    process = v1_cgroups.load(cgroup)
    before = driver.read(cgroup)

    def throttled() -> bool:  # spins until the quota bites, however busy the machine is
        process.run("cpu 0.3")
        return driver.read(cgroup).cpu_throttled_periods > before.cpu_throttled_periods

    wait_for(throttled, "the quota to throttle the spinning task")
    after = driver.read(cgroup)
    assert after.cpu_throttled_us > before.cpu_throttled_us
    assert after.cpu_usage_us > before.cpu_usage_us
