"""The policy on a simulated node: packing density, OOM kills, throttling and slack.

Owns: `simulate` (one policy over a trace), `compare` (static-peak, static-mean and elastic
side by side) and `SimResult`. Must not: change the policy: the elastic run calls the same
`policy.step` the sidecar calls, on samples made from the trace.

The model, tick by tick (docs/provisioner.md has the reasons):
- Tasks wait in arrival order and the node starts the head task when it fits. Static
  policies reserve their fixed limit (sum <= node memory), per environment from the trace
  itself: its tasks' largest peak (static-peak) or mean (static-mean) demand. Elastic admits
  by the rule in `Node` (elastic limits fit, nobody squeezed, a statistical burst reserve
  from the environments' history). A task's seed limits come from the history of its
  environment's finished tasks, learned as the simulation runs (cold at first).
- A task advances through its trace at the share of CPU it gets (quota, then the node's
  cores shared in proportion), and not at all while held: throttling stretches tasks.
- Memory: a static limit is hard (demand above it is an OOM kill). The elastic limit holds
  tasks (v2 memory.high, v1 held at the limit): usage stays at the limit, `held` and a high
  event show it, and a release by the policy with demand still above is an OOM kill. If the
  node's total usage exceeds its memory, the largest task is killed (global OOM).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

from .budget import step
from .cgroup_driver import CgroupLimits, Sample
from .history import SEED_RUNS, History, RunStats
from .policy import (
    PolicyConfig,
    SandboxState,
    default_bounds,
    initial_limits,
    initial_state,
    quantize,
)
from .trace import TaskTrace, Trace

POLICIES = ("static-peak", "static-mean", "elastic")
DEFAULT_MEM = 512 << 20
DEFAULT_CPU = 1000
UNKNOWN_ENV_MEAN = 2 << 30  # what the admission assumes of an environment never seen


@dataclass(frozen=True)
class Node:
    """A node: memory in bytes, CPU in millicores, and the elastic admission rule.

    Elastic admission starts a task when the elastic limits, the newcomer's included, fit in
    memory, no sandbox is squeezed, and mean + admit_z * spread of the running environments'
    usage (from their history: mean, and (peak - mean) / 2 taken as a standard deviation) fits
    in admit * memory.
    """

    memory: int
    cpu: int
    admit: float = 1.0
    admit_z: float = 3.0


@dataclass
class SimResult:
    """What one policy did with a trace on a node."""

    policy: str
    tasks: int = 0
    completed: int = 0
    oom_kills: int = 0
    global_ooms: int = 0  # of oom_kills: the node ran out of memory
    makespan: float = 0.0
    density: float = 0.0  # mean sandboxes running while tasks were waiting
    mean_running: float = 0.0  # over the whole run
    peak_running: int = 0
    stretch: float = 0.0  # mean wall time / trace time of completed tasks
    mem_held_s: float = 0.0  # sandbox-seconds with demand above the elastic limit
    cpu_throttled_s: float = 0.0  # core-seconds denied by quotas
    cpu_contended_s: float = 0.0  # core-seconds lost to the node's cores being busy
    cpu_demand_s: float = 0.0  # core-seconds demanded
    slack_frac: float = 0.0  # mean (reserved - used) / reserved memory
    mem_used_frac: float = 0.0  # mean node memory in use / node memory
    squeezed_ticks: int = 0
    # (seconds, sandboxes running, memory reserved, memory used) every `timeline_every` s
    timeline: list[tuple[float, int, int, int]] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        """A JSON-able dict with rounded figures (without the timeline)."""
        return {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in dataclasses.asdict(self).items()
            if k != "timeline"
        }


@dataclass
class _Running:
    task: TaskTrace
    start: float
    limits: CgroupLimits
    pos: float = 0.0  # seconds of the trace done: held or throttled tasks fall behind
    cpu_us: float = 0.0
    throttled_us: float = 0.0
    high_hits: int = 0
    stats: RunStats = dataclasses.field(default_factory=RunStats)


class _Sim:
    def __init__(
        self, trace: Trace, node: Node, policy: str, config: PolicyConfig, timeline_every: float
    ) -> None:
        self.timeline_every = timeline_every
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
        self.node, self.policy, self.config = node, policy, config
        self.elastic = policy == "elastic"
        self.queue = deque(sorted(trace.sandboxes, key=lambda t: t.arrival))
        self.static = _static_limits(trace, config, node, policy)
        self.history = History(None)
        self.running: dict[str, _Running] = {}
        self.states: dict[str, SandboxState] = {}
        self.result = SimResult(policy, tasks=len(trace.sandboxes))
        self.squeezed = False
        self.stretch_sum = 0.0

    def run(self) -> SimResult:
        tick, now, r = self.config.tick, 0.0, self.result
        saturated_ticks = saturated_sum = ticks = running_sum = 0
        slack_sum = used_sum = 0.0
        while self.queue or self.running:
            for key in [k for k, run in self.running.items() if run.pos >= run.task.duration]:
                self._finish(key, killed=False, now=now)
            self._admit(now)
            reserved, used = self._advance(now, tick)
            ticks += 1
            running_sum += len(self.running)
            r.peak_running = max(r.peak_running, len(self.running))
            if self.queue and self.queue[0].arrival <= now:
                saturated_ticks += 1
                saturated_sum += len(self.running)
            if reserved:
                slack_sum += (reserved - used) / reserved
            if self.timeline_every and ticks % max(1, round(self.timeline_every / tick)) == 1:
                r.timeline.append((now, len(self.running), reserved, used))
            used_sum += used / self.node.memory
            now += tick
        r.makespan = now
        r.mean_running = running_sum / max(1, ticks)
        r.density = saturated_sum / saturated_ticks if saturated_ticks else r.mean_running
        r.slack_frac = slack_sum / max(1, ticks)
        r.mem_used_frac = used_sum / max(1, ticks)
        r.stretch = self.stretch_sum / max(1, r.completed)
        return r

    def _admit(self, now: float) -> None:
        while self.queue and self.queue[0].arrival <= now:
            task = self.queue[0]
            limits = self.static.get(task.env) or self._seed(task.env)
            if not (self._fits_elastic(task, limits) if self.elastic else self._fits(limits)):
                return
            self.queue.popleft()
            self.running[task.sandbox_id] = _Running(task, now, limits)
            if self.elastic:
                bounds = default_bounds(self.config, self.node.memory, self.node.cpu)
                self.states[task.sandbox_id] = initial_state(limits, bounds, now)

    def _fits(self, limits: CgroupLimits) -> bool:
        taken = sum(run.limits.mem_max for run in self.running.values())
        return taken + limits.mem_max <= self.node.memory

    def _fits_elastic(self, task: TaskTrace, limits: CgroupLimits) -> bool:
        taken = sum(s.limits.mem_high for s in self.states.values())
        if self.squeezed or taken + limits.mem_high > self.node.memory:
            return False
        envs = [run.task.env for run in self.running.values()] + [task.env]
        moments = [self._moments(env) for env in envs]
        spread = math.sqrt(sum(v for _, v in moments))
        need = sum(m for m, _ in moments) + self.node.admit_z * spread
        return need <= self.node.admit * self.node.memory

    def _moments(self, env: str) -> tuple[float, float]:
        runs = self.history.runs(env)[-SEED_RUNS:]
        if not runs:
            return float(UNKNOWN_ENV_MEAN), 0.0
        mean = sum(r.mem_mean for r in runs) / len(runs)
        peak = max(r.mem_peak for r in runs)
        return mean, ((peak - mean) / 2) ** 2

    def _seed(self, env: str) -> CgroupLimits:
        return self.history.seed(env, self.config) or initial_limits(
            self.config, DEFAULT_MEM, DEFAULT_CPU
        )

    def _cpu_budget(self) -> int:
        return round(self.node.cpu * self.config.cpu_overcommit)

    def _advance(self, now: float, dt: float) -> tuple[int, int]:
        """Move every running task one tick; returns (reserved, used) memory."""
        demands = {key: run.task.demand(run.pos) for key, run in self.running.items()}
        quota_use = {k: min(c, self.running[k].limits.cpu_millis) for k, (_, c) in demands.items()}
        total_cpu = sum(quota_use.values())
        share = min(1.0, self.node.cpu / total_cpu) if total_cpu else 1.0
        samples: dict[str, Sample] = {}
        for key, (mem, cpu) in demands.items():
            sample = self._sample(key, mem, cpu, quota_use[key], share, now, dt)
            if sample is not None:
                samples[key] = sample
        self._global_oom(samples, now)
        if self.elastic and self.states:
            self._policy_tick(samples, now)
        reserved = sum(run.limits.mem_high for run in self.running.values())
        return reserved, sum(s.mem_usage for s in samples.values())

    def _sample(
        self, key: str, mem: int, cpu: int, quota_use: int, share: float, now: float, dt: float
    ) -> Sample | None:
        """One task's tick: kill, hold or progress; the sample the policy would read."""
        run, r = self.running[key], self.result
        limit = run.limits.mem_high
        held = mem > limit
        if held and not (self.elastic and run.limits.hold):
            self._finish(key, killed=True, now=now)
            return None
        got = quota_use * share
        r.cpu_demand_s += cpu / 1000 * dt
        r.cpu_throttled_s += (cpu - quota_use) / 1000 * dt
        r.cpu_contended_s += (quota_use - got) / 1000 * dt
        if held:
            run.high_hits += 1
            r.mem_held_s += dt
        else:  # a held task waits; a throttled one runs at the share of CPU it gets
            run.pos += dt * (min(1.0, got / cpu) if cpu else 1.0)
        run.cpu_us += got * dt * 1e3
        run.throttled_us += dt * 1e6 * (cpu - quota_use) / cpu if cpu else 0.0
        sample = Sample(
            time=now,
            mem_usage=min(mem, limit),
            mem_limit=run.limits.mem_max,
            mem_high=limit,
            mem_high_hits=run.high_hits,
            held=held,
            cpu_usage_us=round(run.cpu_us),
            cpu_throttled_us=round(run.throttled_us),
            cpu_quota_millis=run.limits.cpu_millis,
        )
        run.stats.add_usage(sample, mem)
        return sample

    def _global_oom(self, samples: dict[str, Sample], now: float) -> None:
        """Kill the largest sandboxes while the node's memory is exceeded."""
        while samples and sum(s.mem_usage for s in samples.values()) > self.node.memory:
            victim = max(samples, key=lambda k: samples[k].mem_usage)
            samples.pop(victim)
            self._finish(victim, killed=True, now=now)
            self.result.global_ooms += 1

    def _policy_tick(self, samples: dict[str, Sample], now: float) -> None:
        tick = step(self.config, self.states, samples, self.node.memory, self._cpu_budget(), now)
        self.states = tick.states
        self.squeezed = any("mem:squeezed" in d.reasons for d in tick.decisions.values())
        self.result.squeezed_ticks += self.squeezed
        for key, state in tick.states.items():
            self.running[key].limits = state.limits

    def _finish(self, key: str, *, killed: bool, now: float) -> None:
        run = self.running.pop(key)
        self.states.pop(key, None)
        if killed:
            self.result.oom_kills += 1
            return
        self.result.completed += 1
        self.stretch_sum += (now - run.start) / max(run.task.duration, 1e-9)
        summary = run.stats.summary()
        if summary is not None:
            self.history.record(run.task.env, summary)


