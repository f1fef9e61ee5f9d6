"""Per-environment history: run statistics, the JSON files on the node, and seeded limits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from weenvfs.provision.cgroup_driver import MIB, CgroupLimits, Sample
from weenvfs.provision.history import History, RunStats, RunSummary
from weenvfs.provision.policy import PolicyConfig


def run(mem_start_peak: int, cpu_start_peak: int, mem_peak: int = 0) -> RunSummary:
    return RunSummary(
        mem_peak=mem_peak or mem_start_peak,
        mem_start_peak=mem_start_peak,
        mem_mean=1,
        cpu_peak=cpu_start_peak,
        cpu_start_peak=cpu_start_peak,
        cpu_mean=1,
        duration=10.0,
        oom_kills=0,
        ended=0.0,
    )


def test_run_stats_exact() -> None:
    stats = RunStats(start_window=1.0)
    usages = [100, 200, 300, 200, 100]
    cpu_us = [0, 250_000, 750_000, 1_000_000, 1_000_000]
    for t, (mem, cpu) in enumerate(zip(usages, cpu_us, strict=True)):
        stats.add(Sample(time=10.0 + t, mem_usage=mem * MIB, cpu_usage_us=cpu, oom_kills=t // 3))
    summary = stats.summary()
    assert summary is not None
    assert summary.mem_peak == 300 * MIB
    assert summary.mem_start_peak == 200 * MIB  # samples at t <= 1 s from the first
    assert summary.mem_mean == 200 * MIB  # trapezoids: (150 + 250 + 250 + 150) / 4
    assert (summary.cpu_peak, summary.cpu_start_peak, summary.cpu_mean) == (500, 250, 250)
    assert summary.duration == 4.0 and summary.oom_kills == 1


def test_run_stats_need_two_samples() -> None:
    stats = RunStats()
    assert stats.summary() is None
    stats.add(Sample(time=1.0, mem_usage=MIB))
    assert stats.summary() is None


def test_history_keeps_the_last_runs_and_seeds_from_start_peaks(tmp_path: Path) -> None:
    history = History(tmp_path / "h", keep=3)
    config = PolicyConfig()
    assert history.seed("env", config) is None
    for i in range(5):
        history.record("env", run((100 + 10 * i) * MIB, 200 + i))
    kept = history.runs("env")
    assert [r.mem_start_peak // MIB for r in kept] == [120, 130, 140]
    # The largest start-up peak of the kept runs, plus headroom, rounded up: 140 * 1.2 = 168.
    # CPU: 204 * 1.25 = 255 -> 260 millicores. v2's safety net is 1.25x: 210 MiB.
    assert history.seed("env", config) == CgroupLimits(168 * MIB, 210 * MIB, 260)
    body = json.loads((tmp_path / "h" / "env.json").read_text())
    assert body["env"] == "env" and len(body["runs"]) == 3
    assert History(tmp_path / "h").runs("env") == kept  # another reader sees the same


def test_seed_respects_floors(tmp_path: Path) -> None:
    history = History(None)
    history.record("tiny", run(MIB, 1))
    assert history.seed("tiny", PolicyConfig()) == CgroupLimits(64 * MIB, 80 * MIB, 100)


def test_odd_environment_names_get_a_hashed_file(tmp_path: Path) -> None:
    history = History(tmp_path)
    history.record("../etc/passwd", run(MIB, 1))
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert len(names) == 1 and len(names[0]) == 64 + len(".json")
    assert len(history.runs("../etc/passwd")) == 1


def test_unreadable_history_counts_as_none(tmp_path: Path, assert_logs: Any) -> None:
    (tmp_path / "env.json").write_text("{not json")
    with assert_logs("ignoring unreadable history", count=1):
        assert History(tmp_path).runs("env") == []
