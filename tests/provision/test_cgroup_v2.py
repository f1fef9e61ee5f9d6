"""The cgroup v2 driver: against a folder of its files, and the real cgroup2 mount.

This machine's cgroup2 mount offers no controllers (memory and cpu are bound to v1), so the
real-mount test covers what exists there (creating and removing a sandbox, moving a process
in, the core cpu.stat and PSI files); the limits test on a real cgroup2 runs only where the
kernel offers memory and cpu there, and says why it skips otherwise.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from provision_support import LoadProcess, V2Folder
from support.polling import wait_for

from weenvfs.provision.cgroup_detect import detect_driver
from weenvfs.provision.cgroup_driver import (
    MIB,
    CgroupFileError,
    CgroupGone,
    CgroupLimits,
    ProvisionError,
    Write,
    parse_keyed,
    parse_psi_total,
    read_mounts,
    v2_controllers,
)
from weenvfs.provision.cgroup_v2 import CgroupV2Driver


def test_read_parses_every_file(v2_folder: V2Folder) -> None:
    cgroup = v2_folder.make(
        "weenv-sb",
        memory_current=str(150 * MIB),
        memory_high=str(200 * MIB),
        memory_events="low 0\nhigh 3\nmax 1\noom 1\noom_kill 1\noom_group_kill 0\n",
        memory_pressure="some avg10=1.00 avg60=0.00 avg300=0.00 total=1234\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=99\n",
        cpu_max="50000 100000",
        cpu_stat="usage_usec 777\nnr_periods 9\nnr_throttled 4\nthrottled_usec 321\n",
        cpu_pressure="some avg10=0.00 avg60=0.00 avg300=0.00 total=55\n",
    )
    s = v2_folder.driver.read(cgroup)
    assert (s.mem_usage, s.mem_high, s.mem_limit, s.mem_cache) == (
        150 * MIB,
        200 * MIB,
        None,
        4 * MIB,
    )
    assert (s.mem_high_hits, s.mem_limit_hits, s.oom_kills, s.held) == (3, 1, 1, False)
    assert (s.mem_stall_us, s.cpu_stall_us) == (1234, 55)
    assert (s.cpu_usage_us, s.cpu_throttled_us, s.cpu_throttled_periods) == (777, 321, 4)
    assert s.cpu_quota_millis == 500


def test_psi_files_are_optional(v2_folder: V2Folder) -> None:
    cgroup = v2_folder.make("weenv-sb")
    for name in ("memory.pressure", "cpu.pressure"):
        (cgroup.dirs["unified"] / name).unlink()
    sample = v2_folder.driver.read(cgroup)
    assert sample.mem_stall_us is None and sample.cpu_stall_us is None


def test_raising_writes_max_before_high_and_lowering_high_before_max(v2_folder: V2Folder) -> None:
    cgroup = v2_folder.make("weenv-sb", memory_high=str(100 * MIB), memory_max=str(125 * MIB))
    driver = v2_folder.driver
    up = driver.apply(cgroup, CgroupLimits(200 * MIB, 250 * MIB, 1500))
    usage = 100 * MIB  # the default memory.current
    assert up == [
        Write("memory.max", str(250 * MIB), usage),
        Write("memory.high", str(200 * MIB), usage),
        Write("cpu.max", "150000 100000", usage),
    ]
    down = driver.apply(cgroup, CgroupLimits(150 * MIB, 160 * MIB, 0))
    assert [w.file for w in down] == ["memory.high", "memory.max", "cpu.max"]
    assert v2_folder.get(cgroup, "cpu.max") == "max 100000"
    assert (v2_folder.get(cgroup, "memory.high"), v2_folder.get(cgroup, "memory.max")) == (
        str(150 * MIB),
        str(160 * MIB),
    )
    assert driver.apply(cgroup, CgroupLimits(150 * MIB, 160 * MIB, 0)) == []  # nothing differs


def test_never_writes_below_usage_plus_guard(v2_folder: V2Folder) -> None:
    cgroup = v2_folder.make(
        "weenv-sb",
        memory_current=str(300 * MIB),
        memory_max=str(400 * MIB),
        memory_high=str(350 * MIB),
    )
    writes = v2_folder.driver.apply(cgroup, CgroupLimits(100 * MIB, 120 * MIB, 1000))
    floor = 300 * MIB + v2_folder.driver.guard
    assert [(w.file, int(w.value), w.clamped) for w in writes[:2]] == [
        ("memory.high", floor, True),
        ("memory.max", floor, True),
    ]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("memory.events", "high three\n", "expected an integer value"),
        ("memory.current", "lots\n", "expected an integer"),
        ("cpu.max", "50000\n", "expected 'QUOTA PERIOD'"),
        ("memory.pressure", "garbage\n", "expected a 'some ... total=N' line"),
        ("cpu.stat", "usage_usec 1 2\n", "expected 'key value' lines"),
    ],
)
def test_malformed_files_name_the_file(
    v2_folder: V2Folder, name: str, content: str, message: str
) -> None:
    cgroup = v2_folder.make("weenv-sb")
    (cgroup.dirs["unified"] / name).write_text(content)
    with pytest.raises(CgroupFileError, match=message) as caught:
        v2_folder.driver.read(cgroup)
    assert caught.value.path.endswith(name)


def test_a_missing_file_of_a_live_cgroup_is_malformed_not_gone(v2_folder: V2Folder) -> None:
    cgroup = v2_folder.make("weenv-sb")
    (cgroup.dirs["unified"] / "memory.current").unlink()
    with pytest.raises(CgroupFileError, match="controller enabled"):
        v2_folder.driver.read(cgroup)


def test_a_removed_cgroup_is_gone(v2_folder: V2Folder) -> None:
    cgroup = v2_folder.make("weenv-sb")
    for path in cgroup.dirs["unified"].iterdir():
        path.unlink()
    cgroup.dirs["unified"].rmdir()
    with pytest.raises(CgroupGone):
        v2_folder.driver.read(cgroup)
    with pytest.raises(CgroupGone):
        v2_folder.driver.apply(cgroup, CgroupLimits(100 * MIB, 100 * MIB, 100))
    assert not v2_folder.driver.exists(cgroup)


def test_resolve_and_create_rules(v2_folder: V2Folder) -> None:
    driver = v2_folder.driver
    cgroup = driver.resolve([str(v2_folder.root / "a" / "b")])
    assert cgroup.name == "a/b" and driver.resolve(["a/b"]) == cgroup
    for bad in (["/elsewhere/x"], [str(v2_folder.root)], ["a", "b"]):
        with pytest.raises(ProvisionError):
            driver.resolve(bad)
    with pytest.raises(ProvisionError, match="contain 'weenv'"):
        driver.create("sandbox")
    with pytest.raises(ProvisionError, match="contain 'weenv'"):
        driver.create("weenv/../x")


# --- the real cgroup2 mount -----------------------------------------------------------------


def _real_root(require_or_skip) -> CgroupV2Driver:  # type: ignore[no-untyped-def]
    roots = read_mounts().v2
    require_or_skip(roots and os.geteuid() == 0, "no cgroup2 mount, or not root")
    return CgroupV2Driver(roots[0])


def test_real_cgroup2_sandbox_lifecycle_and_core_files(require_or_skip) -> None:  # type: ignore[no-untyped-def]
    driver = _real_root(require_or_skip)
    parent = f"weenv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cgroup = driver.create(f"{parent}/sb")
    process = None
    try:
        process = LoadProcess(cgroup)
        assert driver.pids(cgroup) == [process.pid]
        path = cgroup.dirs["unified"]

        def usage() -> int:
            return parse_keyed(path / "cpu.stat", (path / "cpu.stat").read_text())["usage_usec"]

        first = usage()

        def spun() -> bool:  # however busy the machine, the spinning is charged here
            process.run("cpu 0.1")
            return usage() - first >= 50_000

        wait_for(spun, "50 ms of CPU charged to the sandbox")
        if (path / "cpu.pressure").exists():
            assert parse_psi_total(path / "cpu.pressure", (path / "cpu.pressure").read_text()) >= 0
        if "memory" not in v2_controllers(driver.root):
            with pytest.raises(CgroupFileError, match="controller enabled"):
                driver.read(cgroup)
    finally:
        if process is not None:
            process.kill()
            wait_for(lambda: not driver.pids(cgroup), "the load process to leave the cgroup")
        driver.remove(cgroup)
        driver.remove(driver.resolve([parent]))
    assert not cgroup.dirs["unified"].exists()


def test_real_cgroup2_limits(require_or_skip) -> None:  # type: ignore[no-untyped-def]
    driver = _real_root(require_or_skip)
    offered = v2_controllers(driver.root)
    if not {"memory", "cpu"} <= offered:
        # This kernel binds memory and cpu to v1 (the folder tests above cover the v2 files):
        # what is real here is that detection picks v1 and a v2 limit write fails clearly.
        assert type(detect_driver()).__name__ == "CgroupV1Driver"
        _assert_v2_limits_refused(driver)
        return
    parent = f"weenv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cgroup = driver.create(f"{parent}/sb")
    process = None
    try:
        driver.apply(cgroup, CgroupLimits(96 * MIB, 128 * MIB, 500))
        process = LoadProcess(cgroup)
        process.run("mem 32 0")
        time.sleep(0.1)
        sample = driver.read(cgroup)
        assert (sample.mem_high, sample.mem_limit, sample.cpu_quota_millis) == (
            96 * MIB,
            128 * MIB,
            500,
        )
        assert sample.mem_usage >= 32 * MIB and sample.oom_kills == 0
    finally:
        if process is not None:
            process.kill()
            wait_for(lambda: not driver.pids(cgroup), "the load process to leave the cgroup")
        driver.remove(cgroup)
        driver.remove(driver.resolve([parent]))


def _assert_v2_limits_refused(driver: CgroupV2Driver) -> None:
    """On a cgroup2 mount without memory/cpu, applying limits is a clear ProvisionError."""
    cgroup = driver.create(f"weenv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with pytest.raises(ProvisionError):
            driver.apply(cgroup, CgroupLimits(96 * MIB, 128 * MIB, 500))
    finally:
        driver.remove(cgroup)
