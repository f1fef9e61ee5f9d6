"""The sidecar loop on a cgroup2-shaped folder: decisions, the event log, status, and faults.

Faults are injected by thin wrappers in front of the real v2 driver: a cgroup removed between
reading it and writing its limits (mid-tick), a garbled file, a write that blocks (as one
stuck in reclaim would).
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from provision_support import FolderV2Driver, SidecarThread, V2Folder, read_events
from support.polling import wait_for

from weenvfs.provision import registry
from weenvfs.provision.cgroup_driver import MIB, Cgroup, CgroupLimits, ProvisionError, Sample, Write
from weenvfs.provision.history import History
from weenvfs.provision.sidecar import SidecarConfig

START = CgroupLimits(200 * MIB, 250 * MIB, 1000)


def _register(folder: V2Folder, spool: Path, name: str, driver: Any = None) -> Cgroup:
    cgroup = folder.make(f"weenv-{name}")
    registry.register(
        name,
        [f"weenv-{name}"],
        f"env-{name}",
        START,
        spool=spool,
        driver=driver or folder.driver,
        history=History(None),
    )
    return cgroup


def _high(folder: V2Folder, cgroup: Cgroup) -> int:
    return int(folder.get(cgroup, "memory.high"))


def test_pressure_grows_the_limit_and_every_decision_is_logged_with_its_inputs(
    v2_folder: V2Folder, sidecar_config: Callable[..., SidecarConfig]
) -> None:
    config = sidecar_config()
    cgroup = _register(v2_folder, config.spool, "a")
    with SidecarThread(config, v2_folder.threaded_driver) as thread:
        thread.wait_ticks(3)
        assert _high(v2_folder, cgroup) == 200 * MIB
        v2_folder.set(cgroup, memory_current=str(190 * MIB))  # 95% of memory.high
        wait_for(lambda: _high(v2_folder, cgroup) >= 300 * MIB, "memory.high to grow")
        status = json.loads((config.spool / "status.json").read_text())
    final_high, final_max = _high(v2_folder, cgroup), int(v2_folder.get(cgroup, "memory.max"))
    events = read_events(config.event_log)
    [grow] = [e for e in events if e["event"] == "decision" and "mem:grow" in e["reasons"]]
    assert "mem:near-limit" in grow["reasons"] and grow["inputs"]["mem_usage"] == 190 * MIB
    assert grow["old"]["mem_high"] == 200 * MIB and grow["new"]["mem_high"] >= 300 * MIB
    writes = [e for e in events if e["event"] == "write" and e["sandbox"] == "a"]
    decided = [e["new"] for e in events if e["event"] == "decision" and e["sandbox"] == "a"]
    # Latest wins: a decision superseded before its write started is never written.
    assert writes and all(w["limits"] in decided for w in writes)
    assert (final_high, final_max) == (decided[-1]["mem_high"], decided[-1]["mem_max"])
    for write in writes:
        for file, value, usage_before, _clamped in write["writes"]:
            if file in ("memory.high", "memory.max"):
                assert int(value) >= usage_before + v2_folder.driver.guard
    assert status["sandboxes"]["a"]["env"] == "env-a"
    assert status["node"]["mem_budget"] == 8 << 30 and status["node"]["cpu_budget"] == 8000


class VanishingDriver(FolderV2Driver):
    """The real v2 driver, except that one read of `vanish` first calls `before` (which
    changes what that read sees), then deletes the cgroup's folder."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.vanish: Cgroup | None = None
        self.before: Callable[[], None] = lambda: None
        self.vanished = threading.Event()

    def read(self, cgroup: Cgroup) -> Sample:
        if cgroup == self.vanish:
            self.before()
        sample = super().read(cgroup)
        if cgroup == self.vanish:
            self.vanish = None
            shutil.rmtree(cgroup.dirs["unified"])  # between this read and the tick's writes
            self.vanished.set()
        return sample


def test_survives_a_cgroup_removed_mid_tick(
    v2_folder: V2Folder, sidecar_config: Callable[..., SidecarConfig], assert_logs: Any
) -> None:
    # Ticks 0.2 s apart: the vanishing tick's writer must take "a" up before the next tick
    # drops it (a writer still busy with an earlier write on a loaded node picked the new
    # limits up only after that, found "a" dropped and wrote nothing: a CI run saw no
    # write-error once).
    config = sidecar_config(interval=0.2)
    driver = VanishingDriver(v2_folder.root)
    a = _register(v2_folder, config.spool, "a", driver)
    b = _register(v2_folder, config.spool, "b", driver)
    # The expectation first: the thread logs from its first tick on, and until it stops.
    with assert_logs("cgroup vanished", count=1), SidecarThread(config, driver) as thread:
        thread.wait_ticks(3)
        wait_for(lambda: not thread.sidecar._in_flight,  # type: ignore[union-attr]
                 "the earlier writes to end")
        # In the read of the tick that finds it gone, so that this tick also writes a (set
        # before it, an earlier tick could read the new usage and write a then: no error).
        driver.before = lambda: v2_folder.set(a, memory_current=str(195 * MIB))
        driver.vanish = a
        wait_for(driver.vanished.is_set, "the cgroup to vanish")
        wait_for(lambda: "a" not in thread.sidecar.watched, "the sandbox to be dropped")  # type: ignore[union-attr]
        v2_folder.set(b, memory_current=str(195 * MIB))
        wait_for(lambda: _high(v2_folder, b) >= 300 * MIB, "the other sandbox to grow")
    events = read_events(config.event_log)
    assert [e["sandbox"] for e in events if e["event"] == "gone"] == ["a"]
    assert any(e["event"] == "write-error" and e["gone"] for e in events)
    assert len(History(config.history_dir).runs("env-a")) == 1  # its run is remembered
    # The registration file stays (the runtime owns it) but is not watched again.
    assert "a" in registry.registrations(config.spool)


