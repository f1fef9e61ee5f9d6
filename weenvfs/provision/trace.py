"""Demand traces: what each sandbox of a workload would use over time, if nothing limited it.

Owns: the trace file format, loading and saving it, turning a sidecar event log recorded with
`--log-every-tick` into a trace, and the documented synthetic `agentic-coding` generator.
Must not: simulate (simulator.py) or know about cgroups.

File (JSON): {"format": "weenv-demand-trace", "version": 1, "meta": {...}, "sandboxes": [
  {"id": "t000", "env": "env03", "arrival": 0.0, "points": [[t, mem_bytes, cpu_millis], ...]}]}
`t` is seconds since the sandbox started; demand is linear between points and the sandbox
ends at its last point. `arrival` is when the task is ready to be placed on the node.
"""

from __future__ import annotations

import bisect
import json
import random
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .cgroup_driver import MIB, ProvisionError

FORMAT = "weenv-demand-trace"
VERSION = 1
GIB = 1 << 30


@dataclass(frozen=True)
class TaskTrace:
    """One sandbox's demand: breakpoints (seconds from its start, bytes, millicores)."""

    sandbox_id: str
    env: str
    arrival: float
    times: tuple[float, ...]
    mem: tuple[int, ...]
    cpu: tuple[int, ...]

    @property
    def duration(self) -> float:
        """Seconds from start to the last point."""
        return self.times[-1]

    def demand(self, t: float) -> tuple[int, int]:
        """(bytes, millicores) wanted `t` seconds after the start (linear between points)."""
        times = self.times
        if t <= times[0]:
            return self.mem[0], self.cpu[0]
        if t >= times[-1]:
            return self.mem[-1], self.cpu[-1]
        i = bisect.bisect_right(times, t)
        t0, t1 = times[i - 1], times[i]
        f = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return (
            round(self.mem[i - 1] + (self.mem[i] - self.mem[i - 1]) * f),
            round(self.cpu[i - 1] + (self.cpu[i] - self.cpu[i - 1]) * f),
        )

    def peak(self) -> tuple[int, int]:
        """Largest memory and CPU demand."""
        return max(self.mem), max(self.cpu)

    def mean(self) -> tuple[float, float]:
        """Time-weighted mean memory and CPU demand."""
        area_m = area_c = 0.0
        for i in range(1, len(self.times)):
            dt = self.times[i] - self.times[i - 1]
            area_m += (self.mem[i] + self.mem[i - 1]) / 2 * dt
            area_c += (self.cpu[i] + self.cpu[i - 1]) / 2 * dt
        span = self.duration or 1.0
        return area_m / span, area_c / span


@dataclass(frozen=True)
class Trace:
    """Many sandboxes' demand, with a free-form description."""

    sandboxes: tuple[TaskTrace, ...]
    meta: Mapping[str, object] = field(default_factory=dict)

    def by_env(self) -> dict[str, list[TaskTrace]]:
        """Tasks grouped by environment."""
        groups: dict[str, list[TaskTrace]] = defaultdict(list)
        for task in self.sandboxes:
            groups[task.env].append(task)
        return dict(groups)