def _static_limits(
    trace: Trace, config: PolicyConfig, node: Node, policy: str
) -> dict[str, CgroupLimits]:
    """Per-environment fixed limits from the trace: largest peak or mean of its tasks."""
    if policy == "elastic":
        return {}
    limits = {}
    for env, tasks in trace.by_env().items():
        if policy == "static-peak":
            mem = max(t.peak()[0] for t in tasks)
            cpu = max(t.peak()[1] for t in tasks)
        else:
            mem = round(sum(t.mean()[0] for t in tasks) / len(tasks))
            cpu = round(sum(t.mean()[1] for t in tasks) / len(tasks))
        mem = min(node.memory, quantize(max(mem, 1), config.mem_quantum))
        cpu = max(config.cpu_quantum, quantize(max(cpu, 1), config.cpu_quantum))
        limits[env] = CgroupLimits(mem, mem, cpu, hold=False)
    return limits


def simulate(
    trace: Trace,
    node: Node,
    policy: str,
    config: PolicyConfig | None = None,
    *,
    timeline_every: float = 0.0,
) -> SimResult:
    """Run one policy (static-peak, static-mean or elastic) over `trace` on `node`.

    `timeline_every` > 0 records (time, running, reserved, used) that often, for plots.
    """
    return _Sim(trace, node, policy, config or PolicyConfig(), timeline_every).run()


def compare(
    trace: Trace,
    node: Node,
    config: PolicyConfig | None = None,
    policies: tuple[str, ...] = POLICIES,
    *,
    timeline_every: float = 0.0,
) -> list[SimResult]:
    """The policies side by side on the same trace and node."""
    return [simulate(trace, node, p, config, timeline_every=timeline_every) for p in policies]
