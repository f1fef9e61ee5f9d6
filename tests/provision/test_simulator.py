"""Demand traces and the simulator: the file format, the documented generator, and the three
policies on small traces whose outcome for the static policies can be worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weenvfs.provision.cgroup_driver import MIB, ProvisionError
from weenvfs.provision.simulator import Node, compare, simulate
from weenvfs.provision.trace import (
    Trace,
    generate_agentic,
    load_trace,
    save_trace,
    task,
    trace_from_events,
)

GIB = 1 << 30


def spiky(n: int = 10) -> Trace:
    """n tasks of one environment: 200 MiB for 300 s with one 1.5 GiB spike of 10 s, at a
    different time in each task (ramps of 1 s)."""
    tasks = []
    for i in range(n):
        at = 20 + (i * 37) % 250
        points = [
            (0, 200 * MIB, 100),
            (at, 200 * MIB, 100),
            (at + 1, 1536 * MIB, 1000),
            (at + 11, 1536 * MIB, 1000),
            (at + 12, 200 * MIB, 100),
            (300, 200 * MIB, 100),
        ]
        tasks.append(task(f"t{i}", "spiky", points))
    return Trace(tuple(tasks))


def test_demand_is_linear_between_points() -> None:
    t = task("a", "e", [(0, 0, 0), (10, 100 * MIB, 1000), (10, 50 * MIB, 500), (20, 50 * MIB, 0)])
    assert t.demand(-1) == (0, 0) and t.demand(5) == (50 * MIB, 500)
    assert t.demand(10) == (50 * MIB, 500)  # a step: the later point wins
    assert t.demand(15) == (50 * MIB, 250) and t.demand(99) == (50 * MIB, 0)
    assert t.peak() == (100 * MIB, 1000) and t.duration == 20
    mean_mem, mean_cpu = t.mean()
    assert mean_mem == pytest.approx((50 + 50) / 2 * MIB)
    assert mean_cpu == pytest.approx((500 + 250) / 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        task("b", "e", [(5, 0, 0), (1, 0, 0)])


def test_trace_files_round_trip_and_bad_files_are_named(tmp_path: Path) -> None:
    trace = generate_agentic(sandboxes=4, envs=2, seed=3)
    path = tmp_path / "t.json"
    save_trace(trace, path)
    loaded = load_trace(path)
    assert [t.sandbox_id for t in loaded.sandboxes] == ["t000", "t001", "t002", "t003"]
    assert loaded.sandboxes[1].mem == trace.sandboxes[1].mem
    assert loaded.meta["seed"] == 3
    for body, message in [
        ("{", "cannot read trace"),
        ('{"format": "other"}', "is not a weenv-demand-trace"),
        ('{"format": "weenv-demand-trace", "version": 9}', "trace version 9"),
        (
            '{"format": "weenv-demand-trace", "version": 1, "sandboxes": [{"id": 1}]}',
            "malformed sandbox entry",
        ),
    ]:
        path.write_text(body)
        with pytest.raises(ProvisionError, match=message):
            load_trace(path)


def test_the_agentic_generator_is_deterministic_and_has_its_documented_shape() -> None:
    trace = generate_agentic(sandboxes=40, envs=8, seed=5)
    assert trace == generate_agentic(sandboxes=40, envs=8, seed=5)
    assert trace != generate_agentic(sandboxes=40, envs=8, seed=6)
    assert [t.env for t in trace.sandboxes[:9]] == [f"env{i:02d}" for i in range(8)] + ["env00"]
    for t in trace.sandboxes:
        assert t.arrival == 0 and t.mem[0] == 32 * MIB
        assert 10 + 2 + 5 * 4.5 <= t.duration <= 30 + 2 + 20 * (40 + 0.02 + 66) + 1
        assert max(t.mem) <= (600 + 20 * 8) * MIB + 1.6 * 2.5 * GIB
        assert max(t.cpu) <= 4000


def test_static_and_elastic_on_a_spiky_trace() -> None:
    node = Node(memory=8 * GIB, cpu=8000)
    peak, mean, elastic = compare(spiky(30), node)
    # static-peak reserves 1536 MiB per task: five fit in 8 GiB, six do not.
    assert (peak.oom_kills, peak.completed, peak.density, peak.peak_running) == (0, 30, 5.0, 5)
    # static-mean (about 250 MiB) kills every task at its spike.
    assert (mean.oom_kills, mean.completed) == (30, 0)
    # elastic keeps the limits near usage and packs more (spikes rarely coincide), killing
    # nothing, although it starts cold (an unknown environment is assumed to need 2 GiB).
    assert (elastic.oom_kills, elastic.global_ooms, elastic.completed) == (0, 0, 30)
    assert elastic.density > peak.density and elastic.makespan < peak.makespan
    assert elastic.slack_frac < peak.slack_frac
    assert 0 < elastic.mem_used_frac <= 1


def test_the_benchmark_trace_shape_runs_small() -> None:
    trace = generate_agentic(sandboxes=12, envs=3, seed=1)
    node = Node(memory=8 * GIB, cpu=4000)
    results = {r.policy: r for r in compare(trace, node)}
    assert results["static-peak"].oom_kills == 0
    assert results["elastic"].oom_kills == 0 and results["elastic"].completed == 12
    assert json.dumps(results["elastic"].to_json())  # JSON-able


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(spiky(1), Node(GIB, 1000), "magic")


def test_a_trace_recorded_from_the_event_log(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    lines = [{"event": "start"}]
    for i in range(5):
        sample = {"time": 100.0 + i, "mem_usage": (10 + i) * MIB, "cpu_usage_us": i * 500_000}
        lines.append({"event": "sample", "sandbox": "sb", "env": "e1", "sample": sample})
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n{cut")
    trace = trace_from_events(log)
    [recorded] = trace.sandboxes
    assert recorded.env == "e1" and recorded.times == (0.0, 1.0, 2.0, 3.0, 4.0)
    assert recorded.mem[-1] == 14 * MIB and recorded.cpu == (0, 500, 500, 500, 500)