def task(
    sandbox_id: str, env: str, points: list[tuple[float, int, int]], arrival: float = 0.0
) -> TaskTrace:
    """A TaskTrace from (t, bytes, millicores) points; ValueError unless t is non-decreasing."""
    if not points or any(b[0] < a[0] for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(f"trace of {sandbox_id}: points must be non-empty, times non-decreasing")
    return TaskTrace(
        sandbox_id,
        env,
        float(arrival),
        tuple(float(p[0]) for p in points),
        tuple(int(p[1]) for p in points),
        tuple(int(p[2]) for p in points),
    )


def save_trace(trace: Trace, path: Path | str) -> None:
    """Write `trace` as JSON."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "meta": dict(trace.meta),
        "sandboxes": [
            {
                "id": t.sandbox_id,
                "env": t.env,
                "arrival": t.arrival,
                "points": [
                    [round(a, 3), b, c] for a, b, c in zip(t.times, t.mem, t.cpu, strict=True)
                ],
            }
            for t in trace.sandboxes
        ],
    }
    Path(path).write_text(json.dumps(body, separators=(",", ":")), encoding="utf-8")


def load_trace(path: Path | str) -> Trace:
    """Read a trace file; ProvisionError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ProvisionError(f"cannot read trace {path}: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProvisionError(f"{path} is not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise ProvisionError(f"{path}: trace version {data.get('version')} (want {VERSION})")
    try:
        tasks = tuple(
            task(
                str(s["id"]),
                str(s["env"]),
                [tuple(p) for p in s["points"]],
                float(s.get("arrival", 0.0)),
            )
            for s in data["sandboxes"]
        )
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ProvisionError(f"{path}: malformed sandbox entry: {error}") from None
    return Trace(tasks, data.get("meta", {}))


def trace_from_events(path: Path | str) -> Trace:
    """A trace of what sandboxes used, from a sidecar event log with `sample` events.

    Usage under limits is a lower bound of demand: a recorded trace shows what happened.
    """
    points: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
    envs: dict[str, str] = {}
    last_cpu: dict[str, tuple[float, int]] = {}
    for event in _events(path):
        if event.get("event") != "sample":
            continue
        key, sample = str(event["sandbox"]), event["sample"]
        now, cpu_us = float(sample["time"]), int(sample["cpu_usage_us"])
        before = last_cpu.get(key)
        rate = (
            0
            if before is None or now <= before[0]
            else round((cpu_us - before[1]) / (now - before[0]) / 1e3)
        )
        last_cpu[key] = (now, cpu_us)
        envs[key] = str(event.get("env", key))
        points[key].append((now, int(sample["mem_usage"]), rate))
    tasks = []
    for key, pts in points.items():
        start = pts[0][0]
        tasks.append(task(key, envs[key], [(t - start, m, c) for t, m, c in pts], start))
    origin = min((t.arrival for t in tasks), default=0.0)
    tasks = [
        TaskTrace(t.sandbox_id, t.env, t.arrival - origin, t.times, t.mem, t.cpu) for t in tasks
    ]
    return Trace(tuple(tasks), {"source": f"event log {path}"})


def _events(path: Path | str) -> Iterator[dict[str, object]]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                yield json.loads(line)
            except ValueError:
                continue  # a line cut by a crash


# --- the synthetic agentic-coding workload ------------------------------------------------

AGENTIC_DOC = """\
agentic-coding: each task is one agent rollout in a repository sandbox.
Per environment (repository): base memory U(150, 600) MiB; test-run extra memory
log-uniform(300 MiB, 2.5 GiB); build parallelism one of 1, 2, 2, 4 cores.
Per task: setup 10-30 s (checkout and install: memory ramps to 1.4x base at 1.5 cores, then
settles to base in 2 s); then 5-20 turns, each a model call (idle 4-40 s, 0.02 cores) and a
tool call: 55% read/edit (0.5-3 s, +10-60 MiB, 0.3-0.8 cores), 35% test run (ramp in 1-4 s
to base + 0.4-1.0x the extra, hold 3-40 s, 0.6-1.0x the build cores, drop in 1 s), 10%
build (ramp in 2-6 s to base + 1.0-1.6x the extra, hold 10-60 s, full build cores). Base
memory creeps 0-8 MiB per turn (caches, history). Tasks are spread round-robin over the
environments and all arrive at t=0 (one batch of rollouts)."""


def generate_agentic(sandboxes: int = 200, envs: int = 20, seed: int = 1) -> Trace:
    """The documented agentic-coding trace (see AGENTIC_DOC); same seed, same trace."""
    rng = random.Random(seed)
    profiles = [
        (rng.uniform(150, 600) * MIB, 2 ** rng.uniform(8.23, 11.32) * MIB, rng.choice([1, 2, 2, 4]))
        for _ in range(envs)
    ]
    tasks = []
    for n in range(sandboxes):
        env = n % envs
        points = _agentic_task(rng, *profiles[env])
        tasks.append(task(f"t{n:03d}", f"env{env:02d}", points))
    meta = {
        "generator": "agentic-coding",
        "sandboxes": sandboxes,
        "envs": envs,
        "seed": seed,
        "description": AGENTIC_DOC,
    }
    return Trace(tuple(tasks), meta)


def _agentic_task(
    rng: random.Random, base: float, extra: float, cores: int
) -> list[tuple[float, int, int]]:
    t = 0.0
    pts: list[tuple[float, int, int]] = [(0.0, int(32 * MIB), 100)]

    def add(dt: float, mem: float, cpu: float) -> None:
        nonlocal t
        t += dt
        pts.append((round(t, 3), int(mem), int(cpu)))

    setup = rng.uniform(10, 30)
    add(setup, base * 1.4, 1500)
    add(2.0, base, 50)
    for _ in range(rng.randint(5, 20)):
        add(0.01, base, 20)
        add(rng.uniform(4, 40), base, 20)
        kind = rng.random()
        if kind < 0.55:
            bump = rng.uniform(10, 60) * MIB
            add(0.01, base + bump, rng.uniform(300, 800))
            add(rng.uniform(0.5, 3), base + bump, rng.uniform(300, 800))
        else:
            build = kind >= 0.90
            scale = rng.uniform(1.0, 1.6) if build else rng.uniform(0.4, 1.0)
            cpu = cores * 1000 * (1.0 if build else rng.uniform(0.6, 1.0))
            add(rng.uniform(2, 6) if build else rng.uniform(1, 4), base + extra * scale, cpu)
            add(rng.uniform(10, 60) if build else rng.uniform(3, 40), base + extra * scale, cpu)
            add(1.0, base, 20)
        base += rng.uniform(0, 8) * MIB
    add(1.0, base, 20)
    return pts
