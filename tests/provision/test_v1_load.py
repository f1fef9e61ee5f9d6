"""End to end on the real cgroup v1 hierarchy: the sidecar, at its default 250 ms tick, sizes
a sandbox whose process follows a script of memory and CPU demand.

The script: a ramp to 3x the initial memory limit (no OOM kill: the sidecar raises the limit
in time; tasks may wait at the limit for a tick, failcnt may rise), an idle phase (the limit
shrinks), a CPU burst (the quota grows). Every limit write is recorded in the event log with
the usage read just before it; none is below that usage plus the driver's guard. Calm periods
and half-lives are shortened to a second so the test takes seconds, not minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from provision_support import SidecarThread, V1Cgroups, read_events
from support.polling import wait_for

from weenvfs.provision import registry
from weenvfs.provision.cgroup_driver import MIB, CgroupLimits
from weenvfs.provision.history import History
from weenvfs.provision.policy import PolicyConfig
from weenvfs.provision.sidecar import SidecarConfig

FAST = {"mem_calm": 1.0, "mem_peak_half_life": 1.0, "cpu_calm": 1.0, "cpu_peak_half_life": 1.0}


def test_ramp_idle_and_cpu_burst_on_real_cgroup_v1(
    v1_cgroups: V1Cgroups, sidecar_config: Callable[..., SidecarConfig]
) -> None:
    driver = v1_cgroups.driver
    config = sidecar_config(
        interval=0.25, log_every_tick=True, policy=PolicyConfig().with_overrides(FAST)
    )
    cgroup = v1_cgroups.make("sb")
    initial = CgroupLimits(64 * MIB, 64 * MIB, 200)
    registry.register(
        "sb",
        cgroup.paths(),
        "env",
        initial,
        spool=config.spool,
        driver=driver,
        history=History(None),
    )
    process = v1_cgroups.load(cgroup)
    with SidecarThread(config, driver) as thread:
        thread.wait_ticks(2)
        # 1. Ramp to 192 MiB (3x the limit) in 2 s: the process completes, nothing is killed.
        process.run("mem 192 2")
        ramped = driver.read(cgroup)
        assert ramped.oom_kills == 0 and ramped.mem_usage >= 192 * MIB
        assert ramped.mem_limit is not None and ramped.mem_limit > 192 * MIB
        # 2. Idle at 16 MiB: the limit comes down.
        process.run("mem 16 0")
        wait_for(
            lambda: driver.read(cgroup).mem_limit < ramped.mem_limit * 0.7,  # type: ignore[operator]
            "the limit to shrink while idle",
        )

        # 3. CPU bursts at a 0.2-core quota: throttled, so the quota grows during the burst
        #    (repeated only if a busy machine gave the first one too little CPU to throttle).
        def burst_raised_quota() -> bool:
            process.run("cpu 1.5")
            return (driver.read(cgroup).cpu_quota_millis or 0) >= 800

        wait_for(burst_raised_quota, "the CPU quota to grow during a burst")
        thread.wait_ticks(1)
    final = driver.read(cgroup)
    assert final.oom_kills == 0 and process.popen.poll() is None  # alive all along
    # Stopping the sidecar released the v1 hold: nobody would raise the limit any more.
    assert "oom_kill_disable 0" in (cgroup.dirs["memory"] / "memory.oom_control").read_text()
    events = read_events(config.event_log)
    _check_every_write_kept_usage_plus_guard(events, driver.guard)
    samples = [e["sample"] for e in events if e["event"] == "sample"]
    assert samples and all(s["oom_kills"] == 0 for s in samples)
    reasons = [r for e in events if e["event"] == "decision" for r in e["reasons"]]
    assert {"mem:grow", "mem:track"} & set(reasons) and "mem:shrink" in reasons
    assert "cpu:throttled" in reasons and "cpu:grow" in reasons


def _check_every_write_kept_usage_plus_guard(events: list[dict[str, Any]], guard: int) -> None:
    limit_writes = [
        (value, usage_before)
        for e in events
        if e["event"] == "write"
        for file, value, usage_before, _clamped in e["writes"]
        if file == "memory.limit_in_bytes"
    ]
    assert len(limit_writes) >= 3  # initial adoption aside: grows and shrinks
    for value, usage_before in limit_writes:
        assert int(value) >= usage_before + guard, (value, usage_before)