def test_survives_a_malformed_file(
    v2_folder: V2Folder, sidecar_config: Callable[..., SidecarConfig], assert_logs: Any
) -> None:
    config = sidecar_config()
    a = _register(v2_folder, config.spool, "a")
    b = _register(v2_folder, config.spool, "b")
    good_stat = v2_folder.get(b, "memory.stat")
    with SidecarThread(config, v2_folder.threaded_driver) as thread:
        thread.wait_ticks(2)
        with assert_logs("sandbox b: cannot read cgroup"):
            v2_folder.set(b, memory_stat="anon lots\n")
            wait_for(lambda: thread.sidecar.watched["b"].errors >= 3, "read errors")  # type: ignore[union-attr]
            v2_folder.set(a, memory_current=str(195 * MIB))
            wait_for(lambda: _high(v2_folder, a) >= 300 * MIB, "the healthy sandbox to grow")
            v2_folder.set(b, memory_stat=good_stat, memory_current=str(195 * MIB))
            wait_for(lambda: _high(v2_folder, b) >= 300 * MIB, "the mended sandbox to grow")
    errors = [e for e in read_events(config.event_log) if e["event"] == "read-error"]
    assert errors and all(e["sandbox"] == "b" and "memory.stat" in e["error"] for e in errors)


class BlockingDriver(FolderV2Driver):
    """The real v2 driver, except that writes to one cgroup wait for `release`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.slow: Cgroup | None = None
        self.blocked = threading.Event()
        self.release = threading.Event()

    def apply(self, cgroup: Cgroup, limits: CgroupLimits) -> list[Write]:
        if cgroup == self.slow:
            self.blocked.set()
            self.release.wait(60)
        return super().apply(cgroup, limits)


def test_a_blocked_write_stalls_neither_the_loop_nor_other_sandboxes(
    v2_folder: V2Folder, sidecar_config: Callable[..., SidecarConfig]
) -> None:
    config = sidecar_config()
    driver = BlockingDriver(v2_folder.root)
    slow = _register(v2_folder, config.spool, "slow", driver)
    fast = _register(v2_folder, config.spool, "fast", driver)
    try:
        with SidecarThread(config, driver) as thread:
            thread.wait_ticks(2)
            driver.slow = slow
            v2_folder.set(slow, memory_current=str(195 * MIB))
            wait_for(driver.blocked.is_set, "the slow write to block")
            thread.wait_ticks(5)  # the loop keeps ticking
            v2_folder.set(fast, memory_current=str(195 * MIB))
            wait_for(lambda: _high(v2_folder, fast) >= 300 * MIB, "the other sandbox's write")
            v2_folder.set(slow, memory_current=str(290 * MIB))  # a newer decision is pending
            thread.wait_ticks(3)
            assert _high(v2_folder, slow) == 200 * MIB  # still stuck in the first write
            driver.release.set()
            wanted = lambda: thread.sidecar.states["slow"].limits.mem_high  # type: ignore[union-attr]  # noqa: E731
            wait_for(
                lambda: _high(v2_folder, slow) == wanted() > 300 * MIB,
                "the latest decision to be written",
            )
    finally:
        driver.release.set()


def test_cgroups_given_on_the_command_line_are_watched(
    v2_folder: V2Folder, sidecar_config: Callable[..., SidecarConfig]
) -> None:
    cgroup = v2_folder.make("weenv-cli", memory_current=str(600 * MIB))
    config = sidecar_config(cgroups=(str(cgroup.dirs["unified"]),))
    with SidecarThread(config, v2_folder.threaded_driver) as thread:
        thread.wait_ticks(2)
        state = thread.sidecar.states["cgroup:weenv-cli"]  # type: ignore[union-attr]
        # Started from its usage plus headroom (600 * 1.2 = 720 MiB), not below it.
        assert state.limits.mem_high >= 720 * MIB
    assert _high(v2_folder, cgroup) >= 720 * MIB


class FailingDriver(FolderV2Driver):
    """The real v2 driver, except that writes fail (as EINVAL or EBUSY would) while `fail`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail = True
        self.attempts = 0

    def apply(self, cgroup: Cgroup, limits: CgroupLimits) -> list[Write]:
        if self.fail:
            self.attempts += 1
            raise ProvisionError(f"writing to {cgroup.name}: Invalid argument")
        return super().apply(cgroup, limits)


def test_a_failing_write_is_retried_every_tick_and_logged_once(
    v2_folder: V2Folder, sidecar_config: Callable[..., SidecarConfig], assert_logs: Any
) -> None:
    config = sidecar_config()
    driver = FailingDriver(v2_folder.root)
    cgroup = _register(v2_folder, config.spool, "a", v2_folder.driver)
    # The expectation first: the first tick may write (and fail) before the block starts.
    with assert_logs("writing limits failed", count=1), SidecarThread(config, driver) as thread:
        v2_folder.set(cgroup, memory_current=str(195 * MIB))
        wait_for(lambda: driver.attempts >= 3, "three attempts")
        driver.fail = False
        wanted = thread.sidecar.states["a"].limits.mem_high  # type: ignore[union-attr]
        assert wanted > 200 * MIB
        wait_for(lambda: _high(v2_folder, cgroup) == wanted, "the write to succeed")
    errors = [e for e in read_events(config.event_log) if e["event"] == "write-error"]
    assert len(errors) >= 3 and not any(e["gone"] for e in errors)
